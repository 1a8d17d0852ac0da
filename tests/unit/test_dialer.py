"""Peers announce where they can be dialed, and are dialed there before a stream."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hivemind.p2p import PeerID

from dht.records import MAX_ADDRS, PeerRecord, Reachability, RecordError, reachability_of
from node.p2p.dialer import PeerDialer, p2pd_multiaddr
from node.p2p.reachability import NatReachability, announced_addresses

PEER = PeerID.from_base58("QmVB964ah4GajudGjs7qNM3NNgVHCFZqgMtcW1f71V9qcE").to_base58()
DIRECT = "/ip4/10.77.1.2/tcp/4001"
RELAYED = f"/ip4/10.77.1.2/tcp/4001/p2p/{PEER}/p2p-circuit"


class FakeClient:
    def __init__(self, fail: bool = False, delay: float = 0.0):
        self.calls: list[tuple[str, list[str]]] = []
        self.fail, self.delay = fail, delay

    async def connect(self, peer_id, maddrs) -> None:
        self.calls.append((peer_id.to_base58(), [str(m) for m in maddrs]))
        await asyncio.sleep(self.delay)
        if self.fail:
            raise ConnectionError("dial backoff")


def dialer_with(client: FakeClient, addrs: list[str]) -> PeerDialer:
    return PeerDialer(SimpleNamespace(_client=client), lambda peer_id: addrs)  # type: ignore[arg-type]


def test_reachability_reads_the_announced_addresses():
    assert reachability_of([DIRECT]) == Reachability.PUBLIC
    assert reachability_of([DIRECT, RELAYED]) == Reachability.RELAYED  # a NAT'ed peer lists its LAN address too
    assert reachability_of([RELAYED]) == Reachability.RELAYED
    assert reachability_of([]) == Reachability.UNKNOWN


def test_addresses_travel_in_the_record_and_are_validated():
    record = PeerRecord(peer_id=PEER, stage=1, addrs=[DIRECT, RELAYED], reachability=Reachability.PUBLIC)
    assert PeerRecord.from_wire(record.to_wire()) == record
    for bad in ([1], "notalist", [DIRECT] * (MAX_ADDRS + 1), ["x" * 1000]):
        with pytest.raises(RecordError):
            PeerRecord.from_wire({**record.to_wire(), "addrs": bad})
    with pytest.raises(RecordError):
        PeerRecord.from_wire({**record.to_wire(), "reachability": "everywhere"})
    old = record.to_wire()
    del old["addrs"], old["reachability"]  # a record without them still reads
    assert PeerRecord.from_wire(old).addrs == []


def test_a_peer_is_dialed_once_until_a_stream_to_it_fails():
    client = FakeClient(delay=0.05)
    dialer = dialer_with(client, [DIRECT, "not a multiaddr"])

    async def main() -> None:
        results = await asyncio.gather(*(dialer.ensure(PEER) for _ in range(5)))  # one dial for them all
        assert results == [True] * 5
        assert await dialer.ensure(PEER)
        assert len(client.calls) == 1 and client.calls[0] == (PEER, [DIRECT])  # the unparsable one skipped
        dialer.forget(PEER)
        assert await dialer.ensure(PEER)
        assert len(client.calls) == 2

    asyncio.run(main())


def test_a_failed_dial_is_reported_and_retried():
    client = FakeClient(fail=True)
    dialer = dialer_with(client, [DIRECT])

    async def main() -> None:
        assert not await dialer.ensure(PEER)
        assert not await dialer.ensure(PEER)
        assert len(client.calls) == 2
        assert not await dialer_with(client, []).ensure(PEER)  # nothing announced: nothing dialed
        assert len(client.calls) == 2

    asyncio.run(main())


def test_a_peer_behind_a_nat_announces_circuits_through_its_relays() -> None:
    relay = "/ip4/10.77.1.2/tcp/4001/p2p/12D3KooWJ6FwFFcm2oFwTy2y9d6yTMvve8iPNqizjcJPb1gs1knS"
    lan = "/ip4/10.78.2.2/tcp/36687/p2p/12D3KooWQQ1q3ASV7hxhSAeRWwNDsX9hy3QgeRgJRfPe6NC4PYbh"
    no_id = "/ip4/10.77.1.3/tcp/4001"  # a relay we cannot name cannot carry a circuit
    assert announced_addresses([lan], [relay, no_id], NatReachability.PRIVATE) == [lan, relay + "/p2p-circuit"]
    # one p2pd already lists is not repeated; public and auto peers announce what p2pd sees
    assert announced_addresses([lan, relay + "/p2p-circuit"], [relay], NatReachability.PRIVATE) == [
        lan,
        relay + "/p2p-circuit",
    ]
    assert announced_addresses([lan], [relay], NatReachability.PUBLIC) == [lan]
    assert announced_addresses([lan], [relay], NatReachability.AUTO) == [lan]
    assert reachability_of(announced_addresses([lan], [relay], NatReachability.PRIVATE)) == Reachability.RELAYED


def test_peer_ids_reach_p2pd_as_bare_multihashes():
    # hivemind's multiaddr writes /p2p/<id> as a CIDv1 (0x01 0x72 ...), which p2pd refuses outright
    # ("length greater than remaining number of bytes in buffer"): every dial and re-entry failed
    circuit = f"{RELAYED}/p2p/{PEER}"
    encoded = p2pd_multiaddr(circuit)
    assert str(encoded) == circuit
    assert b"\x01\x72\x12\x20" not in encoded.to_bytes()
    assert encoded.to_bytes().count(b"\xa5\x03\x22\x12\x20") == 2  # code 421, 34 bytes, sha2-256 multihash
    assert p2pd_multiaddr("/ip4/10.77.1.2/tcp/4001").to_bytes().hex() == "040a4d0102060fa1"

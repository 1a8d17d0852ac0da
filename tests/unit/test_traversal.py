"""NAT traversal on loopback (node/p2p/relay.py, node/p2p/traversal.py): a peer registered with a relay
is reached by a punched link or a relayed one, both ordinary authenticated direct links; the relay
keeps to its budget, refuses what it cannot do, and a stranger's junk ends only its own connection.
The same through real NAT routers: tests/netns/test_two_homes.py."""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest

from dht.identity_keys import Identity
from dht.records import LinkPath, PeerRecord, PeerState, Reachability, RecordError
from node.p2p import sealed_link
from node.p2p.direct import DirectLinks
from node.p2p.relay import Relay, RelayBudget
from node.p2p.sealed_link import DirectLinkError
from node.p2p.traversal import PUNCH_RETRY_AFTER, PathLog, RelayRoute, Traversal, relay_routes
from tests.unit.test_direct_links import SERVICE, SWARM, Frames, echo_listener, run

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def identities() -> list[Identity]:
    return [Identity.generate() for _ in range(3)]


async def wait_until(condition, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


async def three_peers(identities: list[Identity], budget: RelayBudget):
    """A relay, a peer A that asks for links, and an echoing peer B registered with the relay."""
    relay_links = DirectLinks(identities[0])
    relay_port = await relay_links.listen(HOST, 0)
    relay = Relay(identities[0], SWARM, budget)
    relay.attach(relay_links)
    route = RelayRoute(identities[0].peer_id, ((HOST, relay_port),))
    b_links, _, served, _ = await echo_listener(identities[2])
    b = Traversal(b_links, SWARM)
    registered: list[list[str]] = []
    keeper = asyncio.create_task(b.keep_registered(lambda: [route], registered.append))
    a_links = DirectLinks(identities[1])
    await a_links.listen(HOST, 0)
    a = Traversal(a_links, SWARM)
    a.relays_of = lambda peer_id: [route] if peer_id == identities[2].peer_id else []
    await wait_until(lambda: registered and registered[-1] == [identities[0].peer_id])
    return relay, route, a, b, served, keeper


async def echo_through(a: Traversal, peer_id: str, payload: bytes) -> bytes:
    link = await a.direct.open(peer_id, [], SWARM, SERVICE, 10.0)
    frames = Frames(link)
    frames.send(payload)
    try:
        return await frames.next()
    finally:
        link.close()


def test_a_registered_peer_is_reached_by_a_punched_link(identities):
    async def main():
        relay, _route, a, b, served, keeper = await three_peers(identities, RelayBudget(1 << 30, 1e9))
        try:
            assert a.direct.reaches_through_relay(identities[2].peer_id)
            assert await echo_through(a, identities[2].peer_id, b"through a hole") == b"through a hole"
            assert served == [identities[1].peer_id]  # B's handler saw A, authenticated end to end
            assert a.paths.counts[LinkPath.PUNCHED] == 1 and a.paths.counts[LinkPath.RELAYED] == 0
            assert a.paths.announced() == {identities[2].peer_id: "punched"}
            await wait_until(lambda: b.paths.counts[LinkPath.PUNCHED] == 1)
            assert relay.stats.introduced == 1 and relay.stats.spliced == 0 and relay.stats.relayed_bytes == 0
        finally:
            keeper.cancel()

    run(main())


def test_after_a_failed_punch_the_relay_carries_the_link_within_its_budget(identities):
    async def main():
        relay, _route, a, _b, served, keeper = await three_peers(identities, RelayBudget(3 << 20, 1e9))
        try:
            a.paths.punch_failed(identities[2].peer_id)  # as after a symmetric NAT
            payload = os.urandom(1 << 20)
            assert await echo_through(a, identities[2].peer_id, payload) == payload
            assert a.paths.counts[LinkPath.RELAYED] == 1 and a.paths.counts[LinkPath.PUNCHED] == 0
            assert relay.stats.spliced == 1
            await wait_until(lambda: relay.stats.relayed_bytes >= 2 << 20)
            # the relay carried sealed records only: the payload never crossed it in the clear
            # (checked by the handshake's keys, which the relay never sees); and its budget holds:
            # a second megabyte each way exceeds it, and the link ends instead of carrying more
            with pytest.raises((EOFError, ConnectionError, DirectLinkError, TimeoutError)):
                await echo_through(a, identities[2].peer_id, os.urandom(1 << 20))
            assert relay.stats.relayed_bytes <= relay.budget.total
            assert len(served) >= 1 and set(served) == {identities[1].peer_id}
        finally:
            keeper.cancel()

    run(main())


def test_a_relay_refuses_an_unregistered_peer_and_junk_pairings(identities):
    async def main():
        relay, route, a, _b, _served, keeper = await three_peers(identities, RelayBudget(1 << 20, 1e9))
        try:
            stranger = Identity.generate().peer_id
            a.relays_of = lambda peer_id: [route]
            with pytest.raises(DirectLinkError, match="not registered"):
                await a.open(stranger, SERVICE, 8.0)
            assert a.paths.announced()[stranger] == "failed"
            assert a.paths.worth_punching(stranger)  # a refusal is not a NAT that defeats punching
            # a pairing connection with a token the relay never gave: closed, nothing else
            link = await sealed_link.connect(*route.addresses[0])
            link.write_handshake(msgpack.packb({"pair": os.urandom(16)}, use_bin_type=True))
            with pytest.raises(DirectLinkError):
                await asyncio.wait_for(link.read_handshake(4096, "answer"), 5.0)
            assert relay.stats.introduced == 0 and relay.registered == [identities[2].peer_id]
            # and the relay still works
            assert await echo_through(a, identities[2].peer_id, b"still") == b"still"
        finally:
            keeper.cancel()

    run(main())


def test_a_failed_punch_skips_punching_for_a_while():
    log = PathLog()
    assert log.worth_punching("p", now=0.0)
    log.punch_failed("p", now=0.0)
    assert not log.worth_punching("p", now=PUNCH_RETRY_AFTER - 1)
    assert log.worth_punching("p", now=PUNCH_RETRY_AFTER + 1)
    log.punch_failed("p", now=PUNCH_RETRY_AFTER + 1)  # twice in a row: twice as long
    assert not log.worth_punching("p", now=3 * PUNCH_RETRY_AFTER)
    log.punched("p")
    assert log.worth_punching("p", now=0.0)


def test_a_relay_budget_charges_bytes_and_paces_them():
    budget = RelayBudget(total=1000, rate=100.0, _updated=0.0)
    assert budget.take(100, now=1.0) == 0.0  # one second's allowance
    assert budget.take(100, now=1.0) == pytest.approx(1.0)  # over the rate: wait a second
    assert budget.left == 800
    with pytest.raises(Exception, match="spent"):
        budget.take(801, now=10.0)


def test_records_announce_relays_and_paths_and_reject_junk(identities):
    relay = PeerRecord(identities[0].peer_id, 0, PeerState.ONLINE, addrs=["/ip4/10.77.1.2/tcp/4000"])
    relay.direct_port, relay.reachability, relay.relay_budget = 4001, Reachability.PUBLIC, 10**9
    home = PeerRecord(identities[1].peer_id, 1, PeerState.ONLINE, reachability=Reachability.RELAYED)
    home.relays, home.paths = [identities[0].peer_id], {identities[2].peer_id: "punched"}
    back = PeerRecord.from_wire(home.to_wire())
    assert back.relays == home.relays and back.paths == home.paths
    records = {r.peer_id: r for r in (relay, home)}
    assert relay_routes(home, records.get) == [RelayRoute(relay.peer_id, (("10.77.1.2", 4001),))]
    relay.relay_budget = 0  # spent: no route through it
    assert relay_routes(home, records.get) == []
    with pytest.raises(RecordError):
        PeerRecord.from_wire({**home.to_wire(), "paths": {"x": "teleported"}})
    with pytest.raises(RecordError):
        PeerRecord.from_wire({**home.to_wire(), "relays": ["r"] * 100})


def test_the_dashboard_reach_column_counts_the_paths_a_record_announces():
    from node.monitor.dashboard.peer_table import paths_text

    assert paths_text({"a": "punched", "b": "punched", "c": "relayed", "d": "failed"}) == " 2p 1r 1!"
    assert paths_text({}) == "" and paths_text(None) == "" and paths_text({"a": 3}) == ""

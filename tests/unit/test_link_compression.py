"""Each hop's encoding (node/pipeline/link_compression.py), and the link rates it is chosen from
(node/p2p/link_capacity.py): int8 only while fp16 would keep this peer's measured links busy; the
usual encoding wherever nothing is measured."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket

import pytest
import torch

from dht.identity_keys import Identity
from dht.records import PeerRecord, PeerState
from node.p2p.direct import DirectLinks
from node.p2p.link_capacity import MIN_ACKED_BYTES, LinkCapacity
from node.pipeline import link_compression
from node.pipeline.hops import HopSender, PipelineStats
from node.pipeline.link_compression import (
    ENGAGE,
    HOLDS,
    RECENT,
    REFRESH,
    RELEASE,
    SUSTAIN,
    SUSTAIN_AFTER_PROBE,
    LinkCompression,
    LinkLoad,
    choose_compression,
    uplink_load,
)
from node.pipeline.routing import Router
from protocol import DEFAULT_LIMITS, BackwardHeader, Compression, MessageKind
from tests.helpers.clock import FakeClock
from tests.helpers.known_peers import KnownPeers
from tests.helpers.posted import PostingTransport, forward_header, outcome

FP16, INT8 = Compression.FP16, Compression.INT8
MBIT = 1e6 / 8  # bytes/s
HIDDEN = {"hidden": torch.zeros(8, 64, 64)}  # 64 KiB in fp16: a default microbatch's activations


def test_the_load_is_what_the_recent_links_carry_over_the_slowest_rate():
    # 64 KiB every 30 ms on a 50 Mbit/s link keeps it ~35 % busy
    busy = LinkLoad(payload=65536, last=10.0, interval=0.03, rate=50 * MBIT)
    assert uplink_load([busy], now=10.0) == pytest.approx(0.35, abs=0.01)
    # two such links from one peer share its uplink: 70 %; a burst read at line rate changes nothing
    burst_read = LinkLoad(65536, last=10.0, interval=0.03, rate=10_000 * MBIT)
    assert uplink_load([busy, burst_read], now=10.0) == pytest.approx(0.70, abs=0.02)
    # a link not measured (through p2pd) still adds its bytes; one idle for longer than RECENT and one
    # with a single hop so far add nothing
    unmeasured = LinkLoad(65536, last=10.0, interval=0.03, rate=None)
    idle = LinkLoad(65536, last=10.0 - RECENT - 0.1, interval=0.03, rate=1 * MBIT)
    first_hop = LinkLoad(65536, last=10.0, interval=None, rate=50 * MBIT)
    assert uplink_load([busy, unmeasured, idle, first_hop], now=10.0) == pytest.approx(0.70, abs=0.02)
    # nothing measured at all: no load
    assert uplink_load([unmeasured], now=10.0) == 0.0


def test_the_choice_engages_and_releases_at_different_loads():
    assert ENGAGE > RELEASE
    between = (ENGAGE + RELEASE) / 2
    assert choose_compression(ENGAGE + 0.01, FP16, FP16, INT8) is INT8
    assert choose_compression(between, FP16, FP16, INT8) is FP16  # not yet
    assert choose_compression(between, INT8, FP16, INT8) is INT8  # not yet back
    assert choose_compression(RELEASE - 0.01, INT8, FP16, INT8) is FP16


def hops_every(chooser: LinkCompression, clock: FakeClock, seconds: float, links: list[tuple[str, str]], n: int):
    chosen = []
    for _ in range(n):
        clock.now += seconds
        chosen += [chooser.for_hop(peer, service, HIDDEN) for peer, service in links]
    return chosen


def test_a_peer_whose_links_fp16_would_fill_compresses_until_a_probe_finds_them_fast(caplog):
    clock = FakeClock(0.0)
    rates = {"s1": 50 * MBIT, "s2": 50 * MBIT}
    reads: list[str] = []

    def link_rate(peer_id: str, service: str) -> float | None:
        reads.append(peer_id)
        return rates.get(peer_id)

    chooser = LinkCompression(FP16, INT8, link_rate, clock)
    links = [("s1", "forward"), ("s2", "backward")]

    def run(seconds: float, interval: float = 0.02) -> list[Compression]:
        return hops_every(chooser, clock, interval, links, round(seconds / interval))

    with caplog.at_level(logging.INFO, logger="node.pipeline.link_compression"):
        # a microbatch every 30 ms on two 50 Mbit/s links: fp16 would keep them ~70 % busy, and once
        # that lasted SUSTAIN seconds the hops go in int8
        chosen = run(2 * SUSTAIN, interval=0.03)
        assert set(chosen[: 2 * round(0.9 * SUSTAIN / 0.03)]) == {FP16} and chosen[-1] is INT8
        # compressed, the pipeline runs faster, which keeps it compressed (no swing back); the links'
        # rates are not read meanwhile: an int8 burst's reading says little about fp16
        reads.clear()
        assert set(run(HOLDS[0] - 2 * SUSTAIN)) == {INT8}
        assert reads == []
        # still slow when the first hold ends: fp16 is measured again, and int8 is back within
        # SUSTAIN_AFTER_PROBE (the link was slow a hold ago), not SUSTAIN
        chosen = run(HOLDS[0])
        assert FP16 in chosen and chosen[-1] is INT8
        assert chosen.count(FP16) <= 2 * (SUSTAIN_AFTER_PROBE + 2 * REFRESH) / 0.02
        # the paths got fast (say, a LAN): the next hold is twice as long, then fp16 for good
        rates.update(s1=10_000 * MBIT, s2=10_000 * MBIT)
        assert set(run(HOLDS[1] - HOLDS[0])) == {INT8}
        assert set(run(HOLDS[0] + 2 * SUSTAIN)[-10:]) == {FP16}
    changes = [r.getMessage() for r in caplog.records]
    assert [c.split(":")[0] for c in changes] == ["pipeline hops in " + c for c in ("int8", "fp16", "int8", "fp16")]
    assert changes[0].startswith("pipeline hops in int8: in fp16 they would keep this peer's links 7")
    assert changes[0].endswith("busy (the slowest of 2 at 50.0 Mbit/s)")
    assert changes[1] == f"pipeline hops in fp16: after {HOLDS[0]:.0f} s, measuring the links again"
    assert changes[2].startswith("pipeline hops in int8: in fp16 they would keep this peer's links 1")
    assert changes[3] == f"pipeline hops in fp16: after {HOLDS[1]:.0f} s, measuring the links again"


def test_slow_but_quiet_or_unmeasured_links_keep_the_usual_encoding():
    clock = FakeClock(0.0)
    # a microbatch every 200 ms on a 50 Mbit/s link: ~5 % busy
    quiet = LinkCompression(FP16, INT8, lambda peer_id, service: 50 * MBIT, clock)
    assert set(hops_every(quiet, clock, 0.2, [("s1", "forward")], 20)) == {FP16}
    # busy, but nothing measured (through p2pd)
    unmeasured = LinkCompression(FP16, INT8, lambda peer_id, service: None, clock)
    assert set(hops_every(unmeasured, clock, 0.005, [("s1", "forward")], 20)) == {FP16}
    # loopback, flat out
    loopback = LinkCompression(FP16, INT8, lambda peer_id, service: 20_000 * MBIT, clock)
    assert set(hops_every(loopback, clock, 0.001, [("s1", "forward"), ("s2", "backward")], 50)) == {FP16}
    # equal encodings: nothing to choose
    never = LinkCompression(FP16, FP16, lambda peer_id, service: 1.0, clock)
    assert set(hops_every(never, clock, 0.001, [("s1", "forward")], 5)) == {FP16}


def test_links_are_read_and_the_load_weighed_at_most_once_per_refresh(monkeypatch):
    clock = FakeClock(0.0)
    reads: list[str] = []

    def link_rate(peer_id: str, service: str) -> float | None:
        reads.append(peer_id)
        return 50 * MBIT

    chooser = LinkCompression(FP16, INT8, link_rate, clock)
    weighed = []
    real_load = link_compression.uplink_load
    monkeypatch.setattr(
        link_compression, "uplink_load", lambda links, now: weighed.append(now) or real_load(links, now)
    )
    # a hop every millisecond on two links for one second: 2,000 hops, ~10 reads of each link
    hops_every(chooser, clock, 0.001, [("s1", "forward"), ("s2", "backward")], 1000)
    assert 2 * (1.0 / REFRESH) <= len(reads) <= 2 * (1.0 / REFRESH + 1)
    assert reads.count("s1") == reads.count("s2")
    assert 1.0 / REFRESH <= len(weighed) <= 1.0 / REFRESH + 1


class ByPeer:
    """A chooser that says int8 for some peers (what the sealing test needs, not the rule)."""

    def __init__(self, compressed: set[str]) -> None:
        self.compressed = compressed

    def for_hop(self, peer_id, service, tensors):
        return INT8 if peer_id in self.compressed else FP16


class SealingTransport(PostingTransport):
    """Records the encoding each hop was sealed in; every peer takes every hop, or refuses it BUSY."""

    def __init__(self, busy: set[str]) -> None:
        super().__init__()
        self.busy, self.sealed, self.sent = busy, [], []

    def seal_posted(self, message, compression=None):
        self.sealed.append(compression)
        return f"payload in {compression}".encode()

    def settle(self, peer_id: str, payload: bytes) -> asyncio.Future:
        self.sent.append((peer_id, payload))
        if peer_id in self.busy:
            return outcome(MessageKind.BUSY, "queue full")
        return outcome()


def test_a_routed_hop_is_sealed_once_for_the_first_peers_link():
    router = Router(random.Random(0), num_stages=2)
    # "near" announces the higher throughput, so it is tried first; it refuses BUSY
    router.refresh(
        {1: [PeerRecord("near", 1, PeerState.ONLINE, throughput=10.0), PeerRecord("far", 1, PeerState.ONLINE)]}
    )
    transport = SealingTransport(busy={"near"})
    hops = HopSender(transport, router, PipelineStats(), 5.0, 3, KnownPeers(), compression=ByPeer({"far"}))
    tensors = {"hidden": torch.zeros(8, 128, 64)}

    lost: list[int] = []

    async def scenario():
        assert await hops.send_routed(1, "forward", forward_header(1), tensors, lambda: lost.append(1)) == "far"
        backward = BackwardHeader(1, ("origin", "far"), 1)
        assert await hops.send_to("far", "backward", backward, tensors, lambda: lost.append(1))

    asyncio.run(scenario())
    # the routed hop: sealed once, in fp16 for near's fast link, and after near's BUSY the same payload
    # went to far (a reroute does not encode again); the hop sent to far from the start went in int8
    assert transport.sealed == [FP16, INT8] and not lost
    assert transport.sent == [("near", b"payload in fp16"), ("far", b"payload in fp16"), ("far", b"payload in int8")]


def test_link_capacity_is_the_largest_sample_of_its_horizon(monkeypatch):
    # (bytes acknowledged, delivery rate) of successive reads of TCP_INFO
    acked_and_rates = [(MIN_ACKED_BYTES - 1, 900.0), (MIN_ACKED_BYTES, 300.0), (2 * MIN_ACKED_BYTES, 500.0)]
    samples = iter([*acked_and_rates, (3 * MIN_ACKED_BYTES, 200.0), (4 * MIN_ACKED_BYTES, 100.0)])
    clock = FakeClock(0.0)

    def fake_info(sock):
        acked, rate = next(samples)
        info = bytearray(168)
        info[120:128] = acked.to_bytes(8, "little")
        info[160:168] = int(rate).to_bytes(8, "little")
        return bytes(info)

    monkeypatch.setattr("node.p2p.link_capacity._tcp_info", fake_info)
    capacity = LinkCapacity(sock=None, horizon=10.0, clock=clock)
    assert capacity.bytes_per_second() is None  # slow start: not enough acknowledged yet
    assert capacity.bytes_per_second() == 300.0
    clock.now = 5.0
    assert capacity.bytes_per_second() == 500.0
    clock.now = 12.0
    assert capacity.bytes_per_second() == 500.0  # 500 (t=5) is still within 10 s, and beats 200
    clock.now = 15.5
    assert capacity.bytes_per_second() == 200.0  # 500 aged out: the largest left is 200 (t=12)


def test_a_direct_link_measures_its_rate_and_a_unix_stream_has_none():
    identity_server, identity_client = Identity.generate(), Identity.generate()

    async def scenario():
        server = DirectLinks(identity_server)

        async def sink(sender: str, link) -> None:
            ended = asyncio.get_running_loop().create_future()
            link.start(lambda frame: None, lambda error: ended.set_result(error), DEFAULT_LIMITS)
            await ended

        server.serve("swarm", "forward", sink)
        port = await server.listen("127.0.0.1", 0)
        client = DirectLinks(identity_client)
        link = await client.open(identity_server.peer_id, [("127.0.0.1", port)], "swarm", "forward", 5.0)
        capacity = LinkCapacity.of(link)
        assert capacity is not None and capacity.bytes_per_second() is None  # nothing acknowledged yet
        payload = os.urandom(256 * 1024)
        link.start(lambda frame: None, lambda error: None, DEFAULT_LIMITS)
        for _ in range(16):  # 4 MiB
            link.send_frame(payload)
            await link.drain()
        rate = None
        for _ in range(50):  # the last ACKs may trail the writes by a moment
            rate = capacity.bytes_per_second()
            if rate is not None:
                break
            await asyncio.sleep(0.02)
        link.close()
        await server.close()
        await client.close()
        # a unix socket (what a stream through p2pd is) says nothing about the path
        left, right = socket.socketpair()
        _, writer = await asyncio.open_unix_connection(sock=left)
        unix_capacity = LinkCapacity.of(writer)
        writer.close()
        right.close()
        return rate, unix_capacity

    rate, unix_capacity = asyncio.run(asyncio.wait_for(scenario(), 30.0))
    assert rate is not None and rate > 100 * MBIT, rate  # loopback: far faster than any home link
    assert unix_capacity is None


@pytest.mark.parametrize("compression", [FP16, INT8])
def test_the_transport_seals_a_posted_hop_in_the_encoding_asked(compression):
    from node.p2p.transport import Transport
    from protocol import open_message

    transport = Transport(None, "swarm", 0, compression=FP16)
    meta = {"microbatch_id": 1, "path": ["QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"], "hop": 1}
    message = transport.message(MessageKind.BACKWARD, meta, {"grad": torch.randn(8, 128, 64)})
    payload = transport.seal_posted(message, compression)
    opened = open_message(payload, expected_swarm="swarm")
    assert opened.tensors["grad"].dtype == torch.float32
    expected = 128 * 1024 if compression is FP16 else 64 * 1024
    assert expected < len(payload) < expected * 1.1  # int8's fp32 scales add 1/64

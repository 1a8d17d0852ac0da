"""Two peers behind NATs keep apart: a relayed circuit cannot be relied on past 128 KiB (docs/operations.md), so a
relayed peer routes its microbatches to directly dialable peers when it has any."""

from __future__ import annotations

import asyncio
import random

import pytest

from dht.records import PeerRecord, PeerState, Reachability
from node.p2p.reachability import carries_training
from node.pipeline.hops import HopSender, PipelineStats
from node.pipeline.routing import Router
from protocol import MessageKind
from tests.helpers.known_peers import KnownPeers
from tests.helpers.posted import PostingTransport, forward_header, outcome


def test_only_two_relayed_peers_cannot_carry_training():
    for mine in Reachability:
        for theirs in Reachability:
            both_relayed = mine == theirs == Reachability.RELAYED
            assert carries_training(mine, theirs) is not both_relayed


def send_many(peers: list[str], unreachable: set[str], count: int) -> list[str]:
    router = Router(random.Random(0), num_stages=2)
    router.refresh({1: [PeerRecord(p, 1, PeerState.ONLINE, throughput=10.0) for p in peers]})
    transport = PostingTransport()
    hops = HopSender(transport, router, PipelineStats(), 5.0, 3, KnownPeers(unreachable=unreachable))

    async def main() -> None:
        for microbatch_id in range(count):
            lost = lambda: pytest.fail("a hop to an idle stage was lost")  # noqa: E731
            assert await hops.send_routed(1, "forward", forward_header(microbatch_id), {}, lost)

    asyncio.run(main())
    return transport.sent_to


def test_a_relayed_peer_routes_around_other_relayed_peers():
    sent = send_many(["public", "home-b"], unreachable={"home-b"}, count=20)
    assert sent == ["public"] * 20


def test_when_only_relayed_peers_are_left_it_still_tries_them():
    sent = send_many(["home-b", "home-c"], unreachable={"home-b", "home-c"}, count=10)
    assert set(sent) == {"home-b", "home-c"}
    assert send_many(["public", "home-b"], unreachable=set(), count=20).count("home-b") >= 5


def test_a_busy_direct_peer_does_not_send_the_hop_to_a_relayed_one():
    router = Router(random.Random(0), num_stages=2)
    router.refresh({1: [PeerRecord(p, 1, PeerState.ONLINE, throughput=10.0) for p in ("public", "home-b")]})
    transport = PostingTransport()
    transport.settle = lambda peer_id, payload: outcome(MessageKind.BUSY)
    hops = HopSender(transport, router, PipelineStats(), 5.0, 3, KnownPeers(unreachable={"home-b"}))
    lost = []
    sent = asyncio.run(hops.send_routed(1, "forward", forward_header(1), {}, lambda: lost.append(1)))
    assert sent is None and lost == [1]
    assert transport.sent_to == ["public"]

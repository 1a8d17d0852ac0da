"""One ban store (node/p2p/bans.py): a ban for evidence (gossip, a spot-check, bad input) refuses
that peer everywhere: its next stream at admission (PeerConduct), its next routed hop, its next
gossip round; a hop that failed or was refused makes routing and gossip avoid the peer and leaves
its own streams admitted. Each writer here is the real one, wired as build_service wires
them: the Router and the PeerConduct hold the same BanList."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import torch

from dht.records import PeerRecord, PeerState
from node.averaging.round_context import RoundContext
from node.config import GossipConfig
from node.p2p.bans import BanList
from node.p2p.peer_conduct import ConductLimits, PeerConduct
from node.pipeline.hops import HopSender, PipelineStats
from node.pipeline.routing import Router
from protocol import MessageKind
from tests.helpers.clock import FakeClock
from tests.helpers.known_peers import KnownPeers
from tests.helpers.posted import PostingTransport, forward_header

BANNED = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
HONEST = "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"


class NoEvents:
    def publish(self, *args: object, **kwargs: object) -> None:
        pass


def wired(clock: FakeClock) -> tuple[BanList, Router, PeerConduct]:
    bans = BanList(clock=clock)
    router = Router(random.Random(0), num_stages=2, dht_clock=clock, bans=bans)
    router.refresh({1: [PeerRecord(p, 1, PeerState.ONLINE) for p in (BANNED, HONEST)]})
    conduct = PeerConduct(ConductLimits(total_streams=8), ban_until=lambda p: clock.now + 60, bans=bans, clock=clock)
    return bans, router, conduct


def gossip_of(bans: BanList, clock: FakeClock) -> RoundContext:
    worker = SimpleNamespace(module=torch.nn.Linear(2, 2), inner_step=0)
    me = SimpleNamespace(stage=1, peer_id=HONEST)
    return RoundContext(
        GossipConfig(),
        me,
        worker,
        SimpleNamespace(direct=None),  # no direct links: peers are reached through p2pd only
        None,
        bans,
        lambda p: clock.now + 60,
        NoEvents(),
        random.Random(0),
    )  # type: ignore[arg-type]


def test_a_peer_banned_by_gossip_is_refused_at_admission_and_by_routing():
    clock = FakeClock(5000.0)
    bans, router, conduct = wired(clock)
    assert conduct.admit(BANNED) is None
    conduct.release(BANNED)
    gossip_of(bans, clock).reject(BANNED, "non-finite Delta")
    assert conduct.admit(BANNED) == "banned for bad input"
    assert conduct.admit(HONEST) is None
    assert all(router.choose(1) == HONEST for _ in range(5))
    clock.now += 61  # its record expired: the ban with it, everywhere
    assert conduct.admit(BANNED) is None


def test_a_peer_that_refused_a_hop_is_avoided_but_its_own_streams_are_admitted():
    """An ERROR to a routed hop says the peer could not serve it (it moved stage, it is closing),
    not that its input is bad: the stage's other peers serve the next hops, and the peer's own
    forwards and gradients still get in (a moved peer must reach its new neighbours)."""
    clock = FakeClock(5000.0)
    bans, router, conduct = wired(clock)
    transport = PostingTransport()
    hops = HopSender(transport, router, PipelineStats(), 0.1, 3, KnownPeers(ban_seconds=60, clock=clock))  # type: ignore[arg-type]

    async def refused_with_an_error() -> None:
        while BANNED not in transport.late_refusals:
            await hops.send_routed(1, "forward", forward_header(1), {}, lambda: None)
        transport.late_refusals[BANNED](SimpleNamespace(kind=MessageKind.ERROR, meta={"reason": "cannot take it"}))

    asyncio.run(refused_with_an_error())
    assert bans.is_banned(BANNED) and not bans.refuses(BANNED)
    assert all(router.choose(1) == HONEST for _ in range(5))
    assert conduct.admit(BANNED) is None and conduct.admit(HONEST) is None


def test_evidence_outlasts_and_outweighs_a_later_avoidance():
    clock = FakeClock(5000.0)
    bans = BanList(clock=clock)
    bans.ban(BANNED, clock.now + 600, "spot-checks: wrong output")
    bans.ban(BANNED, clock.now + 60, "refused a hop", evidence=False)
    assert bans.refuses(BANNED) and bans.active()[BANNED][0] == clock.now + 600
    bans.ban(HONEST, clock.now + 60, "refused a hop", evidence=False)
    bans.ban(HONEST, clock.now + 30, "non-finite Delta")
    assert bans.refuses(HONEST) and bans.active()[HONEST][0] == clock.now + 60
    clock.now += 61
    assert not bans.is_banned(HONEST) and not bans.refuses(HONEST) and bans.refuses(BANNED)


def test_a_peer_banned_for_bad_input_is_avoided_by_routing_and_gossip():
    clock = FakeClock(5000.0)
    bans, router, conduct = wired(clock)
    for _ in range(conduct.limits.strikes_to_ban):
        conduct.strike(BANNED, "malformed forward")
    assert bans.is_banned(BANNED) and conduct.bans().keys() == {BANNED}
    assert all(router.choose(1) == HONEST for _ in range(5))
    rounds = gossip_of(bans, clock)
    rounds.view = SimpleNamespace(online=lambda stage, exclude=None: [PeerRecord(BANNED, 1, PeerState.ONLINE)])
    rounds.me.record = lambda: PeerRecord(HONEST, 1, PeerState.ONLINE)
    assert rounds.candidates() == []


def test_a_spot_check_ban_through_the_conduct_lasts_as_long_as_it_asks_in_the_shared_store():
    clock = FakeClock(5000.0)
    bans, _, conduct = wired(clock)
    until = conduct.ban(BANNED, "spot-checks: wrong output", at_least=600)
    assert until == clock.now + 600 and bans.active()[BANNED] == (until, "spot-checks: wrong output")
    clock.now += 599
    assert conduct.admit(BANNED) == "banned for bad input"

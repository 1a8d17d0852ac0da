"""Which stage a new peer serves: the one that needs help most.

The rule (SWARM's and Petals' block selection): pick the stage with the lowest total throughput,
ties broken by fewest peers, then at random. Peers that start at the same moment all see the same
empty swarm, so the choice is made twice: announce a tentative `joining` record after a random
delay, wait for others' announcements to land, re-read, and let only as many of the newest joiners
of a crowded stage move as it takes to even it out.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Sequence

from dht.records import PeerRecord


@dataclass(frozen=True)
class StageLoad:
    stage: int
    throughput: float
    peers: int


def stage_loads(peers_by_stage: Mapping[int, Sequence[PeerRecord]], num_stages: int) -> list[StageLoad]:
    """Summed throughput and peer count per stage, counting peers that serve or are about to."""
    loads = []
    for stage in range(num_stages):
        active = [peer for peer in peers_by_stage.get(stage, ()) if peer.state != "leaving"]
        loads.append(StageLoad(stage, sum(peer.throughput for peer in active), len(active)))
    return loads


def choose_stage(loads: Sequence[StageLoad], rng: random.Random) -> int:
    """Lowest total throughput, then fewest peers, then a random pick among the equals."""
    best = min((load.throughput, load.peers) for load in loads)
    candidates = [load.stage for load in loads if (load.throughput, load.peers) == best]
    return rng.choice(candidates)


def should_move(
    peers_by_stage: Mapping[int, Sequence[PeerRecord]], num_stages: int, me: PeerRecord, rng: random.Random
) -> int | None:
    """The stage `me` should move to, or None to stay.

    Moving helps only if my stage, without me, still has more than the weakest stage would have
    with me. Several joiners of a crowded stage see the same picture, so only the newest few of
    them move: as many as it takes to halve the gap, by a rank every one of them computes alike.
    """
    loads = stage_loads(peers_by_stage, num_stages)
    mine = loads[me.stage]
    target = choose_stage([load for load in loads if load.stage != me.stage], rng) if num_stages > 1 else None
    if target is None:
        return None
    weakest = loads[target]
    if mine.throughput - me.throughput <= weakest.throughput:
        return None
    movable = sorted(
        (peer for peer in peers_by_stage.get(me.stage, ()) if peer.state == "joining"),
        key=lambda peer: (-peer.updated, peer.peer_id),
    )
    gap_in_peers = max(1, round((mine.throughput - weakest.throughput) / (2 * max(me.throughput, 1e-9))))
    movers = {peer.peer_id for peer in movable[:gap_in_peers]}
    return target if me.peer_id in movers else None


async def claim_stage(
    *,
    num_stages: int,
    me: PeerRecord,
    read_peers: Callable[[], Awaitable[Mapping[int, Sequence[PeerRecord]]]],
    announce: Callable[[PeerRecord], Awaitable[None]],
    withdraw: Callable[[PeerRecord], Awaitable[None]],
    rng: random.Random,
    jitter: float = 2.0,
    settle: float = 1.5,
    max_rounds: int = 4,
) -> int:
    """Pick a stage for `me` (state `joining`), announcing it tentatively, and return it.

    `announce` publishes `me` under `me.stage`; `withdraw` overwrites a stale tentative record
    (state `leaving`) when `me` moves away from a stage.
    """
    await asyncio.sleep(rng.uniform(0.0, jitter))
    me.stage = choose_stage(stage_loads(await read_peers(), num_stages), rng)
    await announce(me)
    for _ in range(max_rounds):
        await asyncio.sleep(settle * rng.uniform(1.0, 2.0))
        peers = dict(await read_peers())
        # our own announcement may not have propagated to every replica yet: count it regardless
        peers[me.stage] = [p for p in peers.get(me.stage, ()) if p.peer_id != me.peer_id] + [me]
        target = should_move(peers, num_stages, me, rng)
        if target is None:
            return me.stage
        await withdraw(me)
        me.stage = target
        await announce(me)
    return me.stage

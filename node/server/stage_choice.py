"""Which stage a new peer serves: the one that needs help most.

The rule (SWARM's and Petals' block selection): pick the stage with the lowest total throughput,
ties broken by fewest peers, then at random. Peers that start at the same moment all see the same
empty swarm, so the choice is made twice (node/server/stage_claim.py): announce a tentative
`joining` record after a random delay, wait for others' announcements to land, re-read, and let
only as many of the newest joiners of a crowded stage move as it takes to even it out
(`should_move`). A joiner whose device cannot hold some stages passes the stages it can (`allowed`,
node/server/stage_fit.py): it takes the neediest of those. Pure: no networking, no clock, no device.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from dht.records import PeerRecord, PeerState


@dataclass(frozen=True)
class StageLoad:
    stage: int
    throughput: float
    peers: int


def stage_loads(peers_by_stage: Mapping[int, Sequence[PeerRecord]], num_stages: int) -> list[StageLoad]:
    """Summed throughput and peer count per stage, counting peers that serve or are about to."""
    loads = []
    for stage in range(num_stages):
        active = [peer for peer in peers_by_stage.get(stage, ()) if peer.state != PeerState.LEAVING]
        loads.append(StageLoad(stage, sum(peer.throughput for peer in active), len(active)))
    return loads


def choose_stage(loads: Sequence[StageLoad], rng: random.Random, allowed: Collection[int] | None = None) -> int:
    """Lowest total throughput, then fewest peers, then a random pick among the equals; only among
    the `allowed` stages (None: any; ValueError when it leaves none)."""
    candidates = [load for load in loads if allowed is None or load.stage in allowed]
    if not candidates:
        raise ValueError("no stage to choose from")
    best = min((load.throughput, load.peers) for load in candidates)
    return rng.choice([load.stage for load in candidates if (load.throughput, load.peers) == best])


def needier_than(loads: Sequence[StageLoad], stage: int) -> list[int]:
    """The stages that need help more than `stage` does (lower throughput, then fewer peers)."""
    mine = (loads[stage].throughput, loads[stage].peers)
    return [load.stage for load in loads if (load.throughput, load.peers) < mine]


def should_move(
    peers_by_stage: Mapping[int, Sequence[PeerRecord]],
    num_stages: int,
    me: PeerRecord,
    rng: random.Random,
    allowed: Collection[int] | None = None,
) -> int | None:
    """The stage `me` should move to (one of the `allowed`, None: any), or None to stay.

    Moving helps only if my stage, without me, still has more than the weakest stage would have
    with me. Several joiners of a crowded stage see the same picture, so only the newest few of
    them move: as many as it takes to halve the gap, by a rank every one of them computes alike.
    """
    loads = stage_loads(peers_by_stage, num_stages)
    mine = loads[me.stage]
    others = [load for load in loads if load.stage != me.stage and (allowed is None or load.stage in allowed)]
    if not others:
        return None
    target = choose_stage(others, rng)
    weakest = loads[target]
    if mine.throughput - me.throughput <= weakest.throughput:
        return None
    movable = sorted(
        (peer for peer in peers_by_stage.get(me.stage, ()) if peer.state == PeerState.JOINING),
        key=lambda peer: (-peer.updated, peer.peer_id),
    )
    gap_in_peers = max(1, round((mine.throughput - weakest.throughput) / (2 * max(me.throughput, 1e-9))))
    movers = {peer.peer_id for peer in movable[:gap_in_peers]}
    return target if me.peer_id in movers else None

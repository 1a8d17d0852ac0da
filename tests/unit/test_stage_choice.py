"""node/server/stage_choice.py: which stage a new peer serves, and which of several simultaneous
joiners of a crowded stage move (pure functions on plain records; no swarm)."""

from __future__ import annotations

import random

import pytest

from dht.records import PeerRecord, PeerState
from node.server.stage_choice import StageLoad, choose_stage, needier_than, should_move, stage_loads


def peer(
    pid: str, stage: int, state: PeerState = PeerState.JOINING, throughput: float = 1.0, updated: float = 0.0
) -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, state=state, throughput=throughput, updated=updated)


def joiners(stage: int, count: int, prefix: str = "j") -> list[PeerRecord]:
    """`count` joiners of `stage`; j1 announced first, the highest number last (the newest)."""
    return [peer(f"{prefix}{i}", stage, updated=100.0 + i) for i in range(1, count + 1)]


def movers(swarm: dict[int, list[PeerRecord]], num_stages: int, stage: int, seed: int = 0) -> dict[str, int]:
    """{peer id: target} for every peer of `stage` that decides to move, each with its own rng."""
    decisions = {p.peer_id: should_move(swarm, num_stages, p, random.Random(seed)) for p in swarm[stage]}
    return {pid: target for pid, target in decisions.items() if target is not None}


# ------------------------------------------------------------------------------------------------
# stage_loads


def test_stage_loads_sums_throughput_and_counts_peers_that_serve_or_are_about_to():
    swarm = {
        0: [peer("a", 0, PeerState.ONLINE, 2.0), peer("b", 0, PeerState.JOINING, 0.5)],
        1: [peer("c", 1, PeerState.REBUILDING, 1.5), peer("d", 1, PeerState.LEAVING, 9.0)],
        3: [peer("e", 3, PeerState.ONLINE, 4.0)],  # beyond num_stages: not a stage of this swarm
    }
    assert stage_loads(swarm, 3) == [StageLoad(0, 2.5, 2), StageLoad(1, 1.5, 1), StageLoad(2, 0.0, 0)]


def test_stage_loads_of_an_empty_swarm_is_zero_everywhere():
    assert stage_loads({}, 2) == [StageLoad(0, 0.0, 0), StageLoad(1, 0.0, 0)]


# ------------------------------------------------------------------------------------------------
# choose_stage


def test_choose_stage_takes_the_lowest_total_throughput_then_the_fewest_peers():
    loads = [StageLoad(0, 3.0, 1), StageLoad(1, 1.0, 3), StageLoad(2, 2.0, 1)]
    assert choose_stage(loads, random.Random(0)) == 1
    tied = [StageLoad(0, 1.0, 2), StageLoad(1, 1.0, 1), StageLoad(2, 1.0, 3)]
    assert choose_stage(tied, random.Random(0)) == 1
    # a lost stage has no throughput: it comes first, whatever the others hold
    assert choose_stage([StageLoad(0, 0.1, 1), StageLoad(1, 0.0, 0), StageLoad(2, 5.0, 4)], random.Random(0)) == 1


def test_choose_stage_picks_at_random_among_equal_stages_only():
    loads = [StageLoad(0, 1.0, 1), StageLoad(1, 0.0, 0), StageLoad(2, 0.0, 0), StageLoad(3, 0.0, 0)]
    picks = {choose_stage(loads, random.Random(seed)) for seed in range(64)}
    assert picks == {1, 2, 3}
    # same rng state, same answer
    assert choose_stage(loads, random.Random(7)) == choose_stage(loads, random.Random(7))


# ------------------------------------------------------------------------------------------------
# should_move


def test_only_the_newest_joiners_of_a_crowded_stage_move_as_many_as_the_gap():
    # 6 joiners on stage 1, stage 2 empty: gap = round((6 - 0) / (2 * 1)) = 3
    swarm = {0: [peer("s0", 0, PeerState.ONLINE)], 1: joiners(1, 6), 2: []}
    assert movers(swarm, 3, 1) == {"j6": 2, "j5": 2, "j4": 2}
    # stage 2 already holds one peer: gap = round((6 - 1) / 2) = 2 (round half to even)
    swarm[2] = [peer("x", 2, PeerState.ONLINE)]
    assert movers(swarm, 3, 1) == {"j6": 2, "j5": 2}


def test_at_least_one_joiner_moves_when_moving_helps():
    swarm = {0: joiners(0, 2), 1: []}  # 2 vs 0: gap rounds to 1
    assert movers(swarm, 2, 0) == {"j2": 1}


def test_joiners_announced_at_the_same_moment_are_ranked_by_peer_id():
    swarm = {0: [peer(pid, 0, updated=5.0) for pid in ("c", "a", "d", "b")], 1: []}
    assert movers(swarm, 2, 0) == {"a": 1, "b": 1}  # gap 2: the two lowest ids among equals


def test_the_gap_is_counted_in_peers_of_my_own_throughput():
    # one fast joiner (4.0) beside a slow online peer (1.0); stage 1 holds 0.5
    swarm = {
        0: [peer("slow", 0, PeerState.ONLINE, 1.0), peer("fast", 0, throughput=4.0)],
        1: [peer("x", 1, PeerState.ONLINE, 0.5)],
    }
    assert should_move(swarm, 2, swarm[0][1], random.Random(0)) == 1  # 5.0 - 4.0 = 1.0 > 0.5
    # the same joiner beside a faster stage 1: leaving would make my stage the weaker one
    swarm[1] = [peer("x", 1, PeerState.ONLINE, 1.0)]
    assert should_move(swarm, 2, swarm[0][1], random.Random(0)) is None


@pytest.mark.parametrize("mine, other", [(1, 0), (2, 2), (2, 1), (3, 2)])
def test_no_move_when_it_would_not_help(mine, other):
    """My stage without me would hold no more than the other stage with nothing added."""
    swarm = {0: joiners(0, mine), 1: [peer(f"o{i}", 1, PeerState.ONLINE) for i in range(other)]}
    assert movers(swarm, 2, 0) == {}


def test_online_peers_never_move_only_joiners_do():
    swarm = {
        0: [*(peer(f"o{i}", 0, PeerState.ONLINE, updated=200.0 + i) for i in range(3)), peer("me", 0, updated=1.0)],
        1: [],
    }
    # gap = 2, but the only joining peer is me, though the oldest announcement: I move, nobody else
    assert movers(swarm, 2, 0) == {"me": 1}
    for online in swarm[0][:3]:
        assert should_move(swarm, 2, online, random.Random(0)) is None


def test_leaving_peers_count_for_no_stage():
    # stage 0: me plus three peers on their way out; stage 1: one online peer
    leaving = [peer(f"l{i}", 0, PeerState.LEAVING, updated=300.0) for i in range(3)]
    me = peer("me", 0)
    swarm = {0: [me, *leaving], 1: [peer("x", 1, PeerState.ONLINE)]}
    assert should_move(swarm, 2, me, random.Random(0)) is None
    # were they staying, stage 0 would be crowded and I (the only joiner) would move
    staying = {0: [me, *(peer(p.peer_id, 0, PeerState.ONLINE) for p in leaving)], 1: swarm[1]}
    assert should_move(staying, 2, me, random.Random(0)) == 1
    # a stage whose peers are all leaving is as empty as a stage with none
    emptied = {0: joiners(0, 2), 1: [peer("x", 1, PeerState.LEAVING)]}
    assert movers(emptied, 2, 0) == {"j2": 1}


def test_a_single_stage_swarm_never_moves():
    swarm = {0: joiners(0, 5)}
    assert movers(swarm, 1, 0) == {}


def test_the_target_is_the_weakest_other_stage():
    swarm = {
        0: joiners(0, 4),
        1: [peer("a", 1, PeerState.ONLINE, 2.0)],
        2: [peer("b", 2, PeerState.ONLINE, 0.5)],
        3: [peer("c", 3, PeerState.ONLINE, 1.0)],
    }
    assert set(movers(swarm, 4, 0).values()) == {2}
    # equal other stages: each mover draws one with its own rng, always among the weakest
    spread = {0: joiners(0, 8), 1: [], 2: [], 3: [peer("c", 3, PeerState.ONLINE)]}
    targets = {should_move(spread, 4, spread[0][-1], random.Random(seed)) for seed in range(32)}
    assert targets == {1, 2}


def test_every_joiner_computes_the_same_movers_whatever_the_record_order():
    swarm = {0: [peer("s0", 0, PeerState.ONLINE)], 1: joiners(1, 6), 2: []}
    shuffled = {0: swarm[0], 1: random.Random(3).sample(swarm[1], len(swarm[1])), 2: []}
    assert movers(swarm, 3, 1) == movers(shuffled, 3, 1) == {"j6": 2, "j5": 2, "j4": 2}


# ------------------------------------------------------------------------------------------------
# a device that holds only some stages (`allowed`, node/server/stage_fit.py)


def test_choose_stage_takes_the_neediest_of_the_stages_the_device_holds():
    loads = [StageLoad(0, 3.0, 1), StageLoad(1, 0.0, 0), StageLoad(2, 1.0, 1), StageLoad(3, 2.0, 1)]
    assert choose_stage(loads, random.Random(0)) == 1
    assert choose_stage(loads, random.Random(0), allowed={0, 2, 3}) == 2  # the next-neediest that fits
    assert choose_stage(loads, random.Random(0), allowed={0}) == 0
    assert needier_than(loads, 2) == [1]
    with pytest.raises(ValueError):
        choose_stage(loads, random.Random(0), allowed=set())


def test_a_joiner_never_moves_to_a_stage_its_device_cannot_hold():
    swarm = {0: joiners(0, 3), 1: [], 2: [peer("x", 2, PeerState.ONLINE)]}
    newest = swarm[0][-1]
    assert should_move(swarm, 3, newest, random.Random(0)) == 1
    assert should_move(swarm, 3, newest, random.Random(0), allowed={0, 2}) == 2
    assert should_move(swarm, 3, newest, random.Random(0), allowed={0}) is None


class FakeAnnouncer:
    """What claim_stage asks of a PeerAnnouncer: claim a stage, show the record."""

    def __init__(self, peer_id: str):
        self._record = peer(peer_id, 0)
        self.claims: list[int] = []

    async def claim(self, stage: int) -> None:
        self.claims.append(stage)
        self._record = peer(self._record.peer_id, stage, updated=200.0)

    def record(self) -> PeerRecord:
        return self._record

    @property
    def stage(self) -> int:
        return self._record.stage


class FakeRegistry:
    def __init__(self, swarm: dict[int, list[PeerRecord]]):
        self.swarm = swarm

    async def all_peers(self, num_stages: int) -> dict[int, list[PeerRecord]]:
        return {stage: list(self.swarm.get(stage, [])) for stage in range(num_stages)}


def test_auto_claims_the_neediest_stage_the_device_holds_and_says_which_it_skipped(caplog):
    import asyncio
    import logging

    from node.server.stage_claim import claim_stage

    swarm = {0: [peer("a", 0, PeerState.ONLINE, 3.0)], 1: [], 2: [peer("c", 2, PeerState.ONLINE, 1.0)]}

    async def claim(allowed) -> tuple[int, list[int]]:
        me = FakeAnnouncer("me")
        stage = await claim_stage(
            me, FakeRegistry(swarm), 3, "auto", rng=random.Random(0), jitter=0, settle=0, allowed=allowed
        )  # type: ignore[arg-type]
        return stage, me.claims

    assert asyncio.run(claim(None)) == (1, [1])
    with caplog.at_level(logging.INFO, logger="node.server.stage_claim"):
        assert asyncio.run(claim(frozenset({0, 2}))) == (2, [2])
    assert "stage(s) [1] need help more but do not fit this device: taking stage 2" in caplog.text

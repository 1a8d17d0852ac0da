"""node/recovery/rebalance.py: the move a swarm makes when nobody joins a lost stage, on plain records.

tests/swarm/test_swarm_recovery.py already checks the basic rule (wait, unrecoverable, a single
peer is never taken, a joiner keeps the stage, ties in peer count go to throughput) and the basic
two-check confirmation; this file covers the rest: the wait boundary, several lost stages, which
states count, donor ranking, the mover's rank, order independence, and the Rebalancer's timing.
"""

from __future__ import annotations

import random

import pytest

from dht.records import PeerRecord, PeerState
from node.recovery.rebalance import Move, Rebalancer, plan_move


def peer(pid: str, stage: int, state: PeerState = PeerState.ONLINE, throughput: float = 1.0) -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, state=state, inner_step=10, throughput=throughput)


def online(stage: int, *pids: str, throughput: float = 1.0) -> list[PeerRecord]:
    return [peer(pid, stage, throughput=throughput) for pid in pids]


WAIT = 3.0


def plan(swarm, lost_for, num_stages: int = 4, reason: str | None = None) -> Move | None:
    return plan_move(swarm, num_stages, lost_for, rebalance_wait=WAIT, unrecoverable_reason=reason)


# ------------------------------------------------------------------------------------------------
# plan_move: when, and which stage is filled


def test_the_wait_is_inclusive_and_a_stage_not_lost_is_never_a_target():
    swarm = {0: online(0, "a"), 1: [], 2: online(2, "b", "c"), 3: online(3, "d")}
    assert plan(swarm, {1: WAIT - 1e-9}) is None
    assert plan(swarm, {1: WAIT}) == Move(1, 2, "b")
    assert plan(swarm, {1: 0.0}) is None
    assert plan(swarm, {}) is None


def test_with_several_lost_stages_the_lowest_one_past_the_wait_is_filled_first():
    swarm = {0: online(0, "a", "b", "c"), 1: [], 2: online(2, "d"), 3: [], 4: online(4, "e")}
    assert plan(swarm, {1: 9.0, 3: 9.0}, num_stages=5) == Move(1, 0, "a")
    assert plan(swarm, {3: 9.0, 1: 9.0}, num_stages=5) == Move(1, 0, "a")  # not the dict's order
    # stage 1 not past the wait yet: stage 3 goes first
    assert plan(swarm, {1: 1.0, 3: 9.0}, num_stages=5) == Move(3, 0, "a")


@pytest.mark.parametrize("state", [PeerState.JOINING, PeerState.REBUILDING, PeerState.ONLINE])
def test_a_lost_stage_somebody_is_already_taking_is_left_to_them(state):
    swarm = {0: online(0, "a", "b"), 1: [peer("j", 1, state)], 2: online(2, "c"), 3: []}
    assert plan(swarm, {1: 9.0}) is None
    # and the next lost stage waiting is taken instead
    assert plan(swarm, {1: 9.0, 3: 9.0}) == Move(3, 0, "a")


def test_peers_leaving_a_lost_stage_do_not_hold_it():
    swarm = {0: online(0, "a", "b"), 1: [peer("old", 1, PeerState.LEAVING)], 2: online(2, "c")}
    assert plan(swarm, {1: 9.0}, num_stages=3) == Move(1, 0, "a")


def test_nothing_moves_while_the_swarm_is_unrecoverable_whatever_else_holds():
    swarm = {0: online(0, "a", "b", "c"), 1: [], 2: [], 3: online(3, "d")}
    assert plan(swarm, {1: 9.0, 2: 9.0}) == Move(1, 0, "a")
    assert plan(swarm, {1: 9.0, 2: 9.0}, reason="stages 1 and 2 lost together") is None


# ------------------------------------------------------------------------------------------------
# plan_move: the donor stage and the peer that moves


def test_only_online_peers_make_a_donor_and_one_must_stay_behind():
    # stage 2: one online peer and two joining ones; stage 3: one online and one rebuilding
    swarm = {
        0: online(0, "a"),
        1: [],
        2: [peer("b", 2), peer("j1", 2, PeerState.JOINING), peer("j2", 2, PeerState.JOINING)],
        3: [peer("d", 3), peer("r", 3, PeerState.REBUILDING)],
    }
    assert plan(swarm, {1: 9.0}) is None
    swarm[0] = online(0, "a", "a2")
    assert plan(swarm, {1: 9.0}) == Move(1, 0, "a")


def test_the_most_populated_stage_gives_even_against_more_throughput():
    swarm = {
        0: online(0, "a", "b", throughput=10.0),
        1: [],
        2: online(2, "c", "d", "e", throughput=0.1),
        3: online(3, "f"),
    }
    assert plan(swarm, {1: 9.0}) == Move(1, 2, "c")


def test_a_tie_in_peers_and_throughput_goes_to_the_lower_stage():
    swarm = {0: online(0, "z1", "z2"), 1: [], 2: online(2, "a", "b"), 3: online(3, "c", "d")}
    assert plan(swarm, {1: 9.0}) == Move(1, 0, "z1")


def test_the_mover_is_the_online_peer_with_the_lowest_id_of_the_donor():
    swarm = {
        0: [peer("m", 0), peer("k", 0), peer("a", 0, PeerState.JOINING), peer("b", 0, PeerState.LEAVING)],
        1: [],
        2: online(2, "x"),
    }
    assert plan(swarm, {1: 9.0}, num_stages=3) == Move(1, 0, "k")


def test_stages_outside_the_swarm_give_no_donor():
    swarm = {0: online(0, "a"), 1: [], 2: online(2, "b"), 5: online(5, "c", "d", "e")}
    assert plan(swarm, {1: 9.0}, num_stages=3) is None


def test_every_peer_computes_the_same_move_whatever_the_order_of_records():
    swarm = {0: online(0, "a", "q"), 1: [], 2: online(2, "k", "c", "z"), 3: online(3, "d", "e", throughput=3.0)}
    expected = Move(1, 2, "c")  # stage 2 holds the most online peers; "c" is its lowest id
    rng = random.Random(1)
    for _ in range(10):
        shuffled = {s: rng.sample(peers, len(peers)) for s, peers in rng.sample(list(swarm.items()), len(swarm))}
        assert plan(shuffled, {1: 9.0}) == expected


# ------------------------------------------------------------------------------------------------
# Rebalancer: a move is acted upon only once it has held for confirm_after seconds


def test_the_first_sighting_never_confirms_even_without_a_wait():
    rebalancer, move = Rebalancer(confirm_after=0.0), Move(1, 2, "c")
    assert rebalancer.check(move, 10.0) is None
    assert rebalancer.check(move, 10.0) == move


def test_a_confirmed_move_stays_confirmed_while_it_holds_and_equal_moves_count_as_the_same():
    rebalancer = Rebalancer(confirm_after=1.0)
    assert rebalancer.check(Move(1, 2, "c"), 0.0) is None
    assert rebalancer.check(Move(1, 2, "c"), 1.0) == Move(1, 2, "c")  # a fresh but equal plan
    assert rebalancer.check(Move(1, 2, "c"), 5.0) == Move(1, 2, "c")


def test_a_different_move_restarts_the_wait_from_when_it_was_first_seen():
    rebalancer = Rebalancer(confirm_after=1.0)
    first, second = Move(1, 2, "c"), Move(1, 2, "d")  # another mover is another move
    assert rebalancer.check(first, 0.0) is None
    assert rebalancer.check(second, 5.0) is None
    assert rebalancer.check(second, 5.9) is None
    assert rebalancer.check(second, 6.0) == second


def test_flip_flopping_plans_never_confirm_and_no_plan_confirms_nothing():
    rebalancer = Rebalancer(confirm_after=1.0)
    a, b = Move(1, 2, "c"), Move(3, 2, "c")
    for t in range(10):
        assert rebalancer.check(a if t % 2 else b, float(t)) is None
    for t in range(10, 20):
        assert rebalancer.check(None, float(t)) is None

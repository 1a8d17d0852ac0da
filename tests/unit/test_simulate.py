"""`node simulate`'s core: the pure pieces (clock, link, failures, collectives, timeline) and the
simulated swarm driving the project's own workers, routers and outer steps."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from node.config import RoutingMode
from node.simulate.clock import SimClock
from node.simulate.collectives import (
    SyncMethod,
    noloco_round_seconds,
    ring_allreduce_seconds,
    sync_seconds,
    tree_allreduce_seconds,
)
from node.simulate.failures import draw_failures, per_iteration_probability
from node.simulate.links import LinkModel
from node.simulate.settings import SimSettings
from node.simulate.sources import training_source
from node.simulate.swarm import SimulatedSwarm, SyncMode, estimate_iteration_seconds
from node.simulate.timeline import FORWARD_SHARE, Microbatch, StageCosts, run_iteration

pytestmark = pytest.mark.usefixtures("one_thread")


def test_clock_only_moves_forward():
    clock = SimClock()
    assert clock.advance(2.5) == 2.5
    assert clock.advance_to(1.0) == 2.5  # the past changes nothing
    assert clock.advance_to(4.0) == 4.0
    with pytest.raises(ValueError):
        clock.advance(-1.0)


def test_link_costs_latency_plus_bytes_over_bandwidth():
    link = LinkModel.from_flags(latency_ms=50, bandwidth_mbit=100)
    assert link.transfer_seconds(0) == pytest.approx(0.05)
    assert link.transfer_seconds(12.5e6) == pytest.approx(1.05)  # 100 Mbit = 12.5 MB per second


def test_failure_rate_per_hour_is_the_papers_per_iteration_probability():
    # docs/algorithms.md: 10 %/h -> 0.002 per iteration in the authors' 500M setup (72 s iterations)
    assert per_iteration_probability(10.0, 72.0) == pytest.approx(0.002)  # the rate is in percent per hour
    assert per_iteration_probability(1e9, 1.0) == 1.0


def test_failure_schedule_is_seeded_bounded_and_one_stage_per_iteration():
    a = draw_failures(seed=3, iterations=500, probability=0.2, stages=(2, 3), start=50)
    assert a == draw_failures(seed=3, iterations=500, probability=0.2, stages=(2, 3), start=50)
    iterations = [f.iteration for f in a]
    assert len(iterations) == len(set(iterations))  # two adjacent middle stages never fail together
    assert all(50 <= i < 500 and f.stage in (2, 3) for i, f in zip(iterations, a))
    # about 1 - 0.8^2 = 36 % of the 450 iterations see a failure
    assert 0.28 < len(a) / 450 < 0.44
    assert draw_failures(seed=3, iterations=500, probability=0.0, stages=(2, 3)) == []


def test_noloco_round_is_one_exchange_and_beats_a_tree_allreduce_from_64_replicas():
    link = LinkModel()  # the volunteer default: 50 ms, 100 Mbit/s
    for nbytes in (1e3, 1e6, 5.7e8):  # a tiny stage, a small one, the 125m preset in fp32
        round_seconds = noloco_round_seconds(2, nbytes, link)
        for n in (64, 128, 1024):
            assert noloco_round_seconds(n, nbytes, link) == round_seconds  # independent of N
            assert round_seconds < tree_allreduce_seconds(n, nbytes, link)
    # payload-bound: tree / NoLoCo = 2 log2(N) hops of one payload vs one exchange of phi + Delta
    assert tree_allreduce_seconds(1024, 5.7e8, link) / noloco_round_seconds(1024, 5.7e8, link) == pytest.approx(
        10.0, rel=0.01
    )
    # the ring pays 2 (N - 1) latencies
    assert ring_allreduce_seconds(1024, 0.0, link) == pytest.approx(2 * 1023 * 0.05)
    assert sync_seconds(SyncMethod.RING, 1, 1e6, link) == 0.0 == noloco_round_seconds(1, 1e6, link)


def test_timeline_one_microbatch_is_its_computes_plus_its_hops():
    link = LinkModel.from_flags(latency_ms=10, bandwidth_mbit=8)  # 1 MB/s
    costs = StageCosts(compute_seconds=1.0, edge_seconds=0.5, activation_bytes=1e5)
    mb = Microbatch(source=0, order=[1, 2, 3])
    end = run_iteration([mb], 0.0, costs, link, lambda stage, now, source: 0)
    hops = 2 * (len(mb.order) + 1)  # 0 -> 1 -> 2 -> 3 -> 0 and back
    assert end == pytest.approx(3 * 1.0 + 0.5 + hops * (0.01 + 0.1))
    assert mb.replicas == [0, 0, 0] and mb.finished == end


def test_timeline_serialises_one_peer_and_spreads_over_replicas():
    link = LinkModel(latency_s=0.0)
    costs = StageCosts(compute_seconds=1.0, edge_seconds=0.0, activation_bytes=0.0)
    one = run_iteration([Microbatch(0, [1]), Microbatch(0, [1])], 0.0, costs, link, lambda s, now, source: 0)
    turns = iter([0, 1])
    two = run_iteration([Microbatch(0, [1]), Microbatch(0, [1])], 0.0, costs, link, lambda s, now, source: next(turns))
    assert one == pytest.approx(2.0)  # both microbatches on the same stage-1 peer
    assert two == pytest.approx(1.0)  # one each: in parallel
    redundant = StageCosts(1.0, 0.0, 0.0, extra_forward=FORWARD_SHARE)
    assert run_iteration([Microbatch(0, [1])], 0.0, redundant, link, lambda s, now, source: 0) == pytest.approx(
        1.0 + FORWARD_SHARE
    )


def small(**changes) -> SimSettings:
    values = dict(stages=3, replicas=2, hidden=32, compute_ms=100.0, inner_steps=3, steps=6, eval_batches=2)
    values.update(changes)
    return SimSettings(**values)


def replica_counts(swarm: SimulatedSwarm, stage: int) -> Counter:
    return Counter(swarm.workers[stage][r].microbatches_done for r in range(swarm.replicas))


def test_swarm_trains_with_the_projects_workers_and_charges_the_clock():
    sim = small(steps=8)
    swarm = SimulatedSwarm(sim.config(), sim.replicas, sim.link, sim.compute_seconds, SyncMode.NOLOCO, sim.seed)
    try:
        held_out = swarm.held_out(2)
        before = swarm.eval_loss(held_out)
        seconds = [swarm.train_iteration().seconds for _ in range(sim.steps)]
        assert swarm.eval_loss(held_out) < before  # real steps were taken
        # every stage-0 replica stepped once per iteration (microbatches_per_step = 1)
        assert [w.inner_step for w in swarm.workers[0]] == [sim.steps] * sim.replicas
        expected = estimate_iteration_seconds(sim.stages, sim.replicas, 1, swarm.costs, sim.link)
        assert seconds[0] == pytest.approx(expected)
        assert swarm.clock.now() == pytest.approx(sum(seconds))
    finally:
        swarm.close()


@pytest.mark.parametrize("routing", list(RoutingMode))
def test_swarm_routes_with_the_projects_router(routing):
    sim = small(routing=routing, replicas=3, steps=12)
    swarm = SimulatedSwarm(sim.config(), sim.replicas, sim.link, sim.compute_seconds, SyncMode.NONE, sim.seed)
    try:
        per_iteration = set()  # how many microbatches each replica of stages 1, 2 got in one iteration
        done = [[0] * 3, [0] * 3]
        for _ in range(sim.steps):
            swarm.train_iteration()
            now = [[w.microbatches_done for w in swarm.workers[stage]] for stage in (1, 2)]
            per_iteration |= {tuple(b - a for a, b in zip(before, after)) for before, after in zip(done, now)}
            done = now
        assert [sum(row) for row in done] == [sim.steps * sim.replicas] * 2
        if routing == RoutingMode.LOAD_AWARE:
            assert per_iteration == {(1, 1, 1)}  # equal speeds: round-robin in effect
        elif routing == RoutingMode.SHUFFLED:
            assert per_iteration == {(1, 1, 1)}  # one deck for every sender: the authors' permutation per step
        else:  # uniform draws: some iteration sends two microbatches to one replica
            assert per_iteration - {(1, 1, 1)}
            assert min(min(row) for row in done) > 0
    finally:
        swarm.close()


def test_fixed_pipelines_keep_each_replicas_data_in_its_own_pipeline():
    """Without routing, replica 0's pipeline never sees replica 1's microbatches: changing replica 1's
    data leaves every stage of replica 0 as it was; with routing it does not."""

    def weights_after(fixed: bool, other_stream: bool) -> list[torch.Tensor]:
        sim = small(routing=RoutingMode.RANDOM, steps=4)
        swarm = SimulatedSwarm(
            sim.config(), sim.replicas, sim.link, sim.compute_seconds, SyncMode.NONE, sim.seed, fixed_pipelines=fixed
        )
        try:
            if other_stream:
                swarm.sources[1] = training_source(swarm.config, 7)
            for _ in range(sim.steps):
                swarm.train_iteration()
            return [p.detach().clone() for s in range(sim.stages) for p in swarm.workers[s][0].module.parameters()]
        finally:
            swarm.close()

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b))

    assert same(weights_after(True, False), weights_after(True, True))
    assert not same(weights_after(False, False), weights_after(False, True))


def test_diloco_makes_replicas_identical_and_no_sync_lets_them_drift():
    results = {}
    for mode in (SyncMode.DILOCO, SyncMode.NONE, SyncMode.NOLOCO):
        sim = small(steps=3, inner_steps=3)  # one round, right at the end
        swarm = SimulatedSwarm(sim.config(), sim.replicas, sim.link, sim.compute_seconds, mode, sim.seed)
        try:
            assert swarm.divergence() == 0.0  # replicas start identical
            charged = 0.0
            for _ in range(sim.steps):
                swarm.train_iteration()
                charged += swarm.synchronise()
            results[mode] = (swarm.divergence(), charged)
        finally:
            swarm.close()
    assert results[SyncMode.DILOCO][0] < 1e-6
    assert results[SyncMode.NONE][0] > 1e-3 and results[SyncMode.NONE][1] == 0.0
    # NoLoCo's pull brings a pair closer without making it equal
    assert results[SyncMode.DILOCO][0] < results[SyncMode.NOLOCO][0] < results[SyncMode.NONE][0]
    assert results[SyncMode.NOLOCO][1] > 0.0


def test_allreduce_every_step_keeps_replicas_equal():
    sim = small(steps=4)
    swarm = SimulatedSwarm(sim.config(), sim.replicas, sim.link, sim.compute_seconds, SyncMode.ALLREDUCE, sim.seed)
    try:
        for _ in range(sim.steps):
            swarm.train_iteration()
            swarm.synchronise()
            assert swarm.divergence() < 1e-6
        assert math.isfinite(swarm.clock.now())
    finally:
        swarm.close()


def test_rebuild_drives_the_projects_plans_on_every_replica():
    from node.config import RecoveryStrategy
    from node.simulate.recovery import rebuild

    sim = small(stages=4, steps=3)
    swarm = SimulatedSwarm(sim.config(), sim.replicas, sim.link, sim.compute_seconds, SyncMode.NOLOCO, sim.seed)
    try:
        for _ in range(sim.steps):
            swarm.train_iteration()
        before = swarm.clock.now()
        charged = rebuild(swarm, 2, RecoveryStrategy.CHECKFREE, init_seed=1)
        assert charged > swarm.config.recovery.lost_grace and swarm.clock.now() == pytest.approx(before + charged)
        rebuilt = [w.state_dict() for w in swarm.workers[2]]
        assert all(torch.equal(rebuilt[0][k], rebuilt[1][k]) for k in rebuilt[0])  # one rebuild serves all
        assert all(w.last_grad_norm is None and w.lr_scale == pytest.approx(1.1) for w in swarm.workers[2])
        # zero: the authors' "random" baseline, an identity stage that never trains again
        rebuild(swarm, 2, RecoveryStrategy.ZERO, init_seed=2)
        for _ in range(2):
            swarm.train_iteration()
        for worker in swarm.workers[2]:
            assert all(not p.any() for p in worker.module.parameters() if p.dim() > 1)
            assert worker.lr_scale == 1.0
    finally:
        swarm.close()

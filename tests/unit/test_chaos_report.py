"""tests/helpers/chaos.py's report: stage-0 steps per window are counted per peer."""

from __future__ import annotations

from tests.helpers.chaos import ChaosRun, Sample


def run_with(samples: list[tuple[float, dict[str, int]]]) -> ChaosRun:
    chaos = ChaosRun(swarm=None)  # the report reads only the samples
    chaos.samples = [Sample(at=at, stage0_steps=steps, loss=None, empty_stages=set()) for at, steps in samples]
    return chaos


def test_a_stage0_peer_moving_away_does_not_hide_the_steps_of_the_others():
    # "b" leaves stage 0 at t = 40 (the rebalancer moved it); "a" keeps stepping
    chaos = run_with(
        [
            (0, {"a": 0, "b": 0}),
            (20, {"a": 50, "b": 50}),
            (40, {"a": 56}),
            (50, {"a": 64}),
            (70, {"a": 90}),
            (85, {"a": 95}),
        ]
    )
    assert chaos.steps_per_window(30.0) == [100, 14]  # [60, 85) is not a whole window


def test_a_peer_missing_from_one_snapshot_counts_from_where_it_was_last_seen():
    chaos = run_with(
        [
            (0, {"a": 0, "b": 0}),
            (10, {"a": 5}),
            (20, {"a": 10, "b": 12}),
            (40, {"a": 10, "b": 12}),
            (60, {"a": 11, "b": 12}),
        ]
    )
    assert chaos.steps_per_window(30.0) == [22, 0]


def test_a_newcomer_counts_from_its_first_sample_not_from_zero():
    # a joiner of stage 0 downloads the stage and starts at its donor's inner step
    chaos = run_with([(0, {"a": 100}), (10, {"a": 104, "c": 104}), (20, {"a": 108, "c": 109}), (40, {"a": 110})])
    assert chaos.steps_per_window(30.0) == [13]  # the partial window [30, 40) is not reported

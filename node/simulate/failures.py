"""Failures as the CheckFree paper simulates them: per iteration, a stage (all its replicas at once)
fails with a fixed probability derived from a per-hour rate (docs/algorithms.md, "What the authors
report": 10 %/h -> 0.002 per iteration in their 500M setup, i.e. p = rate x iteration time / 1 h).

One seeded schedule is drawn per run and replayed under every strategy, so strategies differ only
in what they do about the same failures.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SECONDS_PER_HOUR = 3600.0


def per_iteration_probability(percent_per_hour: float, iteration_seconds: float) -> float:
    """The paper's linear conversion of a rate in percent per hour, p = rate / 100 x t_iteration / 3600
    (capped at 1): 10 %/h at 72 s per iteration is 0.002."""
    if percent_per_hour < 0 or iteration_seconds <= 0:
        raise ValueError(f"need rate >= 0 and iteration time > 0, got {percent_per_hour}, {iteration_seconds}")
    return min(1.0, percent_per_hour / 100.0 * iteration_seconds / SECONDS_PER_HOUR)


@dataclass(frozen=True)
class Failure:
    iteration: int  # the failure happens before this iteration runs
    stage: int


def draw_failures(
    seed: int, iterations: int, probability: float, stages: tuple[int, ...], start: int = 0
) -> list[Failure]:
    """For each iteration from `start`, each stage in `stages` fails with `probability`; at most one
    stage per iteration (two adjacent stages lost together cannot be rebuilt from neighbours,
    docs/algorithms.md "unrecoverable"), the first one drawn in stage order."""
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"probability must be in [0, 1], got {probability}")
    rng = np.random.default_rng(30_000 + seed)
    draws = rng.random((iterations, len(stages))) < probability  # drawn for every iteration: stable in `start`
    failures = []
    for iteration in range(start, iterations):
        hit = np.flatnonzero(draws[iteration])
        if hit.size:
            failures.append(Failure(iteration, stages[int(hit[0])]))
    return failures

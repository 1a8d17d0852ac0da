"""The weight fingerprint: replicas' fingerprints are as far apart as their weights (relative L2)."""

from __future__ import annotations

import math

import pytest
import torch

from node.averaging.fingerprint import WeightFingerprint, fingerprint_distance
from node.config import SwarmConfig
from node.stage.stage_worker import StageWorker


@pytest.mark.parametrize("distance", [0.01, 0.1, 0.5])
def test_the_fingerprint_distance_estimates_the_relative_weight_distance(distance: float) -> None:
    worker = StageWorker(SwarmConfig(), 1)
    try:
        params = [p.detach().clone() for p in worker.module.parameters()]
    finally:
        worker.close()
    fingerprint = WeightFingerprint([p.shape for p in params], seed=3)
    generator = torch.Generator().manual_seed(5)
    noise = [torch.randn(p.shape, generator=generator) for p in params]
    scale = distance * math.sqrt(sum(float((p * p).sum()) for p in params) / sum(float((n * n).sum()) for n in noise))
    moved = [p + n * scale for p, n in zip(params, noise)]
    estimate = fingerprint_distance(fingerprint(params), fingerprint(moved))
    assert fingerprint_distance(fingerprint(params), fingerprint(params)) == 0.0
    # 8 projected coordinates of a 16k-coordinate sample: an estimate (seeds 0-4 of the projection
    # read 0.71-2.36x the true distance, the same factor at every distance)
    assert estimate is not None and distance / 3 < estimate < distance * 3, estimate


def test_fingerprints_that_cannot_be_compared_give_no_distance() -> None:
    assert fingerprint_distance([1.0, 2.0], [1.0]) is None
    assert fingerprint_distance([], []) is None
    assert fingerprint_distance([0.0, 0.0], [1.0, 1.0]) is None
    assert fingerprint_distance([float("nan"), 1.0], [1.0, 1.0]) is None
    assert fingerprint_distance([3.0, 4.0], [3.0, 4.0 + 5.0]) == pytest.approx(1.0)

"""A few floats that tell how far apart two replicas of a stage are, without any gossip.

Each peer publishes its fingerprint in its DHT record every heartbeat (docs/gossip.md, "What peers
publish"); comparing them measures replica agreement in every gossip mode, `none` included.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["FINGERPRINT_COORDS", "FINGERPRINT_SIZE", "WeightFingerprint", "fingerprint_distance"]

FINGERPRINT_SIZE = 8
FINGERPRINT_COORDS = 1 << 14  # coordinates sampled by the fingerprint projection


class WeightFingerprint:
    """FINGERPRINT_SIZE floats: a fixed seeded random projection of a fixed seeded sample of the
    flattened parameters. Replicas of a stage use the same seed, so ||f_a - f_b|| / ||f_a|| tracks
    their relative distance. The sample (FINGERPRINT_COORDS coordinates, drawn with replacement)
    keeps the cost independent of the model size. Calling it reads the module: do it on the
    worker's compute thread (StageWorker.compute).

    The projection is drawn on the CPU (a CPU generator gives every replica, GPU or not, the same
    numbers) and copied once to the parameters' device on first use: the sample and the product
    are computed there, and one host read returns the floats."""

    def __init__(self, shapes: Sequence[torch.Size], seed: int):
        sizes = [math.prod(shape) for shape in shapes]
        total = sum(sizes)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        count = min(total, FINGERPRINT_COORDS)
        coords = torch.randint(0, total, (count,), generator=gen, device="cpu").sort().values
        self.projection = torch.randn(FINGERPRINT_SIZE, count, generator=gen, device="cpu") / math.sqrt(count)
        starts = torch.tensor([0, *itertools.accumulate(sizes)], device="cpu")
        owner = torch.bucketize(coords, starts[1:], right=True)  # which tensor each coordinate is in
        self.local = [coords[owner == k] - starts[k] for k in range(len(sizes))]
        self._placed: dict[torch.device, tuple[Tensor, list[Tensor]]] = {}

    def _on(self, device: torch.device) -> tuple[Tensor, list[Tensor]]:
        """The projection and the sample's indices on `device` (copied once per device)."""
        if device not in self._placed:
            self._placed[device] = (self.projection.to(device), [idx.to(device) for idx in self.local])
        return self._placed[device]

    def __call__(self, params: Sequence[Tensor]) -> list[float]:
        projection, local = self._on(params[0].device)
        with torch.no_grad():
            sample = torch.cat([p.detach().reshape(-1)[idx].to(torch.float32) for p, idx in zip(params, local)])
            return (projection @ sample).tolist()


def fingerprint_distance(a: Sequence[float], b: Sequence[float]) -> float | None:
    """||a - b|| / ||a||: the relative distance of two replicas' weights their fingerprints
    estimate (None: not two fingerprints of one size, or `a` is zero)."""
    if len(a) != len(b) or not a:
        return None
    norm = math.sqrt(sum(x * x for x in a))
    if not math.isfinite(norm) or norm == 0.0:
        return None
    distance = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b))) / norm
    return distance if math.isfinite(distance) else None

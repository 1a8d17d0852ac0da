"""Is a partner's (phi, Delta) what an honest replica of this stage could have sent? (pure)

`validate_partner_update` (noloco.py) checks form only: tensor count, shapes, finiteness, global
norms at most max_norm_factor x ours. A stranger who downloaded our state passes all of that with
our own phi negated (phi' = -phi, same norm): the pull term -gamma (phi - mean phi) then shrinks our
weights to 1 - gamma = 0.3 x, and a negated Delta undoes our own progress. Honest replicas share
their history (same start, every round pulls them together), so after the form checks a partner
is rejected (`implausible`) when

- the cosine of the two phi is below `min_cosine` (negated: -1, random: ~0), or their norm
  ratio is outside [1 / max_norm_ratio, max_norm_ratio] (a re-scaled copy);
- its phi is farther from ours, relative to our norm, than `distance_limit(reference)`:
  `divergence_factor` x the largest replica divergence this stage showed recently (our own
  accepted rounds and what the stage's peers publish, `DivergenceMemory`), clipped to
  [`distance_floor`, `distance_ceiling`]; the ceiling holds whatever the published figures say,
  and without enough history of our own the limit is the ceiling;
- one tensor alone is flipped (cosine below `min_tensor_cosine`) or re-scaled (norm factor above
  `max_tensor_norm_factor`): the global figures hide one matrix, the RMSNorm weights dominate
  them. Each tensor's norm is compared with a floor added (`tensor_norm_floor` x its share of our
  global norm), and a tensor under that floor on both sides has no cosine (it is mostly noise);
- the cosine of its Delta with ours is below `min_delta_cosine` (a negated Delta: -1).

The thresholds come from honest swarms measured in docs/gossip.md ("Plausibility"). Nothing
here keeps torch state or modifies a tensor.

A failed check has two readings. Usually the partner is the odd one out, and it is banned. But
honest replicas that did not meet for many steps (two that started from the seed together while
routing sent one of them most of the work) fail the same checks; then `lagging_behind` tells the
replica that is behind, which takes the stage's state again instead of banning (docs/gossip.md,
"Catching up").
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DivergenceMemory", "PartnerMeasures", "PlausibilityBounds", "implausible", "lagging_behind", "measure"]

_EPS = 1e-12


@dataclass(frozen=True)
class PartnerMeasures:
    """How a partner's (phi, Delta) compares with ours."""

    distance: float  # ||phi_p - phi|| / ||phi||: what peers publish as `divergence`
    cosine: float  # cos(phi, phi_p) over all tensors
    norm_ratio: float  # ||phi_p|| / ||phi||
    tensor_cosine: float  # the smallest per-tensor cosine (tensors of negligible norm left out)
    tensor_norm_ratio: float  # the per-tensor norm ratio farthest from 1, as a factor >= 1
    worst_tensor: int  # the tensor of tensor_norm_ratio (module.parameters() order)
    delta_ratio: float  # ||Delta_p|| / ||Delta||
    delta_cosine: float  # cos(Delta, Delta_p)

    def describe(self) -> str:
        return (
            f"distance {self.distance:.3g}, cosine {self.cosine:.4f}, norm ratio {self.norm_ratio:.4g}, "
            f"tensor cosine {self.tensor_cosine:.4f}, tensor norm factor {self.tensor_norm_ratio:.4g} "
            f"(tensor {self.worst_tensor}), Delta ratio {self.delta_ratio:.3g}, Delta cosine {self.delta_cosine:.3g}"
        )


def _sums(first: Sequence[Tensor], second: Sequence[Tensor]) -> list[tuple[float, float, float]]:
    """(a.a, b.b, a.b) in float64 for every pair of tensors, computed where they are (the stage's
    device) and read to the host at once: one sync for all of them."""
    rows = []
    for a, b in zip(first, second):
        a = a.detach().reshape(-1).to(torch.float64)
        b = b.detach().reshape(-1).to(torch.float64)
        rows.append(torch.stack([a @ a, b @ b, a @ b]))
    return [tuple(row) for row in torch.stack(rows).tolist()] if rows else []


def _cosine(aa: float, bb: float, ab: float) -> float:
    """cos of two vectors from their dot products; two zero vectors agree (1), one zero does not (0)."""
    if aa <= _EPS and bb <= _EPS:
        return 1.0
    if aa <= _EPS or bb <= _EPS:
        return 0.0
    return max(-1.0, min(1.0, ab / math.sqrt(aa * bb)))


def measure(
    own_phi: Sequence[Tensor],
    own_delta: Sequence[Tensor],
    partner_phi: Sequence[Tensor],
    partner_delta: Sequence[Tensor],
    tensor_norm_floor: float = 0.1,
    min_tensor_share: float = 1 / 64,
) -> PartnerMeasures:
    """The partner's phi and Delta against ours (same count and shapes: validate them first).

    Per tensor, a tensor's "floor" is tensor_norm_floor x its share of our global norm
    (||phi|| sqrt(numel_k / numel)): norms are compared as (norm + floor) and a tensor whose own
    and partner norms are both under its floor has no cosine (it hardly matters and is mostly noise).
    """
    per_tensor = _sums(own_phi, partner_phi)
    numels = [o.numel() for o in own_phi]
    total = max(1, sum(numels))
    own_sq = sum(s[0] for s in per_tensor)
    partner_sq = sum(s[1] for s in per_tensor)
    dot = sum(s[2] for s in per_tensor)
    own_norm = math.sqrt(own_sq)
    worst, tensor_norm_ratio, tensor_cosine = 0, 1.0, 1.0
    for k, ((aa, bb, ab), n) in enumerate(zip(per_tensor, numels)):
        if n < min_tensor_share * total:
            continue
        floor = tensor_norm_floor * own_norm * math.sqrt(n / total)
        ratio = (math.sqrt(bb) + floor) / max(math.sqrt(aa) + floor, _EPS)
        factor = max(ratio, 1.0 / max(ratio, _EPS))
        if factor > tensor_norm_ratio:
            worst, tensor_norm_ratio = k, factor
        if max(aa, bb) > floor * floor:
            tensor_cosine = min(tensor_cosine, _cosine(aa, bb, ab))
    delta_sums = _sums(own_delta, partner_delta)
    dd, pp, dp = (sum(s[i] for s in delta_sums) for i in range(3))
    return PartnerMeasures(
        distance=math.sqrt(max(0.0, own_sq + partner_sq - 2 * dot)) / max(own_norm, _EPS),
        cosine=_cosine(own_sq, partner_sq, dot),
        norm_ratio=math.sqrt(partner_sq) / max(own_norm, _EPS),
        tensor_cosine=tensor_cosine,
        tensor_norm_ratio=tensor_norm_ratio,
        worst_tensor=worst,
        delta_ratio=math.sqrt(pp) / max(math.sqrt(dd), _EPS),
        delta_cosine=_cosine(dd, pp, dp),
    )


@dataclass(frozen=True)
class PlausibilityBounds:
    """What an honest partner stays within (docs/gossip.md, "Plausibility", has the measurements)."""

    min_cosine: float = 0.2  # honest >= 0.37 in the hottest measured stage; negated -1, random ~0
    max_norm_ratio: float = 2.5  # honest within [0.63, 1.58]
    distance_floor: float = 0.3  # the limit never goes below this (honest calm stages: <= 0.06)
    divergence_factor: float = 4.0  # limit = this x the largest recent divergence ...
    distance_ceiling: float = 1.5  # ... and never above this (honest worst 1.28: a stale replica)
    min_observations: int = 4  # own accepted rounds in the window before the limit adapts
    min_tensor_cosine: float = -0.3  # honest >= 0.02 (RMSNorm weights of a stale replica)
    max_tensor_norm_factor: float = 6.0  # honest <= 3.2
    tensor_norm_floor: float = 0.1
    min_tensor_share: float = 1 / 64  # smaller tensors are judged in the global figures only
    # a negated copy of ours is -1; honest >= -0.2 at tiny sizes, but -0.75 between two honest
    # 125m replicas on a GPU, one of them just joined (docs/gossip.md, "Plausibility")
    min_delta_cosine: float = -0.9
    # phi's residues decode within the codec's reach of our phi (gossip_codec.py): of a replica out
    # of reach, or of garbage, half the values land in the reach's outer half; honest: see docs/gossip.md
    max_phi_edge_share: float = 0.4

    def distance_limit(self, reference: float | None) -> float:
        """The largest acceptable relative distance given the recent honest divergence (None:
        not enough history, the ceiling)."""
        if reference is None:
            return self.distance_ceiling
        return min(self.distance_ceiling, max(self.distance_floor, self.divergence_factor * reference))


def implausible(m: PartnerMeasures, bounds: PlausibilityBounds, distance_limit: float) -> str | None:
    """Why a partner's (phi, Delta), measured as `m`, is not an honest replica's; None if it is."""
    if not m.cosine >= bounds.min_cosine:
        return f"phi: cosine with ours {m.cosine:.3g} < {bounds.min_cosine:g} (not a replica of our weights)"
    if not 1.0 / bounds.max_norm_ratio <= m.norm_ratio <= bounds.max_norm_ratio:
        return f"phi: norm {m.norm_ratio:.3g} x ours, outside [1/{bounds.max_norm_ratio:g}, {bounds.max_norm_ratio:g}]"
    if not m.distance <= distance_limit:
        return f"phi: relative distance {m.distance:.3g} from ours > limit {distance_limit:.3g}"
    if not m.tensor_cosine >= bounds.min_tensor_cosine:
        return f"phi: a tensor has cosine {m.tensor_cosine:.3g} with ours < {bounds.min_tensor_cosine:g}"
    if not m.tensor_norm_ratio <= bounds.max_tensor_norm_factor:
        return (
            f"phi: tensor {m.worst_tensor} norm differs from ours by a factor {m.tensor_norm_ratio:.3g} "
            f"> {bounds.max_tensor_norm_factor:g}"
        )
    if not m.delta_cosine >= bounds.min_delta_cosine:
        return (
            f"delta: cosine with ours {m.delta_cosine:.3g} < {bounds.min_delta_cosine:g} (points against our progress)"
        )
    return None


def lagging_behind(own_step: int, partner: str, stage_steps: Mapping[str, int], lead: int) -> bool:
    """Is this replica, not `partner`, the odd one out of a round whose plausibility check failed?

    `stage_steps`: the inner step each other online replica of the stage publishes (the partner's
    included). True when the partner and a strict majority of those replicas are at least `lead`
    inner steps ahead of `own_step`. A lone stranger that publishes a large step count in a stage
    of three or more is outvoted; in a stage of two its word is all there is, as it is for a joiner
    whose only donor it is.
    """
    threshold = own_step + lead
    if stage_steps.get(partner, -1) < threshold:
        return False
    ahead = sum(1 for step in stage_steps.values() if step >= threshold)
    return 2 * ahead > len(stage_steps)


class DivergenceMemory:
    """Replica divergences seen recently: (time, value, source), source "" for our own accepted
    rounds, else the peer whose record published it. Times are passed in (no clock here)."""

    def __init__(self, window: float = 600.0, maxlen: int = 4096):
        self.window = window
        self._seen: deque[tuple[float, float, str]] = deque(maxlen=maxlen)
        self._last: dict[str, tuple[float, float]] = {}  # publishing peer -> (value, time) last noted

    def note_own(self, value: float, now: float) -> None:
        """The distance of an accepted partner in one of our rounds."""
        if math.isfinite(value) and value >= 0:
            self._seen.append((now, value, ""))

    def note_published(self, peer: str, value: float, now: float) -> None:
        """A peer's published divergence. Records repeat it every heartbeat: it is noted again
        only when it changed or its last note is half a window old."""
        if not peer or not math.isfinite(value) or value < 0:
            return
        last = self._last.get(peer)
        if last is None or last[0] != value or last[1] < now - self.window / 2:
            self._last[peer] = (value, now)
            self._seen.append((now, value, peer))

    def _forget(self, now: float) -> None:
        horizon = now - self.window
        while self._seen and self._seen[0][0] < horizon:
            self._seen.popleft()
        for peer in [p for p, (_, t) in self._last.items() if t < horizon]:
            del self._last[peer]

    def own_count(self, now: float) -> int:
        """Our own accepted rounds within the window."""
        self._forget(now)
        return sum(1 for _, _, source in self._seen if not source)

    def reference(self, now: float, exclude: str = "", min_own: int = 0) -> float | None:
        """The largest divergence of the window, ignoring what `exclude` published (a partner does
        not vouch for itself); None while we have fewer than `min_own` accepted rounds in it."""
        if self.own_count(now) < min_own:
            return None
        return max((v for _, v, source in self._seen if not source or source != exclude), default=None)

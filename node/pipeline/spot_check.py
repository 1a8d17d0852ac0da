"""Spot-checks of a stage's computation by its other replicas (pure logic, no networking).

Reads beside docs/verification.md. The peer that routes a hop sometimes asks two replicas of the
next stage for the same thing: the stage's output on the hop's input, and the gradient with respect
to that input of a random probe direction over the output. Honest replicas answer almost alike
(NoLoCo lets them drift a little between gossip rounds); a replica that scales, replaces or zeroes
its outputs, or flips its gradients, answers far away. A third replica arbitrates a disagreement;
the one in the minority gets a strike; strikes decay; enough of them ban the peer.

Everything here is deterministic given its inputs and clock: the networking that gathers the
answers is node/pipeline/verifier.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import Tensor

# strikes_to_ban strikes within about a minute (at the default half-life) ban, though the first
# ones have decayed a little by the time the last one lands
STRIKE_MARGIN = 0.1
# below this norm an answer is "zero"
_TINY = 1e-12


def direction_error(a: Tensor, b: Tensor) -> float:
    """1 - cos(a, b): 0 for parallel answers, 1 for unrelated ones (noise), 2 for opposite ones."""
    if a.shape != b.shape:
        return math.inf
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    na, nb = a.norm().item(), b.norm().item()
    if na < _TINY and nb < _TINY:
        return 0.0
    if na < _TINY or nb < _TINY:
        return 1.0
    return 1.0 - float(a @ b) / (na * nb)


def scale_error(a: Tensor, b: Tensor) -> float:
    """|ln(||a|| / ||b||)|: 0 for equal norms, 0.405 for a 1.5x scale, infinite against zeros."""
    if a.shape != b.shape:
        return math.inf
    na, nb = a.detach().double().norm().item(), b.detach().double().norm().item()
    if na < _TINY and nb < _TINY:
        return 0.0
    if na < _TINY or nb < _TINY:
        return math.inf
    return abs(math.log(na / nb))


@dataclass(frozen=True)
class Answer:
    """One replica's answer to a check: the stage's output and the gradient wrt its input."""

    output: Tensor
    grad_input: Tensor


@dataclass(frozen=True)
class Limits:
    """The tolerances one comparison is held to (see Tolerance)."""

    output_direction: float  # on 1 - cos of the outputs
    output_scale: float  # on |ln| of the outputs' norm ratio
    grad_direction: float  # on 1 - cos of the input gradients
    grad_scale: float  # on |ln| of the input gradients' norm ratio


@dataclass(frozen=True)
class Comparison:
    """How two answers differ, in the four ways honest drift and the faults differ (measured on
    live swarms, docs/verification.md)."""

    output_direction: float
    output_scale: float
    grad_direction: float
    grad_scale: float
    limits: Limits

    @property
    def distance(self) -> float:
        """The larger output measure: what a settled stage's divergence-scaled tolerance bounds."""
        return max(self.output_direction, self.output_scale)

    @property
    def gradient_distance(self) -> float:
        return max(self.grad_direction, self.grad_scale)

    @property
    def agree(self) -> bool:
        limits = self.limits
        return (
            self.output_direction <= limits.output_direction
            and self.output_scale <= limits.output_scale
            and self.grad_direction <= limits.grad_direction
            and self.grad_scale <= limits.grad_scale
        )

    def describe(self) -> str:
        limits = self.limits
        return (
            f"outputs: 1-cos {self.output_direction:.3f} (tolerance {limits.output_direction:.3f}), "
            f"|ln norm ratio| {self.output_scale:.3f} (tolerance {limits.output_scale:.3f}); "
            f"gradients: 1-cos {self.grad_direction:.3f} (tolerance {limits.grad_direction:.3f}), "
            f"|ln norm ratio| {self.grad_scale:.3f} (tolerance {limits.grad_scale:.3f})"
        )


def compare(first: Answer, second: Answer, limits: Limits) -> Comparison:
    return Comparison(
        direction_error(first.output, second.output),
        scale_error(first.output, second.output),
        direction_error(first.grad_input, second.grad_input),
        scale_error(first.grad_input, second.grad_input),
        limits,
    )


@dataclass(frozen=True)
class Tolerance:
    """How far two honest answers may be (the figures: docs/verification.md).

    A settled stage (its replicas past `settle_steps` inner steps): on the outputs' direction and
    scale, `factor` x the stage's replica divergence (the relative weight distance its peers
    publish) within [floor, ceiling]; the ceiling stays below 0.405, the outputs' scale error of a
    computation scaled by 1.5, the mildest fault checked for. The input gradients of honest
    replicas differ far more than their outputs (measured: 1 - cos up to 0.45, norms 1.4x apart),
    so they are held to `gradient`, which still catches a sign flip (1 - cos >= 1.5) and zeros.

    Before a stage settles replicas drift further still (measured in the first ~80 steps:
    outputs 4x apart in norm, gradients 3x), so only gross faults count: `gross_direction` on
    both directions, `gross_scale` on both scales."""

    floor: float
    factor: float
    ceiling: float
    gradient: float
    gross_direction: float
    gross_scale: float

    def limits(self, divergence: float | None, settled: bool = True) -> Limits:
        if not settled:
            return Limits(self.gross_direction, self.gross_scale, self.gross_direction, self.gross_scale)
        if divergence is None or not math.isfinite(divergence):
            outputs = self.floor
        else:
            outputs = min(self.ceiling, max(self.floor, self.factor * divergence))
        return Limits(outputs, outputs, self.gradient, self.gradient)


class Verdict(StrEnum):
    """What a check concluded about the two replicas asked first (`first` was on the hop's path)."""

    AGREED = "agreed"  # the two answers are within tolerance
    FIRST_WRONG = "first_wrong"  # the arbiter sided with the second replica
    SECOND_WRONG = "second_wrong"  # the arbiter sided with the first replica
    INCONCLUSIVE = "inconclusive"  # the arbiter agreed with both or with neither: nobody is struck
    UNARBITRATED = "unarbitrated"  # they disagree and no third replica could answer


def arbitrate(first_vs_arbiter: Comparison, second_vs_arbiter: Comparison) -> Verdict:
    """The replica the arbiter disagrees with, when it agrees with exactly one of them."""
    first_ok, second_ok = first_vs_arbiter.agree, second_vs_arbiter.agree
    if first_ok and not second_ok:
        return Verdict.SECOND_WRONG
    if second_ok and not first_ok:
        return Verdict.FIRST_WRONG
    return Verdict.INCONCLUSIVE


class StrikeBook:
    """Strikes per peer that halve every `half_life` seconds; `strikes_to_ban` of them (after decay)
    ban. A decaying score forgives an honest peer's rare bad luck (a check that straddled its gossip
    round) while a peer that is wrong on every check reaches the threshold in a few checks."""

    def __init__(self, strikes_to_ban: float, half_life: float, clock: Callable[[], float] = time.monotonic):
        if strikes_to_ban <= 0 or half_life <= 0:
            raise ValueError("strikes_to_ban and half_life must be > 0")
        self.strikes_to_ban, self.half_life, self._clock = strikes_to_ban, half_life, clock
        self._scores: dict[str, tuple[float, float]] = {}  # peer -> (score, when it was last updated)

    def _decayed(self, peer_id: str, now: float) -> float:
        score, updated = self._scores.get(peer_id, (0.0, now))
        return score * 0.5 ** ((now - updated) / self.half_life)

    def strike(self, peer_id: str) -> bool:
        """Add one strike; True when the peer's score reached the ban threshold (it is then reset)."""
        now = self._clock()
        score = self._decayed(peer_id, now) + 1.0
        if score >= self.strikes_to_ban - STRIKE_MARGIN:
            self._scores.pop(peer_id, None)
            return True
        self._scores[peer_id] = (score, now)
        return False

    def score(self, peer_id: str) -> float:
        return self._decayed(peer_id, self._clock())

    def scores(self, at_least: float = 0.05) -> dict[str, float]:
        """Every peer whose decayed score is still at least `at_least` (forgotten below it)."""
        now = self._clock()
        current = {peer: self._decayed(peer, now) for peer in self._scores}
        self._scores = {peer: (score, now) for peer, score in current.items() if score >= at_least}
        return {peer: score for peer, score in current.items() if score >= at_least}


class CheckRate:
    """The probability of checking a hop: `rate`, or `raised` for a peer that was in an
    unarbitrated disagreement within the last `raised_for` seconds (one word against another bans
    nobody, but both are watched closely until a third replica can arbitrate)."""

    def __init__(self, rate: float, raised: float, raised_for: float, clock: Callable[[], float] = time.monotonic):
        self.rate, self.raised, self.raised_for, self._clock = rate, max(rate, raised), raised_for, clock
        self._raised_until: dict[str, float] = {}

    def raise_for(self, *peer_ids: str) -> None:
        until = self._clock() + self.raised_for
        for peer_id in peer_ids:
            self._raised_until[peer_id] = until

    def of(self, peer_id: str) -> float:
        until = self._raised_until.get(peer_id)
        if until is None:
            return self.rate
        if until <= self._clock():
            del self._raised_until[peer_id]
            return self.rate
        return self.raised


def probe_direction(shape: torch.Size, generator: torch.Generator) -> Tensor:
    """The direction over the stage's output whose gradient wrt the input a check asks for: random
    (unit norm), so a replica cannot prepare a right answer without computing the backward."""
    probe = torch.randn(shape, generator=generator, device="cpu")  # drawn for the wire
    return probe / probe.norm().clamp_min(_TINY)

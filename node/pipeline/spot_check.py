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

# below this norm two answers are both "zero": their distance is 0, not 0/0
_TINY = 1e-12


def relative_distance(a: Tensor, b: Tensor) -> float:
    """||a - b|| / max(||a||, ||b||): 0 for equal answers, 1 when one is zero, 2 for opposite ones.

    Symmetric, so it does not matter which replica is asked first, and bounded by 2 whatever a
    faulty replica sends (a huge answer cannot make the honest one look far from a third)."""
    if a.shape != b.shape:
        return math.inf
    a, b = a.detach().double(), b.detach().double()
    scale = max(a.norm().item(), b.norm().item())
    if scale < _TINY:
        return 0.0
    return (a - b).norm().item() / scale


@dataclass(frozen=True)
class Answer:
    """One replica's answer to a check: the stage's output and the gradient wrt its input."""

    output: Tensor
    grad_input: Tensor


@dataclass(frozen=True)
class Comparison:
    output_distance: float
    grad_distance: float
    limit: float

    @property
    def distance(self) -> float:
        """The larger of the two distances: what is compared with the limit."""
        return max(self.output_distance, self.grad_distance)

    @property
    def agree(self) -> bool:
        return self.distance <= self.limit

    def describe(self) -> str:
        return f"output {self.output_distance:.3f}, gradient {self.grad_distance:.3f}, tolerance {self.limit:.3f}"


def compare(first: Answer, second: Answer, limit: float) -> Comparison:
    return Comparison(
        relative_distance(first.output, second.output), relative_distance(first.grad_input, second.grad_input), limit
    )


@dataclass(frozen=True)
class Tolerance:
    """How far two honest answers may be: `factor` x the stage's replica divergence (the relative
    weight distance its peers publish), within [floor, ceiling].

    Measured on honest swarms (docs/verification.md): answers differ far less than the weights do,
    because a block's residual path carries its input through unchanged. The ceiling stays below
    the smallest fault the checks are meant to catch (outputs scaled by 1.5: distance 0.33)."""

    floor: float
    factor: float
    ceiling: float

    def limit(self, divergence: float | None) -> float:
        if divergence is None or not math.isfinite(divergence):
            return self.floor
        return min(self.ceiling, max(self.floor, self.factor * divergence))


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
        if score >= self.strikes_to_ban - 1e-9:
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
    probe = torch.randn(shape, generator=generator)
    return probe / probe.norm().clamp_min(_TINY)

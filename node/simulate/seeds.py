"""The papers' claims over several seeds: each seed's summary of `node simulate` in, per claim the
measured figures with their spread and on how many seeds the claim's ordering holds.

Pure: reads the summaries that recovery.py and gossip.py write (their `variants`), nothing else. The
claims are the ones docs/algorithms.md lists under "What the authors report"; a claim is said to hold
when it holds on every seed, and the count is shown beside it either way.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Summary = dict[str, Any]


@dataclass(frozen=True)
class Spread:
    """One figure over seeds: its mean and range."""

    mean: float
    low: float
    high: float
    seeds: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        finite = [v for v in values if v is not None and math.isfinite(v)]
        if not finite:
            return None
        return cls(statistics.fmean(finite), min(finite), max(finite), len(finite))

    def text(self, digits: int = 3) -> str:
        return f"{self.mean:.{digits}f} ({self.low:.{digits}f}-{self.high:.{digits}f})"


@dataclass(frozen=True)
class ClaimCheck:
    """A paper's claim beside what the seeds measured."""

    claim: str  # what the paper says, with its figure
    measured: str  # the figures here, with their spread
    holding: int  # seeds on which the claim's ordering holds
    seeds: int

    @property
    def holds(self) -> bool:
        return self.seeds > 0 and self.holding == self.seeds

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "holds": self.holds}


def verdict(holds: bool) -> str:
    """How the results page words a claim's outcome."""
    return "reproduced" if holds else "**not reproduced here**"


def variant_spread(summaries: Sequence[Summary], variant: str, field: str) -> Spread | None:
    """`field` of `variant` over the seeds that ran it."""
    return Spread.of([s["variants"][variant][field] for s in summaries if variant in s["variants"]])


def _lower(better: str, worse: str, field: str) -> Callable[[Summary], bool | None]:
    def holds(summary: Summary) -> bool | None:
        v = summary["variants"]
        if better not in v or worse not in v:
            return None
        a, b = v[better][field], v[worse][field]
        a = math.inf if a is None else a
        b = math.inf if b is None else b
        return a < b if math.isfinite(a) else False

    return holds


def _check(summaries: Sequence[Summary], claim: str, measured: str, holds: Callable[[Summary], bool | None]):
    verdicts = [h for h in (holds(s) for s in summaries) if h is not None]
    return ClaimCheck(claim, measured, sum(verdicts), len(verdicts))


def _perplexity(summaries: Sequence[Summary], variant: str) -> str:
    spread = variant_spread(summaries, variant, "final_loss")
    if spread is None:
        return f"{variant}: not run"
    return f"{variant} {math.exp(spread.mean):.1f} ppl (loss {spread.text()})"


def _ratio(summaries: Sequence[Summary], fast: str, slow: str) -> str:
    ratios, only_fast = [], 0
    for s in summaries:
        v = s["variants"]
        if fast not in v or slow not in v or not v[fast]["seconds_to_target"]:
            continue
        if v[slow]["seconds_to_target"]:
            ratios.append(v[slow]["seconds_to_target"] / v[fast]["seconds_to_target"])
        else:
            only_fast += 1
    spread = Spread.of(ratios)
    parts = [] if spread is None else [f"{spread.text(2)}x on {spread.seeds} seeds"]
    if only_fast:
        parts.append(f"{slow} never reached the target on {only_fast}")
    return "; ".join(parts) or f"{fast} never reached the target"


# (the better variant, the worse, the figure compared, the paper's claim with its figure)
RECOVERY_ORDERINGS = (
    ("checkfree", "copy", "final_loss", "final perplexity: CheckFree (22.6) below copying a neighbour (29.2)"),
    ("copy", "zero", "final_loss", "final perplexity: copy (29.2) below the authors' 'random', here `zero` (121)"),
    ("checkfree", "zero", "final_loss", "final perplexity: CheckFree (22.6) below `zero` (121)"),
    ("checkfree", "random", "final_loss", "final perplexity: CheckFree below a fresh random stage"),
    (
        "checkfree_plus",
        "checkpoint",
        "seconds_to_target",
        "wall-clock to the target loss: CheckFree+ up to 1.6x faster than checkpointing",
    ),
    (
        "checkfree_plus",
        "redundant",
        "seconds_to_target",
        "wall-clock to the target loss: CheckFree+ ~12 % faster than redundant computation",
    ),
)


def recovery_claims(summaries: Sequence[Summary]) -> list[ClaimCheck]:
    """CheckFree's orderings (docs/algorithms.md "What the authors report"), seed by seed."""

    def measured(better: str, worse: str, field: str) -> str:
        if field == "final_loss":
            return f"{_perplexity(summaries, better)} vs {_perplexity(summaries, worse)}"
        return f"{worse} / {better} = {_ratio(summaries, better, worse)}"

    checks = [
        _check(summaries, claim, measured(better, worse, field), _lower(better, worse, field))
        for better, worse, field, claim in RECOVERY_ORDERINGS
    ]
    checks.append(
        _check(
            summaries,
            "iterations: CheckFree+ needs somewhat more than a failure-free run",
            f"to target: {_iterations(summaries, 'checkfree_plus')} vs {_iterations(summaries, 'no_failures')}",
            lambda s: _more_iterations(s, "checkfree_plus", "no_failures"),
        )
    )
    return checks


def _iterations(summaries: Sequence[Summary], variant: str) -> str:
    spread = variant_spread(summaries, variant, "iterations_to_target")
    return f"{variant} never" if spread is None else f"{variant} {spread.text(0)}"


def _more_iterations(summary: Summary, variant: str, reference: str) -> bool | None:
    v = summary["variants"]
    if variant not in v or reference not in v or v[reference]["iterations_to_target"] is None:
        return None
    mine = v[variant]["iterations_to_target"]
    return mine is not None and mine >= v[reference]["iterations_to_target"]


def gossip_claims(summaries: Sequence[Summary], routing: str) -> list[ClaimCheck]:
    """NoLoCo's claims at one routing: at least DiLoCo's convergence (up to 4 % faster), and how it
    stands against averaging every step (the all-reduce a swarm cannot afford)."""
    noloco, diloco, every = (f"{mode}/{routing}" for mode in ("noloco", "diloco", "allreduce"))
    how = "fixed pipelines" if routing == "fixed" else f"{routing} routing"

    def measured(a: str, b: str) -> str:
        sa, sb = variant_spread(summaries, a, "final_loss"), variant_spread(summaries, b, "final_loss")
        return f"{a} {sa.text() if sa else 'not run'} vs {b} {sb.text() if sb else 'not run'}"

    return [
        _check(
            summaries,
            f"held-out loss at equal tokens, {how}: NoLoCo at or below DiLoCo (up to 4 % faster convergence)",
            measured(noloco, diloco),
            _lower(noloco, diloco, "final_loss"),
        ),
        _check(
            summaries,
            f"reference, not a paper's claim: averaging every step ({how}) below NoLoCo, a bound no swarm can pay for",
            measured(every, noloco),
            _lower(every, noloco, "final_loss"),
        ),
    ]

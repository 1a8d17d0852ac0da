"""How often a replica answers gossip rounds that do not finish (docs/security.md, "Expensive answers").

Answering a NoLoCo round sends the stage's outer state (phi and Delta, compressed to under 2 bytes
a parameter: 5.6 MB for a 15m block stage, far more at 125m) over the responder's uplink. A round
that finishes moves the replica's round start, and `RoundContext.ripe` then keeps it from
answering anyone for H/2 inner steps: finished rounds are paced by training itself. A round that
does not finish (the partner stops reading, closes, declines after taking our tensors) leaves the
replica ripe, so without a pace one member of the stage could have us upload our tensors in a loop.

This counts unfinished answers on the replica's own clock, its inner steps: within any
`gap_steps` inner steps, one identity gets at most `per_identity` unfinished answers (two: an
honest partner may retry once after a glitch on either side), and all identities together at most
`total`.

An honest partner that is paced asks another replica in the meantime, as after any BUSY.
Pure bookkeeping, no networking.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["AnswerPace", "UnfinishedAnswers"]


@dataclass(frozen=True)
class AnswerPace:
    gap_steps: int
    """The window, in this replica's inner steps (H/2: what a finished round waits too)."""
    per_identity: int = 2
    """Unfinished answers one identity gets within the window."""
    total: int = 4
    """Unfinished answers all identities together get within the window."""


class UnfinishedAnswers:
    """Rounds this replica answered that did not finish, by identity and inner step."""

    def __init__(self, pace: AnswerPace):
        if pace.gap_steps < 1 or pace.per_identity < 1 or pace.total < 1:
            raise ValueError(f"an answer pace needs a window of >= 1 step and >= 1 answer, got {pace}")
        self.pace = pace
        self._recent: deque[tuple[int, str]] = deque()  # (inner step, identity) in the window, oldest first
        self._per_identity: dict[str, int] = {}  # identity -> its answers in the window (no zero entries)

    def refusal(self, identity: str, step: int) -> str | None:
        """Why `identity` gets no answer at inner step `step` (None: it may get one)."""
        self._forget_before(step - self.pace.gap_steps)
        if self._per_identity.get(identity, 0) >= self.pace.per_identity:
            first = next(at for at, who in self._recent if who == identity)
            return (
                f"{self.pace.per_identity} rounds with you did not finish since inner step {first}; "
                f"ask again from inner step {first + self.pace.gap_steps}"
            )
        if len(self._recent) >= self.pace.total:
            return (
                f"{self.pace.total} rounds did not finish within {self.pace.gap_steps} inner steps; ask another replica"
            )
        return None

    def note(self, identity: str, step: int) -> None:
        """A round answered to `identity` at inner step `step` did not finish."""
        self._recent.append((step, identity))
        self._per_identity[identity] = self._per_identity.get(identity, 0) + 1

    def _forget_before(self, step: int) -> None:
        # an answer counts for gap_steps steps: at `step` (= now - gap) it no longer does
        while self._recent and self._recent[0][0] <= step:
            _, identity = self._recent.popleft()
            if self._per_identity[identity] > 1:
                self._per_identity[identity] -= 1
            else:
                del self._per_identity[identity]

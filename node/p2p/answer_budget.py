"""How many expensive answers (a whole stage's state) a node gives each requester, and all of them
together, per sliding window (docs/security.md, "Budgets for expensive answers").

An open swarm serves its weights to whoever asks: a joiner downloads its stage once, a CheckFree
rebuild fetches each source stage once per attempt, `node export` each stage once. A stranger
asking in a loop would make the peer upload its whole stage over and over (31.9 MB for a 2-layer
15m block stage, far more at 125m) on a home uplink. The budget keeps the honest cases free and bounds the
loop: `per_identity` answers in `window` seconds for one identity, `total` for everyone. A spent
budget is refused at once, before any copy of the state is taken. Pure bookkeeping, no networking.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["AnswerBudget", "BudgetLimits"]


@dataclass(frozen=True)
class BudgetLimits:
    """Answers allowed per sliding window."""

    per_identity: int = 4
    """For one requesting identity: a joiner retrying, a rebuild attempt or two, an export."""
    total: int = 24
    """For all requesters together (a stranger with many identities meets this one)."""
    window: float = 60.0
    """Seconds over which answers are counted."""


class AnswerBudget:
    """Sliding-window counts of answers given, per identity and in total."""

    def __init__(self, limits: BudgetLimits | None = None, clock: Callable[[], float] = time.monotonic):
        self.limits = limits or BudgetLimits()
        if self.limits.per_identity < 1 or self.limits.total < 1 or not self.limits.window > 0:
            raise ValueError(f"answer budget limits must be >= 1 answer in a window > 0 s, got {self.limits}")
        self._clock = clock
        self._given: deque[tuple[float, str]] = deque()  # (when, identity), oldest first
        self._per_identity: dict[str, int] = {}  # identity -> answers in the window (no zero entries)

    def take(self, identity: str) -> str | None:
        """Count one answer to `identity` and return None, or return why it is refused now (the
        refusal is not counted). Bounded memory: only answers given in the window are kept."""
        now = self._clock()
        self._forget_before(now - self.limits.window)
        mine = self._per_identity.get(identity, 0)
        if mine >= self.limits.per_identity:
            return self._refusal(f"{self.limits.per_identity} per identity", identity, now)
        if len(self._given) >= self.limits.total:
            return self._refusal(f"{self.limits.total} for all requesters", None, now)
        self._given.append((now, identity))
        self._per_identity[identity] = mine + 1
        return None

    def given(self, identity: str | None = None) -> int:
        """Answers counted in the current window (to `identity`, or to all)."""
        self._forget_before(self._clock() - self.limits.window)
        return len(self._given) if identity is None else self._per_identity.get(identity, 0)

    def _forget_before(self, cutoff: float) -> None:
        while self._given and self._given[0][0] <= cutoff:
            _, identity = self._given.popleft()
            left = self._per_identity[identity] - 1
            if left:
                self._per_identity[identity] = left
            else:
                del self._per_identity[identity]

    def _refusal(self, which: str, identity: str | None, now: float) -> str:
        # the next answer frees up when the oldest counted one (of this identity, or of all) leaves the window
        oldest = next((when for when, who in self._given if identity is None or who == identity), now)
        wait = max(0.0, oldest + self.limits.window - now)
        return f"answer budget spent ({which} per {self.limits.window:g} s); next in {wait:.0f} s"

"""The simulated clock: seconds since the start of a run, advanced only by what the run charges.

The project's routers take a `clock` callable (node/pipeline/routing.py); handing them
`SimClock.now` makes their load decay follow simulated time instead of the host's.
"""

from __future__ import annotations


class SimClock:
    """Simulated seconds; moves forward only (charging negative time is a bug in the caller)."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Add `seconds` (>= 0) and return the new time."""
        if not seconds >= 0.0:
            raise ValueError(f"the clock only moves forward, got {seconds!r} s")
        self._now += float(seconds)
        return self._now

    def advance_to(self, when: float) -> float:
        """Move to `when` if that is later than now (events that finished in the past change nothing)."""
        self._now = max(self._now, float(when))
        return self._now

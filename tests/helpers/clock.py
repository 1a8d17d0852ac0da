"""A clock a unit test moves by hand, for code that reads its time from a callable."""

from __future__ import annotations


class FakeClock:
    """Returns `now` when called; the test moves it by setting `now` or with `advance`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

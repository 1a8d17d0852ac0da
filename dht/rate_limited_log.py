"""Warnings about hostile input, at most one per kind and source a minute: a forger retrying every
second must not flood the logs (or fill a volunteer's disk)."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict

_NUMBERS = re.compile(r"\d+(\.\d+)?")


class RateLimitedLog:
    """One warning per (what, whom) per `period`: a forger retrying every second must not flood logs."""

    def __init__(self, log: logging.Logger, period: float = 60.0, size: int = 256):
        self.log, self.period, self.size = log, period, size
        self._last: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._lock = threading.Lock()

    def warning(self, what: str, whom: str, message: str) -> None:
        whom = _NUMBERS.sub("#", whom)  # "expires 3599 s from now" and "3598 s" are the same complaint
        now = time.monotonic()
        with self._lock:
            last = self._last.get((what, whom))
            if last is not None and now - last < self.period:
                return
            self._last[(what, whom)] = now
            self._last.move_to_end((what, whom))
            while len(self._last) > self.size:
                self._last.popitem(last=False)
        self.log.warning(message)

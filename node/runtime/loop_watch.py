"""How long the event loop was blocked: the one number that tells whether anything (a stranger's
oversized input, a slow codec, compute that leaked onto the loop) is stalling the node.

`LoopWatch` wakes every `period` seconds and measures how late it woke. A lateness over
`warn_after` is logged as "event loop blocked for X s" (the tests look for that line), and the
worst lateness of the last minute is kept for status output.
"""

from __future__ import annotations

import asyncio
import logging
import time

logger = logging.getLogger(__name__)

BLOCKED_LOG_PREFIX = "event loop blocked for"


class LoopWatch:
    def __init__(self, period: float = 0.05, warn_after: float = 0.5, window: float = 60.0):
        self.period = period
        self.warn_after = warn_after
        self.window = window
        self.worst_lag = 0.0  # seconds, over the current window
        self._window_started = time.monotonic()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.period)
            self.observe(loop.time() - before - self.period)

    def observe(self, lag: float) -> None:
        now = time.monotonic()
        if now - self._window_started > self.window:
            self.worst_lag, self._window_started = 0.0, now
        self.worst_lag = max(self.worst_lag, lag)
        if lag > self.warn_after:
            logger.warning(f"{BLOCKED_LOG_PREFIX} {lag:.2f} s")

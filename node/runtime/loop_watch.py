"""How long the event loop was blocked: the one number that tells whether anything (a stranger's
oversized input, a slow codec, compute that leaked onto the loop) is stalling the node.

`LoopWatch` wakes every `period` seconds and measures how late it woke. A lateness over
`warn_after` is logged as "event loop blocked for X s" (the tests look for that line), and the
worst lateness of the last minute is kept for status output.

A lateness says that the loop was blocked, not by what. So while `run` is going, a watchdog thread
looks at the loop's heartbeat, and once the loop has been silent for `warn_after` it logs where
the loop's thread is at that moment ("event loop stalled in ...", innermost frame first), once per
stall: the line that names the culprit on a machine nobody can attach a debugger to.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

logger = logging.getLogger(__name__)

BLOCKED_LOG_PREFIX = "event loop blocked for"
STALL_LOG_PREFIX = "event loop stalled in"
STALL_FRAMES = 6  # innermost frames of the loop thread's stack that a stall line shows


class LoopWatch:
    def __init__(self, period: float = 0.05, warn_after: float = 0.5, window: float = 60.0):
        self.period = period
        self.warn_after = warn_after
        self.window = window
        self.worst_lag = 0.0  # seconds, over the current window
        self._window_started = time.monotonic()
        self._beat = time.monotonic()  # the loop's last wake-up, read by the watchdog thread

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        stop = threading.Event()
        watchdog = threading.Thread(
            target=self._watch, args=(threading.get_ident(), stop), name="loop-watchdog", daemon=True
        )
        watchdog.start()
        try:
            while True:
                before = loop.time()
                self._beat = time.monotonic()
                await asyncio.sleep(self.period)
                self.observe(loop.time() - before - self.period)
        finally:
            stop.set()

    def _watch(self, loop_thread: int, stop: threading.Event) -> None:
        """Log the loop thread's stack once per stall longer than `warn_after` (runs in its thread)."""
        reported = None
        while not stop.wait(self.warn_after / 2):
            beat = self._beat
            if beat == reported or time.monotonic() - beat < self.warn_after:
                continue
            reported = beat
            logger.warning(f"{STALL_LOG_PREFIX} {stall_site(loop_thread)}")

    def observe(self, lag: float) -> None:
        now = time.monotonic()
        if now - self._window_started > self.window:
            self.worst_lag, self._window_started = 0.0, now
        self.worst_lag = max(self.worst_lag, lag)
        if lag > self.warn_after:
            logger.warning(f"{BLOCKED_LOG_PREFIX} {lag:.2f} s")


def stall_site(thread_id: int) -> str:
    """The innermost STALL_FRAMES frames of a thread's stack, one line: file:line function."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "(thread gone)"
    frames = traceback.extract_stack(frame)[-STALL_FRAMES:]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in reversed(frames))

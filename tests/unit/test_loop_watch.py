"""LoopWatch: how late the event loop wakes, and where its thread is when it does not."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from node.runtime.loop_watch import BLOCKED_LOG_PREFIX, STALL_LOG_PREFIX, LoopWatch


def test_loop_watch_logs_a_blocked_loop(caplog):
    watch = LoopWatch(warn_after=0.5, window=60.0)
    with caplog.at_level(logging.WARNING):
        watch.observe(0.1)
        assert not caplog.records
        watch.observe(0.8)
    assert watch.worst_lag == pytest.approx(0.8)
    assert [r.getMessage() for r in caplog.records] == [f"{BLOCKED_LOG_PREFIX} 0.80 s"]


def test_loop_watch_names_where_the_loop_is_stuck(caplog):
    """A blocking call on the loop is reported with the frame it sits in, while it blocks."""

    def block_the_loop() -> None:
        time.sleep(0.5)  # stands in for compute that leaked onto the loop

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(LoopWatch(period=0.02, warn_after=0.2).run())
        await asyncio.sleep(0.05)
        block_the_loop()
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    stalls = [r.getMessage() for r in caplog.records if r.getMessage().startswith(STALL_LOG_PREFIX)]
    assert len(stalls) == 1 and "block_the_loop" in stalls[0]
    assert any(r.getMessage().startswith(BLOCKED_LOG_PREFIX) for r in caplog.records)

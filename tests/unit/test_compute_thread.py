"""node/runtime/compute_thread.py: calls run on one thread in order; results, errors and cancellation
reach the right caller, awaited or submitted."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from node.runtime.compute_thread import ComputeThread


def test_awaited_calls_run_in_order_on_one_thread_and_errors_reach_the_caller():
    async def main() -> None:
        thread = ComputeThread("test-compute")
        try:
            seen: list[tuple[int, str]] = []

            def record(i: int) -> int:
                seen.append((i, threading.current_thread().name))
                return i * i

            results = await asyncio.gather(*(thread.run(record, i) for i in range(50)))
            assert results == [i * i for i in range(50)]
            assert [i for i, _ in seen] == list(range(50))
            assert {name for _, name in seen} == {"test-compute"}

            def fail() -> None:
                raise ValueError("bad input")

            with pytest.raises(ValueError, match="bad input"):
                await thread.run(fail)
            assert await thread.run(record, 7) == 49  # the thread lives on
        finally:
            thread.shutdown()

    asyncio.run(main())


def test_a_cancelled_call_that_has_not_started_is_skipped():
    async def main() -> None:
        thread = ComputeThread("test-compute")
        release = threading.Event()
        ran: list[str] = []
        try:
            blocker = asyncio.ensure_future(thread.run(lambda: (release.wait(5), ran.append("blocker"))))
            queued = asyncio.ensure_future(thread.run(ran.append, "queued"))
            await asyncio.sleep(0.05)
            queued.cancel()
            await asyncio.sleep(0.05)
            release.set()
            await asyncio.wait_for(blocker, 5)
            assert await thread.run(ran.append, "after") is None
            assert queued.cancelled()
            assert ran == ["blocker", "after"]
        finally:
            thread.shutdown()

    asyncio.run(main())


def test_submit_and_shutdown_behave_as_an_executor():
    thread = ComputeThread("test-compute")
    release = threading.Event()
    running = thread.submit(lambda: release.wait(5) and "done")
    queued = thread.submit(time.sleep, 0)
    time.sleep(0.05)
    threading.Timer(0.1, release.set).start()
    thread.shutdown(wait=True, cancel_futures=True)  # the running call finishes, the queued one is cancelled
    assert running.result(timeout=1) == "done"
    assert queued.cancelled()
    with pytest.raises(RuntimeError, match="shut down"):
        thread.submit(time.sleep, 0)
    assert not thread._thread.is_alive()


def test_a_call_given_first_runs_after_the_running_one_and_before_every_queued_one():
    async def main() -> None:
        thread = ComputeThread("test-compute")
        release = threading.Event()
        ran: list[str] = []
        try:
            blocker = asyncio.ensure_future(thread.run(lambda: (release.wait(5), ran.append("running"))))
            await asyncio.sleep(0.05)  # the blocker has started: `first` cannot overtake a running call
            queued = [asyncio.ensure_future(thread.run(ran.append, f"queued {i}")) for i in range(3)]
            await asyncio.sleep(0)
            urgent = [asyncio.ensure_future(thread.run(ran.append, f"first {i}", first=True)) for i in range(2)]
            await asyncio.sleep(0.05)
            release.set()
            await asyncio.wait_for(asyncio.gather(blocker, *queued, *urgent), 5)
            assert ran == ["running", "first 0", "first 1", "queued 0", "queued 1", "queued 2"]
            assert await thread.run(ran.append, "idle", first=True) is None  # and on an idle thread at once
            assert ran[-1] == "idle"
        finally:
            thread.shutdown()

    asyncio.run(main())

"""One thread that runs a stage's compute calls in order, for the event loop and for plain callers.

A stage hands its worker two or three calls per microbatch (node/stage/stage_worker.py). Through
`loop.run_in_executor` on a one-thread ThreadPoolExecutor each call costs a concurrent Future, a work
item, the pool's idle-semaphore check (a Python Condition whose lock the worker thread takes after
every call, so the event loop can block on it), and a second future chained to the first. Profiled
in a 3 x 1 swarm (docs/changes.md, efc992f), `ThreadPoolExecutor.submit` was a fifth of a block
stage's event-loop samples. Here an awaited call is one future of the loop, one put on a C queue,
and one `call_soon_threadsafe` back: the same thread and order, without the pool's machinery.

`ComputeThread` is still a `concurrent.futures.Executor` (`submit`, `shutdown`), so synchronous code
and tests can use it as they would the pool.

`run(..., first=True)` puts a call ahead of every queued one (after the running call): stage 0's
embedding forward and backward take milliseconds beside its head's seconds, and behind a queue of
heads they hold the next stage idle, which is waiting for that forward (docs/benchmarks.md, "The
wire at real size").
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
_WAKE = object()  # put on the queue after a call goes to the front, so a waiting thread takes it


class ComputeThread(concurrent.futures.Executor):
    """Runs the calls given to it one after another on a thread of its own, in the order given."""

    def __init__(self, name: str) -> None:
        # items: (fn, args, where the outcome goes); None ends the thread
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._first: collections.deque = collections.deque()  # calls ahead of the queue (run's `first`)
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any, first: bool = False) -> T:
        """`fn(*args)` on the thread, awaited from the running event loop; with `first`, before every
        call queued without it. Cancelling the awaiting task skips the call if it has not started,
        and drops its result if it has."""
        self._check_open()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        item = (fn, args, _LoopOutcome(loop, future))
        if first:
            self._first.append(item)
            self._calls.put(_WAKE)
        else:
            self._calls.put(item)
        return await future

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        self._check_open()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((functools.partial(fn, **kwargs) if kwargs else fn, args, future))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new calls; with `cancel_futures` the queued ones are cancelled, the running one finishes."""
        self._closed = True
        if cancel_futures:
            while True:
                try:
                    item = self._calls.get_nowait()
                except queue.Empty:
                    break
                if item is not None and item is not _WAKE:
                    item[2].cancel()
            while self._first:
                self._first.popleft()[2].cancel()
        self._calls.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the compute thread is shut down")

    def _work(self) -> None:
        while (item := self._calls.get()) is not None:
            while self._first:
                self._run(self._first.popleft())
            if item is not _WAKE:
                self._run(item)
        while self._first:  # shut down with calls still in front: they were given before the end
            self._run(self._first.popleft())

    @staticmethod
    def _run(item: tuple) -> None:
        fn, args, outcome = item
        if not isinstance(outcome, concurrent.futures.Future):
            outcome.run(fn, args)
        elif outcome.set_running_or_notify_cancel():
            try:
                outcome.set_result(fn(*args))
            except BaseException as e:  # the caller's to handle, as with a thread pool
                outcome.set_exception(e)


class _LoopOutcome:
    """Where an awaited call's result goes: a future of the loop that waits, settled on that loop."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        self.loop, self.future = loop, future

    def run(self, fn: Callable[..., Any], args: tuple) -> None:
        # read from this thread, `cancelled()` may be late: the call then runs and its result is dropped
        if self.future.cancelled():
            return
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as e:
            error = e
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)
        except RuntimeError:  # the loop is closed: nobody waits for this any more
            pass

    def cancel(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.future.cancel)
        except RuntimeError:
            pass


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

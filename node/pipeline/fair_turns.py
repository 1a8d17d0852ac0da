"""Turns at a block stage's compute, shared fairly among the stage-0 peers whose microbatches wait.

A block stage serves every stage-0 peer (origin) that routes to it. Served first come, first
served, an origin's share of the stage is its share of what waits there, so it follows the sizes
of the origins' in-flight windows (node/pipeline/in_flight_window.py). Two windows probing one
shared bottleneck feed on each other: a probe that grows one origin's window is "kept" because it
takes the other's share, the other's delivery rate falls, and its own rule then shrinks it. Measured
in a 3 x 2 swarm on this repository's 2-core host (docs/changes.md, 92c7949): one origin's
window stayed at 7 while the other's climbed past 18, and they completed 735 against 2,255
microbatches in the same minute.

So the stage hands out turns round-robin over the origins with work waiting, one call each per
round (fair queueing, as a router serves flows): an origin with work waiting gets an equal share
however many microbatches it queued, and growing a window past what keeps its own queue non-empty
only adds delay, which is what the window's probes then measure. At most `concurrent` calls hold a
turn at once: two keep the compute thread's next call queued behind the running one, so it never
waits for the event loop between calls. No networking here: the block relay (node/pipeline/block_relay.py)
wraps each block-stage compute call in a turn of the microbatch's origin.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import Hashable
from typing import Any

# calls holding a turn at once: one computing, one queued on the compute thread behind it
CONCURRENT_TURNS = 2


class FairTurns:
    """Round-robin turns over origins, at most `concurrent` held at once. Use as
    ``async with turns.turn(origin): ...``; a cancelled waiter gives its place up."""

    def __init__(self, concurrent: int = CONCURRENT_TURNS) -> None:
        if concurrent < 1:
            raise ValueError(f"concurrent must be >= 1, got {concurrent}")
        self.concurrent = concurrent
        self.held = 0
        # origins with calls waiting, in the order their next turn comes; each its waiters, oldest first
        self._waiting: OrderedDict[Hashable, deque[asyncio.Future]] = OrderedDict()

    @property
    def waiting(self) -> int:
        return sum(len(waiters) for waiters in self._waiting.values())

    def turn(self, origin: Hashable) -> _Turn:
        """An async context manager holding one of `origin`'s turns (a plain object: this is per hop)."""
        return _Turn(self, origin)

    async def _acquire(self, origin: Hashable) -> None:
        if self.held < self.concurrent and not self._waiting:
            self.held += 1
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(origin, deque()).append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():  # the turn came as the wait was cancelled: pass it on
                self._release()
            else:
                self._forget(origin, granted)
            raise

    def _release(self) -> None:
        """End a turn: the next origin in the round takes it, or it is free."""
        while self._waiting:
            origin, waiters = next(iter(self._waiting.items()))
            granted = waiters.popleft()
            if waiters:
                self._waiting.move_to_end(origin)  # its next call waits for the others' turns
            else:
                del self._waiting[origin]
            if not granted.done():
                granted.set_result(None)  # the turn passes on: `held` stays the same
                return
        self.held -= 1

    def _forget(self, origin: Hashable, granted: asyncio.Future) -> None:
        waiters = self._waiting.get(origin)
        if waiters is None:
            return
        with contextlib.suppress(ValueError):
            waiters.remove(granted)
        if not waiters:
            del self._waiting[origin]


class _Turn:
    __slots__ = ("origin", "turns")

    def __init__(self, turns: FairTurns, origin: Hashable) -> None:
        self.turns, self.origin = turns, origin

    async def __aenter__(self) -> None:
        await self.turns._acquire(self.origin)

    async def __aexit__(self, *exc: Any) -> None:
        self.turns._release()

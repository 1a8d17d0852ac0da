"""How long a stage-0 microbatch waits before its next attempt (node/pipeline/origin.py).

A stage whose peers all died still looks served until their records expire: attempts spent at once
all fail on the dead peers, and the microbatch is dropped before the swarm view even knows the
stage is gone. So the pauses between attempts double and add up to a record's lifetime (heartbeat
ttl + period), and the last attempt comes after the view dropped the dead records.

After each pause, while some stage has no online peer at all, the attempt waits for one (a join and
a CheckFree rebuild, docs/algorithms.md) instead of being spent where no peer can take it: up to
the microbatch's whole budget of `retries + 1` deadlines, because a rebuild (the lost grace, a
replacement's start, its state download) outlasts one deadline on a loaded machine. Once the stage
is back in this peer's view, the attempt waits one heartbeat period more: the other stages' peers
see the newcomer only at their next view refresh (every half period), and an attempt sent before
that is refused along the path ("no peer of stage S took it") and wasted. The attempts spent
before the view knew of the outage are then given back, once. Measured under churn in
docs/reliability.md ("Churn").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from node.config import HeartbeatConfig

POLL_SECONDS = 0.5  # how often a waiting attempt looks at the swarm view again


@dataclass
class RetryPause:
    retries: int
    """Attempts after the first (training.max_retries)."""
    heartbeat: HeartbeatConfig
    deadline: float
    """A microbatch's deadline; an attempt waits for an unserved stage up to `retries + 1` of them."""
    stages_served: Callable[[], bool] = field(default=lambda: True)
    """Whether every stage has an online peer now (the driver's `ready`)."""

    def seconds(self, attempt: int) -> float:
        """The pause after failed attempt `attempt` (0-based) of `retries + 1`."""
        lifetime = self.heartbeat.ttl + self.heartbeat.period
        return lifetime * 2**attempt / max(2**self.retries - 1, 1)  # retries = 0: no pause is ever asked for

    async def attempts(self) -> AsyncIterator[int]:
        """One microbatch's attempt numbers (0-based), each after the pause its predecessor earned;
        the caller stops iterating when an attempt succeeds. Attempts spent on a stage outage (the
        pause had to wait for an emptied stage) are given back once: they were lost to the dead
        peers' records, not to the microbatch's path."""
        attempt, given_back = 0, False
        while True:
            yield attempt
            if attempt >= self.retries:  # the last one failed: the microbatch is dropped, no pause
                return
            outage = await self.pause(attempt)
            attempt, given_back = (0, True) if outage and not given_back else (attempt + 1, given_back)

    async def pause(self, attempt: int) -> bool:
        """Wait before the attempt after `attempt`; whether a stage outage was waited out."""
        await asyncio.sleep(self.seconds(attempt))
        give_up = time.monotonic() + self.deadline * (self.retries + 1)
        waited = False
        while not self.stages_served() and time.monotonic() < give_up:
            waited = True
            await asyncio.sleep(POLL_SECONDS)
        if waited and self.stages_served():  # back in our view: let the others' views catch up
            await asyncio.sleep(self.heartbeat.period)
            return True
        return False

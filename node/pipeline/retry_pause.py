"""How long a stage-0 microbatch waits before its next attempt (node/pipeline/traffic.py).

A stage whose peers all died still looks served until their records expire: attempts spent at once
all fail on the dead peers, and the microbatch is dropped before the swarm view even knows the
stage is gone. So the pauses between attempts double and add up to a record's lifetime (heartbeat
ttl + period), and the last attempt comes after the view dropped the dead records. After each pause,
while some stage has no online peer at all, the attempt waits for one (a join and a CheckFree
rebuild, docs/algorithms.md), up to a microbatch deadline, instead of being spent where no peer can
take it. Measured under churn in docs/reliability.md ("Churn").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from node.config import HeartbeatConfig

POLL_SECONDS = 0.5  # how often a waiting attempt looks at the swarm view again


@dataclass
class RetryPause:
    retries: int
    """Attempts after the first (training.max_retries)."""
    heartbeat: HeartbeatConfig
    deadline: float
    """Seconds an attempt may wait for an unserved stage: a microbatch's deadline."""
    stages_served: Callable[[], bool] = field(default=lambda: True)
    """Whether every stage has an online peer now (the driver's `ready`)."""

    def seconds(self, attempt: int) -> float:
        """The pause after failed attempt `attempt` (0-based) of `retries + 1`."""
        lifetime = self.heartbeat.ttl + self.heartbeat.period
        return lifetime * 2**attempt / max(2**self.retries - 1, 1)  # retries = 0: no pause is ever asked for

    async def pause(self, attempt: int) -> None:
        """Wait before the attempt after `attempt`; no wait after the last one (the microbatch is dropped)."""
        if attempt >= self.retries:
            return
        await asyncio.sleep(self.seconds(attempt))
        give_up = time.monotonic() + self.deadline
        while not self.stages_served() and time.monotonic() < give_up:
            await asyncio.sleep(POLL_SECONDS)

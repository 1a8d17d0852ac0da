"""Keeping a peer's record alive: re-announce every period with an expiration of now + TTL.

A peer that dies stops re-announcing and its record expires within the TTL; a peer that leaves
cleanly overwrites its record with state `leaving`. The DHT never accepts an entry that expires
earlier than the one it holds, so the farewell keeps the last expiration (plus a hair) and readers
simply treat `leaving` peers as gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

from hivemind.utils import get_dht_time

from dht.records import PeerRecord
from dht.registry import SwarmRegistry

logger = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, registry: SwarmRegistry, current_record: Callable[[], PeerRecord], period: float, ttl: float):
        self.registry = registry
        self.current_record = current_record
        self.period = period
        self.ttl = ttl
        self.last_expiration = 0.0
        self._wakeup = asyncio.Event()

    async def announce_now(self) -> None:
        record = self.current_record()
        expiration = max(get_dht_time() + self.ttl, self.last_expiration + 1e-3)
        try:
            stored = await self.registry.announce(record, expiration)
        except Exception as e:  # the DHT is best effort: a failed beat is retried next period
            logger.warning(f"heartbeat failed: {e!r}")
            return
        if stored:
            self.last_expiration = expiration
        else:
            logger.debug("heartbeat not stored by any DHT peer; retrying next period")

    def poke(self) -> None:
        """Announce soon instead of waiting for the period (state changed)."""
        self._wakeup.set()

    async def run(self) -> None:
        while True:
            await self.announce_now()
            self._wakeup.clear()
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow this task's cancellation
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.period):
                    await self._wakeup.wait()

    async def farewell(self, record: PeerRecord) -> None:
        """Overwrite this peer's record with state `leaving` (called on clean shutdown or a move)."""
        record.state = "leaving"
        expiration = max(self.last_expiration + 1e-3, get_dht_time() + 1.0)
        try:
            async with asyncio.timeout(5.0):
                await self.registry.announce(record, expiration)
        except Exception as e:
            logger.warning(f"could not announce leaving: {e!r}")

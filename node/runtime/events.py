"""Publishing swarm events (rebuilds, bans, failed rounds) for dashboards: best effort, off the caller's path.

Events are displayed, never acted upon: a failed publish is logged and dropped, and the caller
never waits for the DHT.
"""

from __future__ import annotations

import logging
import time

from dht.records import EventKind, SwarmEvent
from dht.registry import SwarmRegistry
from node.runtime.tasks import BackgroundTasks
from node.runtime.timeouts import within

logger = logging.getLogger(__name__)

MAX_DETAIL_CHARS = 500  # SwarmEvent.from_wire accepts 512


class EventPublisher:
    """Publishes this peer's events in the background; `close()` cancels what is still pending."""

    def __init__(self, registry: SwarmRegistry, peer_id: str, timeout: float = 10.0):
        self.registry = registry
        self.peer_id = peer_id
        self.timeout = timeout
        self._tasks = BackgroundTasks()

    def publish(self, kind: EventKind, stage: int | None, detail: str, peer_id: str | None = None) -> None:
        """Publish an event about `peer_id` (default: this peer) without waiting for it."""
        event = SwarmEvent(time.time(), kind, peer_id or self.peer_id, stage, detail[:MAX_DETAIL_CHARS])
        self._tasks.spawn(self.publish_now(event), name=f"event-{kind}")

    async def publish_now(self, event: SwarmEvent) -> bool:
        """Publish and wait (bounded); False, with a log line, when the DHT did not take it."""
        try:
            return await within(self.registry.publish_event(event), self.timeout)
        except Exception as e:  # best effort: the DHT may be unreachable for a while
            logger.warning(f"could not publish the {event.kind} event: {e!r}")
            return False

    async def close(self) -> None:
        await self._tasks.close()

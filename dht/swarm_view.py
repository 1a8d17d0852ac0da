"""A peer's periodically refreshed picture of the swarm, read from the DHT.

Routing, gossip and recovery all ask "who serves stage k now?"; one task per node answers it by
re-reading every stage's records a few times per heartbeat period, instead of each of them
querying the DHT on its own hot path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from hivemind.utils import get_dht_time

from dht.records import PeerRecord, PeerState, one_stage_per_peer
from dht.registry import SwarmRegistry

logger = logging.getLogger(__name__)


def merge_reads(
    previous: dict[int, list[PeerRecord]], fresh: dict[int, list[PeerRecord]], now: float
) -> dict[int, list[PeerRecord]]:
    """The fresh read, plus records of the previous picture that it missed but that have not
    expired yet. A DHT traversal now and then comes back without a record that is still alive
    (a slow replica, a routing-table gap); a record is valid until its expiration, so forgetting it
    early would make routing and the stage-0 driver stall on a peer that is fine."""
    merged = {}
    for stage, records in fresh.items():
        seen = {record.peer_id for record in records}
        kept = [r for r in previous.get(stage, []) if r.peer_id not in seen and r.expires > now]
        merged[stage] = sorted(records + kept, key=lambda record: record.peer_id)
    return one_stage_per_peer(merged)


class SwarmView:
    def __init__(self, registry: SwarmRegistry, num_stages: int, period: float):
        self.registry = registry
        self.num_stages = num_stages
        self.period = period
        self.peers_by_stage: dict[int, list[PeerRecord]] = {stage: [] for stage in range(num_stages)}
        self.refreshed = asyncio.Event()
        self._listeners: list[Callable[[dict[int, list[PeerRecord]]], None]] = []

    def on_refresh(self, listener: Callable[[dict[int, list[PeerRecord]]], None]) -> None:
        self._listeners.append(listener)

    def online(self, stage: int, exclude: str | None = None) -> list[PeerRecord]:
        return [p for p in self.peers_by_stage.get(stage, []) if p.state == PeerState.ONLINE and p.peer_id != exclude]

    def record_of(self, peer_id: str) -> PeerRecord | None:
        for peers in self.peers_by_stage.values():
            for peer in peers:
                if peer.peer_id == peer_id:
                    return peer
        return None

    async def refresh(self) -> None:
        self.peers_by_stage = merge_reads(
            self.peers_by_stage, await self.registry.all_peers(self.num_stages), get_dht_time()
        )
        for listener in self._listeners:
            listener(self.peers_by_stage)
        self.refreshed.set()

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # a slow or split DHT: keep the last picture, try again soon
                logger.warning(f"could not refresh the swarm view: {e!r}")
            await asyncio.sleep(self.period)

"""Who is where: typed reads and writes of the swarm's DHT records.

All methods are coroutines on the node's single event loop. Reads validate every record
(`dht.records`) and drop malformed ones with a log line, so a hostile or buggy peer can at worst
hide itself, never crash a reader.
"""

from __future__ import annotations

import logging
from typing import Any

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from dht.records import (
    ConfigRecord,
    PeerRecord,
    RecordError,
    SwarmEvent,
    SWARMS_KEY,
    events_key,
    stage_key,
)

logger = logging.getLogger(__name__)

MAX_EVENTS = 200


async def list_swarms(dht: DHTNode) -> dict[str, ConfigRecord]:
    """Every swarm whose config is published in this DHT, by swarm id (malformed ones skipped)."""
    found = await dht.get(SWARMS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    swarms = {}
    for swarm_id, entry in found.value.items():
        try:
            record = ConfigRecord.from_wire(getattr(entry, "value", None))
        except RecordError as e:
            logger.warning(f"ignoring malformed config record for swarm {str(swarm_id)[:64]!r}: {e}")
            continue
        if record.config.get("swarm_id") != swarm_id:
            logger.warning(f"ignoring config record filed under {str(swarm_id)[:64]!r} for another swarm")
            continue
        swarms[swarm_id] = record
    return swarms


class SwarmRegistry:
    """The DHT view of one swarm. Holds no state but the DHT node and the swarm id."""

    def __init__(self, dht: DHTNode, swarm_id: str):
        self.dht = dht
        self.swarm_id = swarm_id

    async def publish_config(self, record: ConfigRecord, ttl: float) -> bool:
        return await self.dht.store(SWARMS_KEY, record.to_wire(), get_dht_time() + ttl, subkey=self.swarm_id)

    async def fetch_config(self) -> ConfigRecord | None:
        return (await list_swarms(self.dht)).get(self.swarm_id)

    async def announce(self, record: PeerRecord, expiration_time: float) -> bool:
        record.updated = get_dht_time()
        return await self.dht.store(
            stage_key(self.swarm_id, record.stage), record.to_wire(), expiration_time, subkey=record.peer_id
        )

    async def stage_peers(self, stage: int) -> list[PeerRecord]:
        found = await self.dht.get(stage_key(self.swarm_id, stage), latest=True)
        return self._parse_stage(stage, found)

    async def all_peers(self, num_stages: int) -> dict[int, list[PeerRecord]]:
        keys = [stage_key(self.swarm_id, stage) for stage in range(num_stages)]
        found = await self.dht.get_many(keys, sufficient_expiration_time=float("inf"))
        return {stage: self._parse_stage(stage, found.get(key)) for stage, key in enumerate(keys)}

    async def publish_event(self, event: SwarmEvent, ttl: float = 300.0) -> bool:
        subkey = f"{event.peer_id}:{event.time:.6f}"
        return await self.dht.store(events_key(self.swarm_id), event.to_wire(), get_dht_time() + ttl, subkey=subkey)

    async def fetch_events(self) -> list[SwarmEvent]:
        found = await self.dht.get(events_key(self.swarm_id), latest=True)
        if found is None or not isinstance(found.value, dict):
            return []
        events = []
        for subkey, entry in found.value.items():
            try:
                events.append(SwarmEvent.from_wire(getattr(entry, "value", None)))
            except RecordError as e:
                logger.debug(f"ignoring malformed event {subkey!r}: {e}")
        events.sort(key=lambda event: event.time)
        return events[-MAX_EVENTS:]

    @staticmethod
    def _parse_stage(stage: int, found: Any) -> list[PeerRecord]:
        if found is None:
            return []
        if not isinstance(found.value, dict):
            logger.warning(f"ignoring stage {stage} entry: not a dictionary of peer records")
            return []
        now = get_dht_time()
        records = []
        for subkey, entry in found.value.items():
            expiration = getattr(entry, "expiration_time", None)
            if not isinstance(expiration, (int, float)) or expiration < now:
                continue
            try:
                records.append(PeerRecord.from_wire(entry.value, subkey=subkey, stage=stage, expires=float(expiration)))
            except RecordError as e:
                logger.warning(f"ignoring malformed peer record in stage {stage} from {str(subkey)[:64]!r}: {e}")
        records.sort(key=lambda record: record.peer_id)
        return records

"""A read-only view of a swarm: a client-mode DHT peer that serves nothing and never disturbs
training. Used by `node status` and `node dashboard`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, AsyncIterator, Sequence

from dht.records import ConfigRecord
from dht.registry import SwarmRegistry
from node.config import SwarmConfig
from node.daemon import check_compatible, find_swarm
from node.network import Network, start_network
from node.status import collect_snapshot


@dataclass
class Observer:
    network: Network
    registry: SwarmRegistry
    record: ConfigRecord
    config: SwarmConfig

    async def snapshot(self) -> dict[str, Any]:
        return await collect_snapshot(self.registry, self.record, self.config)


@contextlib.asynccontextmanager
async def observe(initial_peers: Sequence[str], swarm_id: str | None, find_timeout: float = 20.0) -> AsyncIterator[Observer]:
    network = await start_network(initial_peers=initial_peers, client_mode=True)
    try:
        record = await find_swarm(network, swarm_id, find_timeout)
        config = check_compatible(record)
        yield Observer(network, SwarmRegistry(network.dht, config.swarm_id), record, config)
    finally:
        await network.shutdown()


async def observe_once(initial_peers: Sequence[str], swarm_id: str | None) -> dict[str, Any]:
    async with observe(initial_peers, swarm_id) as observer:
        return await observer.snapshot()

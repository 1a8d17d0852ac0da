"""A read-only view of a swarm: a client-mode DHT peer that serves nothing and never disturbs
training. Used by `node status` and `node dashboard`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from dht.records import ConfigRecord
from dht.registry import SwarmRegistry
from node.config import SwarmConfig
from node.monitor.status import collect_snapshot, loss_floor, stage_requirements
from node.p2p.network import Network, start_network
from node.server.daemon import check_compatible, find_swarm


@dataclass
class Observer:
    """A connected observer; `snapshot()` reads the swarm once (see node/monitor/status.py)."""

    network: Network
    registry: SwarmRegistry
    record: ConfigRecord
    config: SwarmConfig

    async def snapshot(self) -> dict[str, Any]:
        return await collect_snapshot(self.registry, self.record, self.config)


@contextlib.asynccontextmanager
async def observe(
    initial_peers: Sequence[str],
    swarm_id: str | None,
    find_timeout: float = 20.0,
    founder: str | None = None,
    swarm_key: bytes | None = None,
) -> AsyncIterator[Observer]:
    """Without `swarm_key` a private swarm is still readable, its records' MACs unchecked; with it,
    records without a MAC under the key (an outsider's) are dropped."""
    network = await start_network(initial_peers=initial_peers, client_mode=True, swarm_key=swarm_key)
    try:
        record = await find_swarm(network, swarm_id, find_timeout, founder)
        config = check_compatible(record)
        # the snapshot's figures of the config alone (cached), computed once off the loop: the
        # synthetic source's floor is a linear solve over its contexts, seconds at a real preset
        await asyncio.to_thread(loss_floor, config)
        await asyncio.to_thread(stage_requirements, config)
        yield Observer(network, SwarmRegistry(network.dht, config.swarm_id), record, config)
    finally:
        await network.shutdown()


class ReconnectingObserver:
    """An observer that (re)connects on demand: `snapshot()` raises while the swarm is unreachable
    and connects again on the next call, so a live view can show "reconnecting" and carry on."""

    def __init__(
        self,
        initial_peers: Sequence[str],
        swarm_id: str | None,
        find_timeout: float = 10.0,
        founder: str | None = None,
        swarm_key: bytes | None = None,
    ) -> None:
        self.initial_peers = list(initial_peers)
        self.swarm_id = swarm_id
        self.find_timeout = find_timeout
        self.founder = founder
        self.swarm_key = swarm_key
        self._stack: contextlib.AsyncExitStack | None = None
        self._observer: Observer | None = None

    async def snapshot(self) -> dict[str, Any]:
        if self._observer is None:
            stack = contextlib.AsyncExitStack()
            try:
                self._observer = await stack.enter_async_context(
                    observe(self.initial_peers, self.swarm_id, self.find_timeout, self.founder, self.swarm_key)
                )
            except BaseException:
                await stack.aclose()
                raise
            self._stack = stack
        try:
            return await self._observer.snapshot()
        except Exception:
            await self.close()
            raise

    async def close(self) -> None:
        stack, self._stack, self._observer = self._stack, None, None
        if stack is not None:
            await stack.aclose()


async def observe_once(
    initial_peers: Sequence[str], swarm_id: str | None, founder: str | None = None, swarm_key: bytes | None = None
) -> dict[str, Any]:
    """Connect, read one snapshot, disconnect: `node status`."""
    async with observe(initial_peers, swarm_id, founder=founder, swarm_key=swarm_key) as observer:
        return await observer.snapshot()

"""Several real peers (each with its own p2pd and DHT node) inside one test process and event loop.

Lets a test reach into every peer's worker and pipeline while the traffic between them goes over
real libp2p streams on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from dht.announcer import PeerAnnouncer
from dht.records import ConfigRecord, PeerRecord
from dht.registry import SwarmRegistry
from node import __version__
from node.config import SwarmConfig
from node.p2p.network import Network, start_network
from node.server.stage_service import ServiceOptions, StageService, running_service
from protocol.version import PROTOCOL_VERSION

T = TypeVar("T")


@dataclass
class Peer:
    network: Network
    me: PeerAnnouncer
    service: StageService


@contextlib.asynccontextmanager
async def inprocess_swarm(
    config: SwarmConfig, stages: list[int], direct_links: bool = True
) -> AsyncIterator[list[Peer]]:
    """A bootstrap DHT node plus one serving peer per entry of `stages`, all online; their pipeline
    channels take direct links (node/p2p/direct.py) unless `direct_links` is false, as `node join` does."""
    anchor = await start_network(host="127.0.0.1")
    networks = [anchor]
    async with contextlib.AsyncExitStack() as stack:
        try:
            registry = SwarmRegistry(anchor.dht, config.swarm_id)
            record = ConfigRecord(PROTOCOL_VERSION, config.config_hash(), config.to_dict(), __version__)
            await registry.publish_config(record, 600)
            initial = await anchor.visible_maddrs()
            peers = []
            for stage in stages:
                network = await start_network(
                    host="127.0.0.1", initial_peers=initial, direct_port=0 if direct_links else None
                )
                networks.append(network)
                record = PeerRecord(
                    peer_id=network.peer_id,
                    stage=stage,
                    version=__version__,
                    direct_port=network.direct_port,
                )
                me = PeerAnnouncer(
                    SwarmRegistry(network.dht, config.swarm_id), record, config.heartbeat.period, config.heartbeat.ttl
                )
                me.set_addresses(await network.announced_addresses())
                await me.announce_now()
                service = await stack.enter_async_context(
                    running_service(network, config, me, ServiceOptions(device="cpu"))
                )
                await me.announce_now()
                peers.append(Peer(network, me, service))
            for peer in peers:
                await peer.service.view.refresh()
            yield peers
        finally:
            await stack.aclose()
            for network in reversed(networks):
                await network.shutdown()


def run_in_swarm(
    config: SwarmConfig, stages: list[int], scenario: Callable[[list[Peer]], Awaitable[T]], direct_links: bool = True
) -> T:
    """`scenario(peers)` in an event loop of its own, inside an `inprocess_swarm(config, stages)`
    that is shut down after it (whatever it raised); what it returned. How a synchronous test runs
    its steps among a few real peers."""

    async def in_swarm() -> T:
        async with inprocess_swarm(config, stages, direct_links) as peers:
            return await scenario(peers)

    return asyncio.run(in_swarm())

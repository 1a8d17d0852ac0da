"""Starting and stopping a peer's networking: hivemind's libp2p daemon (p2pd) and a DHT node.

Both run inside the node's own event loop (DHTNode over an in-process P2P handle) rather than in
hivemind.DHT's extra process: one loop per process, and p2pd is the only child to clean up.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence, TypeVar

from hivemind.dht.node import DHTNode
from hivemind.p2p import P2P

logger = logging.getLogger(__name__)
T = TypeVar("T")


class NetworkError(RuntimeError):
    """The peer could not start its networking or reach the swarm."""


@dataclass
class Network:
    p2p: P2P
    dht: DHTNode

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def visible_maddrs(self) -> list[str]:
        return [str(addr) for addr in await self.p2p.get_visible_maddrs()]

    @property
    def p2pd_pid(self) -> int | None:
        child = getattr(self.p2p, "_child", None)
        return None if child is None else child.pid

    async def shutdown(self) -> None:
        try:
            await self.dht.shutdown()
        finally:
            await self.p2p.shutdown()


async def _finish_or_clean_up(creation: Awaitable[T], shutdown: Callable[[T], Awaitable[None]]) -> T:
    """Await `creation`; if we are cancelled meanwhile (a caller's timeout), let it finish in the
    background and shut the result down, instead of leaking a p2pd that nobody owns."""
    task = asyncio.ensure_future(creation)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        def clean_up(finished: asyncio.Future) -> None:
            if not finished.cancelled() and finished.exception() is None:
                asyncio.ensure_future(shutdown(finished.result()))

        task.add_done_callback(clean_up)
        raise


def listen_maddr(host: str, port: int) -> str:
    family = "ip6" if ":" in host else "ip4"
    return f"/{family}/{host}/tcp/{port}"


async def start_network(
    *,
    host: str = "0.0.0.0",
    port: int = 0,
    initial_peers: Sequence[str] = (),
    identity_path: str | None = None,
    client_mode: bool = False,
    announce_maddrs: Sequence[str] = (),
    startup_timeout: float = 30.0,
) -> Network:
    """Start p2pd and a DHT node joined to `initial_peers` (none: this peer starts a new DHT)."""
    try:
        p2p = await _finish_or_clean_up(P2P.create(
            initial_peers=list(initial_peers),
            host_maddrs=[] if client_mode else [listen_maddr(host, port)],
            announce_maddrs=list(announce_maddrs) or None,
            identity_path=identity_path,
            dht_mode="client" if client_mode else "server",
            startup_timeout=startup_timeout,
            # a stranger's LAN gateway is none of our business; tests run on loopback
            nat_port_map=False,
            no_listen=client_mode,
        ), P2P.shutdown)
    except Exception as e:
        raise NetworkError(f"could not start the libp2p daemon: {e}") from e
    try:
        dht = await _finish_or_clean_up(DHTNode.create(
            p2p=p2p,
            initial_peers=list(initial_peers),
            client_mode=client_mode,
            num_workers=4,
            wait_timeout=5.0,
            cache_locally=False,
        ), DHTNode.shutdown)
    except BaseException as e:
        await asyncio.shield(p2p.shutdown())
        if not isinstance(e, Exception):
            raise
        where = ", ".join(initial_peers) or "(none)"
        raise NetworkError(f"could not join the DHT through initial peers {where}: {e}") from e
    return Network(p2p=p2p, dht=dht)

"""What a stranger's DHT requests may cost this node's event loop.

The DHT node runs in the node's own event loop (node/p2p/network.py), and hivemind decodes a
store request's values (msgpack) before any validator sees them: a 3.9 MB dictionary value in one
store request blocked the loop for 1.8 s when we measured it, and training with it. Two bounds
keep that cost small:

- p2pd refuses any DHT message above `DHT_MESSAGE_LIMIT` before it reaches Python at all (it is the
  daemon's limit on unary messages), so no single request can cost more than decoding that much;
- `DHTRequestGuard` sits in front of hivemind's DHT handlers and charges every incoming request to
  its sender by size, from a per-peer token bucket (`PeerConduct`), *before* hivemind decodes it.
  A peer over its budget, or banned for bad input elsewhere, gets an error at once.

Figures (docs/security.md): a 228 KB dictionary of tiny items, the worst shape of value we found,
costs ~120 ms of loop time on this 2-core machine, so a request at the limit costs ~0.3 s; the budget lets one peer send `DHT_BURST_BYTES`
at once and `DHT_BYTES_PER_SECOND` after that, while an honest peer sends a few kilobytes a
heartbeat.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2P, P2PContext

from dht.rate_limited_log import RateLimitedLog
from dht.records import short_peer_id
from node.p2p.bans import BanList
from node.p2p.peer_conduct import ConductLimits, PeerConduct

logger = logging.getLogger(__name__)
_refusals = RateLimitedLog(logger)

# A find response with every peer record of a 200-peer swarm (~2 KB per signed record) still fits.
DHT_MESSAGE_LIMIT = 512 * 1024
DHT_COST_UNIT_BYTES = 4096  # one token of the sender's bucket
DHT_BYTES_PER_SECOND = 64 * 1024
DHT_BURST_BYTES = 2 * DHT_MESSAGE_LIMIT  # at least one message of the largest size must always pass


class DHTRequestRefused(RuntimeError):
    """A DHT request refused before decoding (the sender gets it as an RPC error)."""


def dht_conduct(bans: BanList | None = None) -> PeerConduct:
    """The per-peer budget for incoming DHT requests, in tokens of `DHT_COST_UNIT_BYTES`; `bans`, the
    node's one ban store, refuses a peer banned for bad input anywhere else."""
    return PeerConduct(
        ConductLimits(
            streams_per_peer=8,
            total_streams=256,
            requests_per_second=DHT_BYTES_PER_SECOND / DHT_COST_UNIT_BYTES,
            request_burst=math.ceil(DHT_BURST_BYTES / DHT_COST_UNIT_BYTES),
        ),
        bans=bans,
    )


class DHTRequestGuard:
    """Stands in for a DHTProtocol as the servicer of its RPC handlers (hivemind's `wrapper`)."""

    def __init__(self, protocol: DHTProtocol, conduct: PeerConduct):
        self.protocol = protocol
        self.conduct = conduct
        self.refused = 0

    @classmethod
    async def install(cls, protocol: DHTProtocol, p2p: P2P, conduct: PeerConduct | None = None) -> DHTRequestGuard:
        """Replace the protocol's handlers on `p2p` by guarded ones."""
        guard = cls(protocol, conduct or dht_conduct())
        await protocol.remove_p2p_handlers(p2p)
        await protocol.add_p2p_handlers(p2p, wrapper=guard)
        return guard

    def _admit(self, request: Any, context: P2PContext) -> str:
        peer_id = context.remote_id.to_base58()
        size = request.ByteSize()  # the protobuf is parsed already; its values are not decoded yet
        cost = max(1.0, size / DHT_COST_UNIT_BYTES)
        reason = self.conduct.admit(peer_id, cost)
        if reason is not None:
            self.refused += 1
            _refusals.warning(
                "dht", peer_id, f"refused a {size}-byte DHT request from {short_peer_id(peer_id)}: {reason}"
            )
            raise DHTRequestRefused(f"DHT request refused: {reason}")
        return peer_id

    async def _guarded(self, handler: Any, request: Any, context: P2PContext) -> Any:
        peer_id = self._admit(request, context)
        try:
            return await handler(request, context)
        finally:
            self.conduct.release(peer_id)

    async def rpc_ping(self, request: Any, context: P2PContext) -> Any:
        return await self._guarded(self.protocol.rpc_ping, request, context)

    async def rpc_store(self, request: Any, context: P2PContext) -> Any:
        return await self._guarded(self.protocol.rpc_store, request, context)

    async def rpc_find(self, request: Any, context: P2PContext) -> Any:
        return await self._guarded(self.protocol.rpc_find, request, context)

"""The "data" service: peers holding the swarm's prepared data serve its manifest and shards.

Who serves: the founder started with `--data DIR`, a stage-0 peer whose `--data DIR` has the
manifest the swarm records, and a stage-0 peer that completed a download. One request, one reply
per stream (Transport.serve_requests):

    fetcher -> holder   DATA_REQUEST {manifest: <sha256 hex>}                  the manifest
                        DATA_REQUEST {manifest: <sha256 hex>, shard: <sha256>} one shard
    holder  -> fetcher  DATA_REPLY   + tensor "data" (uint8: the bytes), or ERROR (another
                        manifest, an unknown shard, a file gone bad), or BUSY (MAX_CONCURRENT_READS
                        shards are being read already)

Both sides run a Transport of their own with DATA_LIMITS: a reply larger than the largest shard
or manifest is refused by the protocol decoder before its tensor is allocated. Nothing is trusted
from a holder: the fetcher checks the manifest against the swarm config's data.manifest_hash and
every shard against the manifest (node/server/data_fetch.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dht.records import short_peer_id
from dht.registry import swarm_key_of
from node.model.shards import (
    DEFAULT_SHARD_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_SHARD_BYTES,
    Manifest,
    Shard,
    ShardError,
    build_manifest,
    is_hash_hex,
    read_shard,
)
from node.p2p.network import Network
from node.p2p.peer_conduct import PeerConduct
from node.p2p.request_contract import RequestContract
from node.p2p.transport import Transport, TransportError
from node.runtime.meter import Meter
from protocol import Limits, Message, MessageKind, ProtocolError

logger = logging.getLogger(__name__)

SERVICE = "data"
MAX_CONCURRENT_READS = 4  # shards read and held for replies at once: 4 x 16 MiB at most
REQUEST_TIMEOUT = 60.0  # one shard of 4 MiB at 1 Mbit/s takes ~35 s
MiB = 1 << 20
# a data transport's messages: one shard or one manifest, and a little envelope
DATA_LIMITS = Limits(
    max_frame_bytes=max(MAX_SHARD_BYTES, MAX_MANIFEST_BYTES) + MiB,
    max_tensor_bytes=max(MAX_SHARD_BYTES, MAX_MANIFEST_BYTES),
    max_tensors=1,
)


@dataclass(frozen=True)
class HashHex:
    """A sha256 in lowercase hex, as manifests and shards are named."""

    def problem(self, value: Any) -> str | None:
        return None if is_hash_hex(value) else "64 lowercase hex digits (a sha256)"


CONTRACT = RequestContract(
    kinds=frozenset({MessageKind.DATA_REQUEST}), required={"manifest": HashHex()}, optional={"shard": HashHex()}
)


class HolderBusy(TransportError):
    """The holder is reading shards for others already: ask another one, or later."""


@dataclass
class DataStore:
    """A prepared directory and its manifest, as served."""

    directory: Path
    manifest: Manifest
    encoded: bytes = field(init=False)
    _by_digest: dict[str, Shard] = field(init=False)

    def __post_init__(self) -> None:
        self.encoded = self.manifest.encode()
        self._by_digest = self.manifest.by_digest()

    @property
    def hash(self) -> str:
        return self.manifest.hash

    def shard(self, digest: str) -> Shard | None:
        return self._by_digest.get(digest)


def local_store(directory: str | Path, expected_hash: str) -> DataStore | None:
    """`--data DIR` as a store to serve, when its manifest (cut in DEFAULT_SHARD_BYTES pieces, as
    the founder cuts by default) is the swarm's; None otherwise. Reads every byte: run it in a thread."""
    manifest = build_manifest(directory, DEFAULT_SHARD_BYTES)
    return DataStore(Path(directory), manifest) if manifest.hash == expected_hash else None


def data_transport(network: Network, swarm_id: str, stage: int, meter: Meter | None = None) -> Transport:
    """A transport for the data service alone: its DATA_LIMITS bound every reply it reads."""
    return Transport(
        network.p2p,
        swarm_id,
        stage,
        limits=DATA_LIMITS,
        conduct=PeerConduct(bans=network.bans),
        swarm_key=swarm_key_of(network.dht),
        meter=meter,
    )


def _bytes_message(transport: Transport, data: bytes, request_id: int) -> Message:
    # host: file bytes for the wire, never on a device
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return transport.message(MessageKind.DATA_REPLY, tensors={"data": tensor}, request_id=request_id)


async def serve_data(transport: Transport, store: DataStore) -> None:
    """Register the data service: the manifest and shards of `store` to any peer of the swarm."""
    reads = asyncio.Semaphore(MAX_CONCURRENT_READS)

    async def answer(sender: str, request: Message) -> Message:
        rid = request.request_id
        if request.meta["manifest"] != store.hash:
            return transport.error(
                f"this peer serves manifest {store.hash[:16]}, not {request.meta['manifest'][:16]}", rid
            )
        digest = request.meta.get("shard")
        if digest is None:
            return _bytes_message(transport, store.encoded, rid)
        shard = store.shard(digest)  # type: ignore[arg-type]
        if shard is None:
            return transport.error(f"no shard {digest[:16]} in manifest {store.hash[:16]}", rid)  # type: ignore[index]
        if reads.locked():
            return transport.message(MessageKind.BUSY, request_id=rid)
        async with reads:
            try:
                data = await asyncio.to_thread(read_shard, store.directory, shard)
            except (OSError, ShardError) as e:  # a file changed under us: say so, serve nothing wrong
                logger.warning(f"cannot serve shard {shard.name} to {short_peer_id(sender)}: {e}")
                return transport.error(f"shard {shard.name} is unavailable here", rid)
            return _bytes_message(transport, data, rid)

    await transport.serve_requests(SERVICE, answer, CONTRACT, read_timeout=10.0)
    logger.info(
        f"serving the swarm's data: manifest {store.hash[:16]}, {len(store.manifest.shards)} shards, "
        f"{store.manifest.total_bytes:,} bytes"
    )


class WireShards:
    """What a fetcher asks holders, over a data transport (node/server/data_fetch.py, ShardSource)."""

    def __init__(self, transport: Transport, manifest_hash: str, timeout: float = REQUEST_TIMEOUT) -> None:
        self.transport, self.manifest_hash, self.timeout = transport, manifest_hash, timeout

    async def _ask(self, peer_id: str, meta: dict[str, Any], max_bytes: int) -> bytes:
        request = self.transport.message(MessageKind.DATA_REQUEST, {"manifest": self.manifest_hash, **meta})
        reply = await self.transport.request(peer_id, SERVICE, request, self.timeout)
        if reply.kind == MessageKind.BUSY:
            raise HolderBusy(f"{short_peer_id(peer_id)} is busy")
        data = reply.tensors.get("data")
        if reply.kind != MessageKind.DATA_REPLY or data is None or data.dtype != torch.uint8 or data.dim() != 1:
            raise ProtocolError(f"{short_peer_id(peer_id)} answered a data request with {reply.kind.value}")
        if data.numel() > max_bytes:
            raise ProtocolError(f"{short_peer_id(peer_id)} sent {data.numel()} bytes, at most {max_bytes} expected")
        return data.numpy().tobytes()

    async def manifest(self, peer_id: str) -> bytes:
        return await self._ask(peer_id, {}, MAX_MANIFEST_BYTES)

    async def shard(self, peer_id: str, shard: Shard) -> bytes:
        return await self._ask(peer_id, {"shard": shard.digest}, shard.size)

"""The gossip session's messages, shared by the NoLoCo pairwise round and the DiLoCo group round.

One libp2p stream (service "gossip") per exchange; docs/gossip.md ("A round on the wire") lists
the steps. Tensors travel as GOSSIP_CHUNKs through node/p2p/tensor_stream.py: each tensor is
flattened and cut into CHUNK_ELEMENTS fp32 elements, `index` = the tensor's place (phi tensors,
then Delta tensors, in `module.parameters()` order), `offset` = the element offset in it. The
receiver knows every shape from its own module (same stage, same shapes).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

import torch
from torch import Tensor

from node.averaging.outer_replica import OuterReplica
from node.config import GossipConfig, GossipMode
from node.p2p.tensor_stream import ChunkIndex, Session, TensorStream
from node.p2p.transport import Transport
from protocol import Compression, Message, MessageKind

__all__ = ["CHUNK_ELEMENTS", "GOSSIP_CHUNKS", "GOSSIP_COMPRESSION", "GOSSIP_SERVICE", "GossipWire"]

GOSSIP_SERVICE = "gossip"
CHUNK_ELEMENTS = 1 << 20  # 4 MiB of fp32 per GOSSIP_CHUNK
GOSSIP_CHUNKS = TensorStream(MessageKind.GOSSIP_CHUNK, CHUNK_ELEMENTS, ChunkIndex.TENSOR)
# phi travels uncompressed: replicas' phi differ by far less than fp16's relative 5e-4 rounding,
# so a compressed phi would swamp the very differences the pull term averages away
GOSSIP_COMPRESSION = Compression.NONE


class GossipWire:
    """Builds, checks, sends and receives the gossip messages of one replica."""

    def __init__(self, transport: Transport, settings: GossipConfig, replica: OuterReplica):
        self.transport = transport
        self.settings = settings
        self.replica = replica

    def session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Session:
        """A session on a stream; no per-message timeout: every round is bounded as a whole."""
        return Session(self.transport, reader, writer, compression=GOSSIP_COMPRESSION)

    @contextlib.asynccontextmanager
    async def open(self, peer: str) -> AsyncIterator[Session]:
        """A new gossip session with `peer` (TransportError if it cannot be opened)."""
        async with self.transport.session(peer, GOSSIP_SERVICE, self.settings.round_timeout) as (reader, writer):
            yield self.session(reader, writer)

    # ---- messages ------------------------------------------------------------------------------

    def request_meta(self, round_: int, steps: int = 0) -> dict:
        """`steps`: the inner steps the sender's Delta covers (lets the partner judge ripeness)."""
        return {"round": round_, "num_tensors": len(self.replica.params), "total_numel": self.replica.total_numel,
                "mode": str(self.settings.mode), "steps": steps}

    def request(self, round_: int, steps: int = 0) -> Message:
        return self.transport.message(MessageKind.GOSSIP_REQUEST, self.request_meta(round_, steps))

    def refusal(self, request: Message, stage: int, sender_banned: bool) -> str | None:
        """Why a replica of `stage` refuses a request outright (None: it may serve it)."""
        if request.kind != MessageKind.GOSSIP_REQUEST:
            return f"expected gossip_request, got {request.kind.value}"
        if self.settings.mode == GossipMode.NONE:
            return "gossip is disabled on this peer"
        if request.sender_stage != stage:
            return f"this peer serves stage {stage}, not {request.sender_stage}"
        if sender_banned:
            return "banned"
        mine = self.request_meta(0)
        for key in ("num_tensors", "total_numel", "mode"):
            if request.meta.get(key) != mine[key]:
                return f"{key} {request.meta.get(key)!r} != {mine[key]!r}"
        return None

    def accept(self, round_: int) -> Message:
        return self.transport.message(MessageKind.GOSSIP_ACCEPT, {"round": round_})

    def done(self, round_: int, reason: str | None) -> Message:
        """The DONE of the pairwise handshake: whether this side accepts the partner's tensors."""
        meta = {"round": round_, "accept": reason is None, "reason": (reason or "")[:500]}
        return self.transport.message(MessageKind.GOSSIP_DONE, meta)

    # ---- tensors -------------------------------------------------------------------------------

    async def send_tensors(self, session: Session, round_: int, tensors: Sequence[Tensor]) -> None:
        await GOSSIP_CHUNKS.send(session, tensors, {"round": round_})

    async def recv_tensors(self, session: Session, count: int) -> list[Tensor]:
        """`count` fp32 tensors shaped like my parameters (phi..., then Delta...), in order."""
        shapes = self.replica.shapes * (count // len(self.replica.params))
        buffers = [torch.empty(shape, dtype=torch.float32) for shape in shapes]
        await GOSSIP_CHUNKS.receive(session, buffers)
        return buffers

    async def swap(self, session: Session, round_: int, tensors: Sequence[Tensor]) -> list[Tensor]:
        """Send `tensors` while receiving as many of the partner's (both directions at once)."""
        sending = asyncio.create_task(self.send_tensors(session, round_, tensors))
        receiving = asyncio.create_task(self.recv_tensors(session, len(tensors)))
        try:
            done, _ = await asyncio.wait({sending, receiving}, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            await sending
            return await receiving
        finally:
            for task in (sending, receiving):
                task.cancel()
            await asyncio.gather(sending, receiving, return_exceptions=True)

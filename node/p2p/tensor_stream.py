"""Tensors too large for one message, sent over a session as a sequence of chunk messages.

Gossip (GOSSIP_CHUNK: phi and Delta, fp32) and state transfer (STATE_CHUNK: one uint8 payload)
both move tensors this way; they differ only in the message kind, the chunk size and what a
chunk's `index` counts (`ChunkIndex`). The receiver allocates its buffers from what it already
knows (its own parameter shapes, or a checked STATE_HEADER) and checks every chunk's place, dtype
and size before copying it, so a peer can never make it allocate or write more than that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from torch import Tensor

from node.p2p.transport import Transport, TransportError
from node.runtime.timeouts import within
from protocol import (
    FRAME_HEADER_BYTES,
    Compression,
    Message,
    MessageKind,
    MetaValue,
    ProtocolError,
    recv_message,
    seal_message,
    write_frame,
)

__all__ = ["ChunkIndex", "Session", "TensorStream"]


class Session:
    """One open stream to a peer (from `Transport.session` or a session handler): protocol
    messages both ways, each bounded by `timeout` seconds (None: the caller bounds the whole
    exchange instead)."""

    def __init__(
        self,
        transport: Transport,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        timeout: float | None = None,
        compression: Compression = Compression.NONE,
    ):
        self.transport = transport
        self.reader = reader
        self.writer = writer
        self.timeout = timeout
        self.compression = compression
        self.sent_bytes = 0  # framed bytes this side has written: what a round reports it moved

    async def send(self, message: Message) -> None:
        limits = self.transport.limits
        payload = seal_message(message, self.compression, limits, self.transport.swarm_key)
        self.sent_bytes += FRAME_HEADER_BYTES + len(payload)
        await within(write_frame(self.writer, payload, limits), self.timeout)

    async def recv(self) -> Message:
        return await within(
            recv_message(self.reader, self.transport.limits, self.transport.swarm_id, self.transport.swarm_key),
            self.timeout,
        )

    async def expect(self, kind: MessageKind) -> Message:
        """The next message, which must be of `kind`; an ERROR is the peer giving up (TransportError)."""
        message = await self.recv()
        if message.kind == MessageKind.ERROR:
            raise TransportError(f"partner aborted: {message.meta.get('reason')}")
        if message.kind != kind:
            raise ProtocolError(f"expected {kind.value}, got {message.kind.value}")
        return message


class ChunkIndex(StrEnum):
    """What a chunk's `index` meta counts (its `offset` is always the element offset in its tensor)."""

    TENSOR = "tensor"  # the tensor it belongs to (gossip: phi tensors, then Delta tensors)
    RUNNING = "running"  # the chunk's own number in the stream (state transfer: one payload tensor)


@dataclass(frozen=True)
class TensorStream:
    """One chunked format: message `kind`, `chunk_elements` per chunk (a tensor's last chunk is
    shorter), and what `index` counts. Every chunk carries one 1-D tensor named "chunk"."""

    kind: MessageKind
    chunk_elements: int
    index: ChunkIndex

    def _layout(self, sizes: Sequence[int]) -> Iterator[tuple[int, int, int, int]]:
        """(tensor number, chunk index, offset, length) of every chunk, in sending order."""
        running = 0
        for number, size in enumerate(sizes):
            for offset in range(0, size, self.chunk_elements):
                index = number if self.index == ChunkIndex.TENSOR else running
                yield number, index, offset, min(self.chunk_elements, size - offset)
                running += 1

    async def send(
        self,
        session: Session,
        tensors: Sequence[Tensor],
        meta: Mapping[str, MetaValue] | None = None,
        request_id: int | None = None,
    ) -> None:
        """Send `tensors` (flattened, in order) as chunks; `meta` is added to every chunk's meta."""
        flats = [t.detach().reshape(-1) for t in tensors]
        for number, index, offset, length in self._layout([flat.numel() for flat in flats]):
            chunk_meta = {**(meta or {}), "index": index, "offset": offset}
            chunk = flats[number][offset : offset + length]
            await session.send(session.transport.message(self.kind, chunk_meta, {"chunk": chunk}, request_id))

    async def receive(
        self,
        session: Session,
        buffers: Sequence[Tensor],
        on_chunk: Callable[[Tensor], Awaitable[None]] | None = None,
    ) -> None:
        """Fill the contiguous `buffers` (in order) from the chunks `send` makes of tensors of
        the same sizes and dtypes; `on_chunk` sees each checked chunk (e.g. to hash it)."""
        flats = [buffer.view(-1) for buffer in buffers]
        for number, index, offset, length in self._layout([flat.numel() for flat in flats]):
            message = await session.expect(self.kind)
            chunk = message.tensors["chunk"]
            got_index, got_offset = message.meta["index"], message.meta["offset"]
            if got_index != index or got_offset != offset:
                raise ProtocolError(
                    f"{self.kind.value} {got_index} at offset {got_offset}, expected {index} at {offset}"
                )
            target = flats[number]
            if chunk.dtype != target.dtype or chunk.dim() != 1 or chunk.numel() != length:
                raise ProtocolError(
                    f"chunk {index} has {chunk.numel()} {chunk.dtype} elements "
                    f"({chunk.dim()}-D) at offset {offset}, expected {length} {target.dtype}"
                )
            target[offset : offset + length].copy_(chunk)
            if on_chunk is not None:
                await on_chunk(chunk)

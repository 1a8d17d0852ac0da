"""Length-prefixed frames on asyncio streams (what hivemind's binary stream handlers hand us).

A frame is an 8-byte big-endian unsigned payload length, then the payload. Timeouts are the
caller's business (wrap in asyncio.wait_for): this layer only guarantees it never reads or
buffers more than limits.max_frame_bytes for one frame.
"""

from __future__ import annotations

import asyncio
import struct

from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import Message, decode_message, encode_message

_HEADER = struct.Struct(">Q")
HEADER_BYTES = _HEADER.size


async def read_frame(reader: asyncio.StreamReader, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Read one frame's payload.

    Raises EOFError if the stream ends cleanly before the first header byte (the peer is done),
    and ProtocolError if it ends anywhere inside a frame or the declared length is over the limit;
    the length is checked before any payload is read, so an oversized frame costs nothing.
    """
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise EOFError("stream closed at a frame boundary") from None
        raise ProtocolError("stream closed mid-frame (inside the length header)") from None
    (length,) = _HEADER.unpack(header)
    if length > limits.max_frame_bytes:
        raise ProtocolError(f"frame declares {length} bytes > max_frame_bytes {limits.max_frame_bytes}")
    try:
        # readexactly grows its buffer only as bytes arrive: a peer that declares a big frame and
        # stalls does not make us allocate the declared size up front
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise ProtocolError(f"stream closed mid-frame ({len(e.partial)} of {length} bytes)") from None


async def write_frame(
    writer: asyncio.StreamWriter, payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
) -> None:
    """Write one frame and wait for the transport to drain; refuses frames the peer would reject."""
    size = memoryview(payload).nbytes
    if size > limits.max_frame_bytes:
        raise ProtocolError(f"frame of {size} bytes > max_frame_bytes {limits.max_frame_bytes}")
    # two writes instead of header + payload: no copy of a possibly large payload
    writer.write(_HEADER.pack(size))
    writer.write(payload)
    await writer.drain()


async def send_message(
    writer: asyncio.StreamWriter, msg: Message, compression: str = "none", limits: Limits = DEFAULT_LIMITS
) -> None:
    await write_frame(writer, encode_message(msg, compression, limits=limits), limits)


async def recv_message(
    reader: asyncio.StreamReader, limits: Limits = DEFAULT_LIMITS, expected_swarm: str | None = None
) -> Message:
    """Read and decode one message; EOFError at a clean end of stream, ProtocolError otherwise."""
    return decode_message(await read_frame(reader, limits), limits, expected_swarm)

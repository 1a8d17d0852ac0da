"""Length-prefixed frames on asyncio streams (what hivemind's binary stream handlers hand us).

A frame is an 8-byte big-endian unsigned payload length, then the payload. Timeouts are the
caller's business (wrap in asyncio.wait_for): this layer only guarantees it never reads or
buffers more than limits.max_frame_bytes for one frame.

In a private swarm every message carries a MAC: the frame's payload is the encoded message followed
by HMAC-SHA256(swarm key, encoded message), 32 bytes. A frame whose MAC does not verify is refused
before it is decoded, so a peer without the key cannot make a member parse anything it sends.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct

from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import Message, decode_message, encode_message

_HEADER = struct.Struct(">Q")
FRAME_HEADER_BYTES = _HEADER.size
MAC_BYTES = hashlib.sha256().digest_size


async def read_frame(reader: asyncio.StreamReader, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """Read one frame's payload.

    Raises EOFError if the stream ends cleanly before the first header byte (the peer is done),
    and ProtocolError if it ends anywhere inside a frame or the declared length is over the limit;
    the length is checked before any payload is read, so an oversized frame costs nothing.
    """
    try:
        header = await reader.readexactly(FRAME_HEADER_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise EOFError("stream closed at a frame boundary") from None
        raise ProtocolError("stream closed mid-frame (inside the length header)") from None
    length = frame_length(header, 0, limits)
    try:
        # readexactly grows its buffer only as bytes arrive: a peer that declares a big frame and
        # stalls does not make us allocate the declared size up front
        return await reader.readexactly(length)
    except asyncio.IncompleteReadError as e:
        raise ProtocolError(f"stream closed mid-frame ({len(e.partial)} of {length} bytes)") from None


def frame_header(payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The length header of a frame carrying `payload`; refuses frames the peer would reject."""
    size = memoryview(payload).nbytes
    if size > limits.max_frame_bytes:
        raise ProtocolError(f"frame of {size} bytes > max_frame_bytes {limits.max_frame_bytes}")
    return _HEADER.pack(size)


def frame_length(header: bytes | bytearray | memoryview, offset: int = 0, limits: Limits = DEFAULT_LIMITS) -> int:
    """The payload length the frame header at `offset` declares; ProtocolError over the limit (checked
    before anything of the payload is kept)."""
    (length,) = _HEADER.unpack_from(header, offset)
    if length > limits.max_frame_bytes:
        raise ProtocolError(f"frame declares {length} bytes > max_frame_bytes {limits.max_frame_bytes}")
    return length


class FrameSplitter:
    """Frames out of byte chunks that cut them anywhere (the plaintext of a direct link's records,
    node/p2p/sealed_link.py): `load` a chunk once the previous one is used up, then take frames with
    `next_frame` until it returns None. A frame whole inside a chunk is returned as a view of it
    (no copy); one spanning chunks is gathered as its bytes arrive (never allocated at its declared
    size up front), and its declared length is checked against the limit as soon as its header is in."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS):
        self.limits = limits
        self._chunk = memoryview(b"")
        self._at = 0
        self._partial = bytearray()  # a frame begun in an earlier chunk, header included
        self._partial_wants = -1  # its size, header included, once the header is in

    def load(self, chunk: bytes) -> None:
        assert self.used_up(), "load before the previous chunk is used up"
        self._chunk, self._at = memoryview(chunk), 0

    def used_up(self) -> bool:
        """Whether every byte of the loaded chunk was taken (the next chunk may be loaded)."""
        return self._at >= len(self._chunk)

    def has_partial_frame(self) -> bool:
        """Whether part of a frame waits for the next chunk (an end here would cut it)."""
        return bool(self._partial)

    def next_frame(self) -> bytes | memoryview | None:
        """The next whole frame's payload, or None when the loaded chunk is used up."""
        chunk, end = self._chunk, len(self._chunk)
        while self._at < end:
            at = self._at
            if not self._partial and end - at >= FRAME_HEADER_BYTES:
                wants = FRAME_HEADER_BYTES + frame_length(chunk, at, self.limits)
                if at + wants <= end:  # whole in this chunk
                    self._at = at + wants
                    return chunk[at + FRAME_HEADER_BYTES : at + wants]
                self._partial_wants = wants
            frame = self._gather(chunk, at)
            if frame is not None:
                return frame
        return None

    def _gather(self, chunk: memoryview, at: int) -> bytes | None:
        partial = self._partial
        if self._partial_wants < 0:
            take = min(FRAME_HEADER_BYTES - len(partial), len(chunk) - at)
            partial += chunk[at : at + take]
            at += take
            if len(partial) < FRAME_HEADER_BYTES:
                self._at = at
                return None
            self._partial_wants = FRAME_HEADER_BYTES + frame_length(partial, 0, self.limits)
        take = min(self._partial_wants - len(partial), len(chunk) - at)
        partial += chunk[at : at + take]
        self._at = at + take
        if len(partial) < self._partial_wants:
            return None
        payload = bytes(memoryview(partial)[FRAME_HEADER_BYTES:])
        self._partial, self._partial_wants = bytearray(), -1
        return payload


def write_frame_now(
    writer: asyncio.StreamWriter, payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
) -> None:
    """Write one frame without waiting for the transport to drain."""
    header = frame_header(payload, limits)
    # two writes instead of header + payload: no copy of a possibly large payload
    writer.write(header)
    writer.write(payload)


async def write_frame(
    writer: asyncio.StreamWriter, payload: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
) -> None:
    """Write one frame and wait for the transport to drain; refuses frames the peer would reject."""
    write_frame_now(writer, payload, limits)
    await writer.drain()


def message_mac(swarm_key: bytes, encoded: bytes | memoryview) -> bytes:
    """The MAC a private swarm appends to every encoded message."""
    return hmac.new(swarm_key, encoded, hashlib.sha256).digest()


def verify_mac(swarm_key: bytes, payload: bytes) -> memoryview:
    """The encoded message inside a private swarm's frame, if its MAC verifies; ProtocolError otherwise."""
    if len(payload) < MAC_BYTES:
        raise ProtocolError("frame too short to carry a MAC: the sender has no swarm key")
    body = memoryview(payload)[:-MAC_BYTES]
    if not hmac.compare_digest(message_mac(swarm_key, body), payload[-MAC_BYTES:]):
        raise ProtocolError("message authentication failed: the sender has a different or no swarm key")
    return body


def seal_message(
    msg: Message, compression: str = "none", limits: Limits = DEFAULT_LIMITS, swarm_key: bytes | None = None
) -> bytes:
    """One message as the payload of a frame or of a unary call: encoded, plus its MAC in a private swarm."""
    encoded = encode_message(msg, compression, limits=limits)
    return encoded if swarm_key is None else encoded + message_mac(swarm_key, encoded)


def open_message(
    payload: bytes,
    limits: Limits = DEFAULT_LIMITS,
    expected_swarm: str | None = None,
    swarm_key: bytes | None = None,
) -> Message:
    """The message in a payload `seal_message` made: the size is checked first, then the MAC (in a
    private swarm, before anything is decoded), then everything `decode_message` checks."""
    if len(payload) > limits.max_frame_bytes:
        raise ProtocolError(f"message of {len(payload)} bytes > max_frame_bytes {limits.max_frame_bytes}")
    body = memoryview(payload) if swarm_key is None else verify_mac(swarm_key, payload)
    # no copy of the body: decode_message copies what it keeps out of a read-only buffer
    return decode_message(body, limits, expected_swarm)


async def send_message(
    writer: asyncio.StreamWriter,
    msg: Message,
    compression: str = "none",
    limits: Limits = DEFAULT_LIMITS,
    swarm_key: bytes | None = None,
) -> None:
    await write_frame(writer, seal_message(msg, compression, limits, swarm_key), limits)


async def recv_message(
    reader: asyncio.StreamReader,
    limits: Limits = DEFAULT_LIMITS,
    expected_swarm: str | None = None,
    swarm_key: bytes | None = None,
) -> Message:
    """Read and decode one message; EOFError at a clean end of stream, ProtocolError otherwise
    (including a MAC that does not verify under `swarm_key`)."""
    return open_message(await read_frame(reader, limits), limits, expected_swarm, swarm_key)

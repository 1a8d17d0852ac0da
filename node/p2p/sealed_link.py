"""The record layer of a direct link (node/p2p/direct.py): after the handshake, a TCP connection
carries records sealed with AES-256-GCM, each a 4-byte length and the sealed bytes, with one counter
nonce per direction; a `SecureStream` reads and writes them as a stream reader and writer would, so
the channel protocol (node/p2p/channels.py) runs on it unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAX_RECORD_BYTES = 1 << 20  # plaintext per sealed record: a frame spans as many records as it needs
MAX_RECORDS = 1 << 40  # per direction and connection: far below where a GCM counter nonce could repeat

_TAG_BYTES = 16
_LENGTH = struct.Struct(">I")


class DirectLinkError(ConnectionError):
    """A direct link could not be set up, or a record on it did not authenticate (the link is dropped;
    nobody is struck: a network in between could be the cause)."""


# -- the connection -------------------------------------------------------------------------------


# a read missing at least this many bytes asks the kernel to wake the loop only once they are in
LOW_WATER_FROM = 8 * 1024


class _RecordReader(asyncio.StreamReader):
    """A StreamReader that wakes for a record only once the record is in, or nearly.

    Across a wide-area link a 64 KiB record arrives as dozens of TCP segments (TCP's window is
    small after an idle moment, and at 50 Mbit/s a segment lands every quarter millisecond). The
    stock reader resumes the waiting task for each batch of them (a task step of Python), only for
    it to wait again: this one resumes it once every byte awaited is in. And before waiting for a
    record body it sets the socket's SO_RCVLOWAT to the bytes still missing, so the event loop is
    not woken (epoll, a read, feed_data) for each batch either. Measured between two namespaces over
    a 50 Mbit/s, 100 ms RTT link (docs/benchmarks.md, issue 16): 9.3 reads and 0.41-0.47 ms of the
    receiver's CPU per 64 KiB record without it, 1.1 and 0.26-0.33 ms with it, at the same 77-78
    records/s; on loopback a record arrives in one read either way.
    The mark is capped at a quarter of the socket's receive buffer: Linux clamps the receive
    window to a mark that needs a bigger buffer, and a 64 KiB window over 100 ms carried 7.6
    records/s. Relies on StreamReader's `_wakeup_waiter`, `_buffer`, `_eof` and `_transport`
    (CPython 3.8-3.13).
    """

    _wanted = 0
    _low_water = 1  # the socket's SO_RCVLOWAT as this reader last set it
    _sock: socket.socket | None = None
    _low_water_works = True

    async def readexactly(self, n: int) -> bytes:
        self._wanted = n
        self._track_missing(n - len(self._buffer), may_raise=True)
        try:
            return await super().readexactly(n)
        finally:
            self._wanted = 0
            self._track_missing(0)

    def feed_data(self, data: bytes) -> None:
        super().feed_data(data)
        if self._low_water > 1:  # never above what is still missing, or the kernel would never wake us
            self._track_missing(self._wanted - len(self._buffer))

    def _wakeup_waiter(self) -> None:
        if self._eof or len(self._buffer) >= self._wanted:
            super()._wakeup_waiter()

    def _track_missing(self, missing: int, may_raise: bool = False) -> None:
        """Keep SO_RCVLOWAT at the bytes still `missing` (at most a quarter of the receive buffer; 1
        when fewer than LOW_WATER_FROM are): raised only before a read (`may_raise`), lowered
        whenever fewer are missing than the mark."""
        if not self._low_water_works or self._transport is None:
            return
        wanted = 1 if missing < LOW_WATER_FROM else missing
        if wanted == self._low_water or (wanted > self._low_water and not may_raise):
            return
        try:
            if self._sock is None:
                self._sock = self._transport.get_extra_info("socket")
            if wanted > 1:
                wanted = min(wanted, self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
        except (OSError, AttributeError):  # closed meanwhile, or not a socket with a low-water mark
            self._low_water_works = False
            return
        self._low_water = wanted


def _record_protocol(
    loop: asyncio.AbstractEventLoop, on_connection: Callable[..., Awaitable[None]] | None = None
) -> tuple[_RecordReader, asyncio.StreamReaderProtocol]:
    # limit: the reader pauses the socket past twice this, well above one record (<= MAX_RECORD_BYTES + tag)
    reader = _RecordReader(limit=MAX_RECORD_BYTES, loop=loop)
    return reader, asyncio.StreamReaderProtocol(reader, on_connection, loop=loop)


async def connect(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """asyncio.open_connection, with a record reader."""
    loop = asyncio.get_running_loop()
    reader, protocol = _record_protocol(loop)
    transport, _ = await loop.create_connection(lambda: protocol, host, port)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


async def listen(
    on_connection: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]], host: str, port: int
) -> asyncio.Server:
    """asyncio.start_server, with record readers."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _record_protocol(loop, on_connection)[1], host, port)


# -- the sealed record layer ---------------------------------------------------------------------


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(12, "big")


class SecureStream:
    """Both ends of one direct link, as a stream reader and writer: plaintext written between two
    `drain()`s is sealed into records (each <= MAX_RECORD_BYTES) at the `drain()`, so a frame's
    header and payload travel as one record; `readexactly` opens records as it needs them."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, send_key: bytes, receive_key: bytes):
        self._reader, self._writer = reader, writer
        self._seal, self._open = AESGCM(send_key), AESGCM(receive_key)
        self._sent = self._received = 0
        self._pending: list[Any] = []
        self._plain, self._at = b"", 0  # the record being read, and how much of it was read

    # writer side
    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._pending.append(data)

    async def drain(self) -> None:
        self._flush()
        await self._writer.drain()

    def _flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        view = memoryview(data).cast("B")
        for start in range(0, len(view), MAX_RECORD_BYTES):
            if self._sent >= MAX_RECORDS:
                raise DirectLinkError("direct link used up its nonces: open a new one")
            sealed = self._seal.encrypt(_nonce(self._sent), view[start : start + MAX_RECORD_BYTES], None)
            self._sent += 1
            self._writer.writelines((_LENGTH.pack(len(sealed)), sealed))  # one send, no copy

    def close(self) -> None:
        with contextlib.suppress(Exception):  # what was written and not drained still goes out
            self._flush()
        self._writer.close()

    def is_closing(self) -> bool:
        return self._writer.is_closing()

    async def wait_closed(self) -> None:
        await self._writer.wait_closed()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._writer.get_extra_info(name, default)

    # reader side
    async def readexactly(self, n: int) -> bytes:
        # the record being read is kept whole with a read position: a frame's header and payload
        # usually share one record, so the payload costs one slice (a copy) and nothing else
        start = self._at
        if len(self._plain) - start >= n:
            self._at = start + n
            return self._plain if start == 0 and n == len(self._plain) else self._plain[start : start + n]
        parts = [memoryview(self._plain)[start:]]
        got = len(parts[0])
        while True:
            try:
                plain = await self._next_record()
            except asyncio.IncompleteReadError:
                raise asyncio.IncompleteReadError(b"".join(parts), n) from None
            need = n - got
            if len(plain) >= need:
                parts.append(memoryview(plain)[:need])
                self._plain, self._at = plain, need
                return b"".join(parts)
            parts.append(plain)
            got += len(plain)

    async def _next_record(self) -> bytes:
        """The next record's plaintext; IncompleteReadError at a clean end between records."""
        try:
            header = await self._reader.readexactly(_LENGTH.size)
        except asyncio.IncompleteReadError as e:
            if e.partial:  # the connection broke inside a record header
                raise ConnectionResetError("direct link closed inside a record") from None
            raise
        (length,) = _LENGTH.unpack(header)
        if not _TAG_BYTES < length <= MAX_RECORD_BYTES + _TAG_BYTES:
            raise DirectLinkError(f"direct link record of {length} bytes")
        try:
            sealed = await self._reader.readexactly(length)
        except asyncio.IncompleteReadError:
            raise ConnectionResetError("direct link closed inside a record") from None
        if self._received >= MAX_RECORDS:
            raise DirectLinkError("direct link used up its nonces")
        try:
            plain = self._open.decrypt(_nonce(self._received), sealed, None)
        except InvalidTag:
            raise DirectLinkError("a record on the direct link does not authenticate") from None
        self._received += 1
        return plain

    def at_eof(self) -> bool:
        return self._at == len(self._plain) and self._reader.at_eof()

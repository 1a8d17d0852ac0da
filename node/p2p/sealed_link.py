"""The connection of a direct link (node/p2p/direct.py): two handshake messages in the clear, then
records sealed with AES-256-GCM, each a 4-byte length and the sealed bytes, with one counter nonce
per direction. Inside the records run the channel protocol's frames (protocol/framing.py).

`SealedLink` is an `asyncio.Protocol` and a FrameLink (node/p2p/frame_link.py): records are opened
and frames split from them in `data_received`, and each whole frame is handed to the channel at
once. A stream reader in between cost a task wake-up per read and two reads per record and per
frame, on every hop of the pipeline (docs/changes.md, 1193571). A frame's header and payload
are sealed into one record (frames over MAX_RECORD_BYTES span several).

Across a wide-area link a 64 KiB record arrives as dozens of TCP segments (TCP's window is small
after an idle moment, and at 50 Mbit/s a segment lands every quarter millisecond). While a record's
body is incomplete the link sets the socket's SO_RCVLOWAT to the bytes still missing, so the event
loop is not woken (epoll, a read, data_received) for each batch of them. Measured between two
namespaces over a 50 Mbit/s, 100 ms RTT link (docs/changes.md, 279db3f): 9.3 reads and
0.41-0.47 ms of the receiver's CPU per 64 KiB record without it, 1.1 and 0.26-0.33 ms with it, at
the same 77-78 records/s; on loopback a record arrives in one read either way. The mark is capped at
a quarter of the socket's receive buffer: Linux clamps the receive window to a mark that needs a
bigger buffer, and a 64 KiB window over 100 ms carried 7.6 records/s. It never exceeds what is still
missing, or the kernel would never wake the loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from node.p2p.frame_link import OnClosed, OnFrame
from node.runtime.meter import Direction, Meter
from protocol import FRAME_HEADER_BYTES, FrameSplitter, Limits, ProtocolError, frame_header

logger = logging.getLogger(__name__)

MAX_RECORD_BYTES = 1 << 20  # plaintext per sealed record: a frame spans as many records as it needs
MAX_RECORDS = 1 << 40  # per direction and connection: far below where a GCM counter nonce could repeat
# a record body missing at least this many bytes asks the kernel to wake the loop only once they are in
LOW_WATER_FROM = 8 * 1024
# bytes received and not yet handed on past which the socket is not read (the handshake's, or a
# paused link's): about what one read of the event loop takes in, over one record
BUFFER_HIGH_WATER = 2 * (MAX_RECORD_BYTES + 64 * 1024)

_TAG_BYTES = 16
_LENGTH = struct.Struct(">I")


class DirectLinkError(ConnectionError):
    """A direct link could not be set up, or a record on it did not authenticate (the link is dropped;
    nobody is struck: a network in between could be the cause)."""


def _nonce(counter: int) -> bytes:
    return counter.to_bytes(12, "big")


class SealedLink(asyncio.Protocol):
    """One direct link's TCP connection: the handshake's messages (`write_handshake`,
    `read_handshake`), then, once `seal`ed and `start`ed, frames in sealed records both ways."""

    def __init__(self, on_connected: Callable[[SealedLink], None] | None = None) -> None:
        self._on_connected = on_connected  # a listener's: each accepted link starts its handshake
        self._transport: asyncio.Transport | None = None
        self._sock: socket.socket | None = None
        self._received_bytes = bytearray()
        self._lost = False
        self._ended: BaseException | None = None  # why the link ended, once it did
        self._arrived: asyncio.Future | None = None  # the handshake's wait for bytes
        # the sealed record layer
        self._seal: AESGCM | None = None
        self._open: AESGCM | None = None
        self._sent = self._received = 0
        self._frames: FrameSplitter | None = None  # the frames of the records opened, once started
        self._on_frame: OnFrame | None = None
        self._on_closed: OnClosed | None = None
        self._limits: Limits | None = None
        self._meter: tuple[Meter, str] | None = None
        self._paused = False  # by the consumer
        self._socket_paused = False
        self._write_paused = False
        self._drain_waiters: list[asyncio.Future] = []
        self._low_water = 1
        self._low_water_works = True
        self._closing = False  # we closed it: nothing more is handed on
        self._lost_with: tuple[Exception | None] | None = None  # lost while paused: the end, once read on

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._sock = transport.get_extra_info("socket")
        if self._on_connected is not None:
            self._on_connected(self)

    def data_received(self, data: bytes) -> None:
        self._received_bytes += data
        if self._on_frame is not None:
            self._process()
        else:
            if self._arrived is not None and not self._arrived.done():
                self._arrived.set_result(None)
            self._pause_socket_if_full()

    def eof_received(self) -> bool:
        return False  # close: a link is done both ways when either side is

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("direct link closed"))
        self._drain_waiters.clear()
        if self._paused and self._on_closed is not None and self._ended is None:
            # what arrived before the peer closed is still the consumer's (a session's last bytes,
            # sent just before the close): the end comes once it has read on (`_process`)
            self._lost_with = (exc,)
            return
        self._end(exc)

    def _end(self, exc: Exception | None) -> None:
        if self._ended is None:
            if self._received_bytes:
                self._ended = ConnectionResetError("direct link closed inside a record")
            elif self._frames is not None and self._frames.has_partial_frame():
                self._ended = ProtocolError("stream closed mid-frame")
            else:
                self._ended = exc  # None: a clean end between two frames
        if self._on_closed is not None:
            on_closed, self._on_closed = self._on_closed, None
            on_closed(self._ended)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    # -- the handshake -----------------------------------------------------------------------------

    def write_handshake(self, raw: bytes) -> None:
        """One handshake message: a 4-byte length, then `raw`."""
        if self._transport is None or self._transport.is_closing():
            raise DirectLinkError("the connection closed during the handshake")
        self._transport.write(_LENGTH.pack(len(raw)) + raw)

    async def read_handshake(self, max_bytes: int, what: str) -> bytes:
        """The next handshake message (its declared length checked against `max_bytes` first)."""
        buffer = self._received_bytes
        while True:
            if len(buffer) >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(buffer)
                if length > max_bytes:
                    raise DirectLinkError(f"{what} of {length} bytes > {max_bytes}")
                if len(buffer) >= _LENGTH.size + length:
                    raw = bytes(buffer[_LENGTH.size : _LENGTH.size + length])
                    del buffer[: _LENGTH.size + length]
                    self._resume_socket()
                    return raw
            if self._lost:
                raise DirectLinkError(f"the connection closed during the {what}")
            self._arrived = asyncio.get_running_loop().create_future()
            await self._arrived

    def seal(self, send_key: bytes, receive_key: bytes) -> None:
        """Everything from here on travels in records sealed under these keys."""
        self._seal, self._open = AESGCM(send_key), AESGCM(receive_key)

    def count_into(self, meter: Meter, service: str) -> None:
        """Tally every frame's bytes (header and payload, as a stream would) into `meter` under `service`."""
        self._meter = (meter, service)

    # -- FrameLink ---------------------------------------------------------------------------------

    def start(self, on_frame: OnFrame, on_closed: OnClosed, limits: Limits) -> None:
        assert self._open is not None, "start before seal"
        self._on_frame, self._on_closed, self._limits = on_frame, on_closed, limits
        self._frames = FrameSplitter(limits)
        if self._lost:
            self._on_closed = None
            on_closed(self._ended)
            return
        self._process()

    def send_frame(self, payload: bytes | bytearray | memoryview) -> None:
        assert self._seal is not None and self._limits is not None, "send_frame before start"
        header = frame_header(payload, self._limits)
        if self._transport is None or self._transport.is_closing():
            raise ConnectionResetError("direct link closed")
        # the header and the payload in one record (a frame over MAX_RECORD_BYTES takes several)
        data = memoryview(b"".join((header, payload)))
        for start in range(0, len(data), MAX_RECORD_BYTES):
            self._write_record(data[start : start + MAX_RECORD_BYTES])
        if self._meter is not None:
            self._meter[0].traffic(Direction.SENT, self._meter[1], len(data))

    def _write_record(self, plain: bytes | memoryview) -> None:
        if self._sent >= MAX_RECORDS:
            raise DirectLinkError("direct link used up its nonces: open a new one")
        sealed = self._seal.encrypt(_nonce(self._sent), plain, None)  # type: ignore[union-attr]
        self._sent += 1
        self._transport.writelines((_LENGTH.pack(len(sealed)), sealed))  # type: ignore[union-attr]

    async def drain(self) -> None:
        if self._lost:
            raise ConnectionResetError("direct link closed")
        if self._write_paused:
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(waiter)
            await waiter

    def write_backlog(self) -> int:
        return self._transport.get_write_buffer_size() if self._transport is not None else 0

    def pause_reading(self) -> None:
        self._paused = True

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            asyncio.get_running_loop().call_soon(self._process)

    def close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default) if self._transport is not None else default

    # -- handing the connection on (a relay's splice, node/p2p/relay.py) --------------------------

    def transport(self) -> asyncio.Transport:
        assert self._transport is not None, "not connected"
        return self._transport

    def take_received(self) -> bytes:
        """The bytes received and not read by the handshake (they go on with the connection)."""
        data = bytes(self._received_bytes)
        self._received_bytes.clear()
        return data

    # -- records and frames ------------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        """End the link for `error`: the consumer hears it first, while it can still send a last
        frame (a channel server's refusal), then the connection closes."""
        if self._ended is None:
            self._ended = error
        if self._on_closed is not None:
            on_closed, self._on_closed = self._on_closed, None
            on_closed(error)
        self.close()

    def _process(self) -> None:
        """Hand on every whole frame received, opening records as they are needed."""
        try:
            frames, on_frame = self._frames, self._on_frame
            # a connection lost by the peer still hands on what it delivered (not one we closed)
            while not self._paused and self._ended is None and not self._closing:
                frame = frames.next_frame()  # type: ignore[union-attr]
                if frame is not None:
                    if self._meter is not None:
                        self._meter[0].traffic(Direction.RECEIVED, self._meter[1], FRAME_HEADER_BYTES + len(frame))
                    on_frame(frame)  # type: ignore[misc]
                elif not self._open_record():
                    break
        except (DirectLinkError, ProtocolError) as e:
            self._fail(e)
        except Exception as e:  # a bug of the consumer's: only this link ends
            logger.exception("a direct link's frame consumer failed")
            self._fail(e)
        if self._paused:
            self._pause_socket_if_full()
        else:
            self._resume_socket()
            if self._lost_with is not None:
                (exc,), self._lost_with = self._lost_with, None
                self._end(exc)

    def _open_record(self) -> bool:
        """Open the next whole record for the frame splitter; False (and the low-water mark set) if it is not in."""
        buffer = self._received_bytes
        if len(buffer) < _LENGTH.size:
            self._set_low_water(1)
            return False
        (length,) = _LENGTH.unpack_from(buffer)
        if not _TAG_BYTES < length <= MAX_RECORD_BYTES + _TAG_BYTES:
            raise DirectLinkError(f"direct link record of {length} bytes")
        end = _LENGTH.size + length
        if len(buffer) < end:
            missing = end - len(buffer)
            self._set_low_water(missing if missing >= LOW_WATER_FROM else 1)
            return False
        if self._received >= MAX_RECORDS:
            raise DirectLinkError("direct link used up its nonces")
        with memoryview(buffer) as view:
            try:
                plain = self._open.decrypt(_nonce(self._received), view[_LENGTH.size : end], None)  # type: ignore[union-attr]
            except InvalidTag:
                raise DirectLinkError("a record on the direct link does not authenticate") from None
        del buffer[:end]
        self._received += 1
        self._frames.load(plain)  # type: ignore[union-attr]
        self._set_low_water(1)
        return True

    # -- the socket --------------------------------------------------------------------------------

    def _pause_socket_if_full(self) -> None:
        if not self._socket_paused and len(self._received_bytes) > BUFFER_HIGH_WATER and self._transport is not None:
            self._socket_paused = True
            self._transport.pause_reading()

    def _resume_socket(self) -> None:
        if self._socket_paused and self._transport is not None and not self._transport.is_closing():
            self._socket_paused = False
            self._transport.resume_reading()

    def _set_low_water(self, wanted: int) -> None:
        """Keep SO_RCVLOWAT at `wanted` (at most a quarter of the receive buffer)."""
        if wanted == self._low_water or not self._low_water_works or self._sock is None:
            return
        try:
            if wanted > 1:
                wanted = min(wanted, self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
        except (OSError, AttributeError):  # closed meanwhile, or not a socket with a low-water mark
            self._low_water_works = False
            return
        self._low_water = wanted


async def connect(host: str, port: int) -> SealedLink:
    """A TCP connection to `host`:`port`, as a link ready for its handshake."""
    loop = asyncio.get_running_loop()
    _, link = await loop.create_connection(SealedLink, host, port)
    return link


async def listen(on_connection: Callable[[SealedLink], Awaitable[None]], host: str, port: int) -> asyncio.Server:
    """Accept TCP connections on `host`:`port`, each a link handed to `on_connection` in a task of its own."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()  # held until done: the loop keeps only weak references

    def connected(link: SealedLink) -> None:
        task = loop.create_task(on_connection(link))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return await loop.create_server(lambda: SealedLink(connected), host, port)

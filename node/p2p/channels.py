"""Long-lived request channels: one libp2p stream per (peer, service), many requests on it.

Opening a libp2p stream per request costs a unix-socket connection to p2pd, a stream-open round
trip, protocol negotiation and a second connection from the remote daemon to its Python process.
Measured on this repository's 2-core machine (docs/benchmarks.md, "Profile"): ~1.6 ms of Python
and ~2.4 ms of p2pd CPU per 64 KiB pipeline hop, against ~0.6 and ~1.0 ms for the same request on
a stream that stays open. So services that exchange many small requests with the same peers
(pipeline hops) keep one stream per peer open and tell replies apart by request id.

Client side (`ChannelPool`): one `Channel` per (peer, service), opened on first use; a reader task
settles each request's future by its reply's id. A *posted* request (protocol POSTED_KEY) gets a
reply only when the server refuses it: the client settles it as taken once `refusal_window` passed
in silence, and a refusal later than that (a server whose loop lagged) still reaches the sender's
`on_late_refusal` until the request's timeout. Pipeline hops are posted (node/pipeline/hops.py): the
ACK was half of a hop's frames, each a wake-up of both event loops, for an answer that is "yes"
nearly every time (docs/benchmarks.md). A channel idle for `CLIENT_IDLE` seconds is
closed and a new one opened rather than reused, so the client never writes into a stream the
server is about to close for idleness (`SERVER_IDLE` is longer). Server side: node/p2p/transport.py
(`Transport._serve_channel`), where every rule of the per-request path still applies per message.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from dht.records import short_peer_id
from node.p2p.link_capacity import LinkCapacity
from node.p2p.peer_conduct import PeerConduct
from node.runtime.timeouts import within
from protocol import (
    POSTED_KEY,
    Limits,
    Message,
    MessageKind,
    ProtocolError,
    open_message,
    read_frame,
    recv_message,
    send_message,
    write_frame,
)

logger = logging.getLogger(__name__)

# A server closes a channel on which no complete request arrived for this long (the per-request
# read deadline of the stream path, applied between requests); a client stops reusing a channel
# well before, so the two never race on an idle channel.
SERVER_IDLE = 30.0
CLIENT_IDLE = 20.0
# Requests one channel may have in flight at the server; more wait in the stream (backpressure).
CHANNEL_CONCURRENCY = 16
# Posted requests whose refusal window passed, remembered for a late refusal: at most this many per channel.
MAX_LATE_REFUSALS = 4096
# Larger requests take a stream of their own: one big frame on a shared channel would hold up
# every small request behind it (head-of-line blocking), and saves nothing per byte.
CHANNEL_MAX_PAYLOAD = 4 * 1024 * 1024


class ChannelClosed(ConnectionError):
    """The channel ended (the peer closed it, refused a request or sent garbage) with requests pending."""


OpenStream = Callable[[str, str, float], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


@dataclass
class Channel:
    """One open stream to a peer's channel handler for one service."""

    peer_id: str
    service: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    limits: Limits
    swarm_id: str
    swarm_key: bytes | None
    last_used: float = field(default_factory=time.monotonic)
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    # posted requests past their refusal window: id -> (monotonic deadline, on_late_refusal)
    late_refusals: OrderedDict[int, tuple[float, Callable[[Message], None]]] = field(default_factory=OrderedDict)
    closed: bool = False
    capacity: LinkCapacity | None = None  # what the link carries, when it is a TCP connection of its own
    _reader_task: asyncio.Task | None = None

    def start(self) -> None:
        self._reader_task = asyncio.create_task(self._read_replies(), name=f"channel {self.service}")

    def usable(self, now: float) -> bool:
        return not self.closed and now - self.last_used < CLIENT_IDLE

    def _expect_reply(self, request_id: int) -> asyncio.Future:
        """A future the reader settles with the reply to `request_id`, registered before the send."""
        if self.closed:
            raise ChannelClosed(f"{self.service} channel to {short_peer_id(self.peer_id)} is closed")
        if request_id in self.pending:  # the same message twice at once: its replies could not be told apart
            raise ChannelClosed(f"request {request_id} is already pending on this channel")
        future = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        self.last_used = time.monotonic()
        return future

    async def call(self, request_id: int, payload: bytes, timeout: float) -> Message:
        """Send one sealed request and wait up to `timeout` for the reply with its id."""
        future = self._expect_reply(request_id)
        try:
            async with asyncio.timeout(timeout):
                await write_frame(self.writer, payload, self.limits)
                return await future
        finally:
            self.pending.pop(request_id, None)
            self.last_used = time.monotonic()

    async def post(
        self,
        request_id: int,
        payload: bytes,
        timeout: float,
        refusal_window: float,
        on_late_refusal: Callable[[Message], None] | None = None,
    ) -> asyncio.Future:
        """Send one sealed posted request (its meta holds POSTED_KEY) within `timeout`, and return at
        once with a future of its outcome: the server's reply if it sends one (a refusal, or the ACK
        of a server that answers every request), None once `refusal_window` passed without one (it
        was taken), or ChannelClosed if the channel ends first. A refusal after the window, up to
        `timeout` after the send, goes to `on_late_refusal`."""
        future = self._expect_reply(request_id)
        try:
            async with asyncio.timeout(timeout):
                await write_frame(self.writer, payload, self.limits)
        except BaseException:
            self.pending.pop(request_id, None)
            raise
        sent_at = time.monotonic()

        def taken() -> None:  # the window passed in silence
            if future.done():
                return
            future.set_result(None)
            if on_late_refusal is not None:
                self._remember_late(request_id, sent_at + timeout, on_late_refusal)

        quiet = asyncio.get_running_loop().call_later(refusal_window, taken)

        def settled(_: asyncio.Future) -> None:
            quiet.cancel()
            if self.pending.get(request_id) is future:
                del self.pending[request_id]

        future.add_done_callback(settled)
        return future

    def _remember_late(self, request_id: int, until: float, on_late_refusal: Callable[[Message], None]) -> None:
        late = self.late_refusals
        now = time.monotonic()
        while late and (len(late) >= MAX_LATE_REFUSALS or next(iter(late.values()))[0] < now):
            late.popitem(last=False)
        late[request_id] = (until, on_late_refusal)

    async def _read_replies(self) -> None:
        error: BaseException = ChannelClosed(f"{self.service} channel to {short_peer_id(self.peer_id)} closed")
        try:
            while True:
                reply = await recv_message(self.reader, self.limits, self.swarm_id, self.swarm_key)
                future = self.pending.get(reply.request_id)
                late = self.late_refusals.pop(reply.request_id, None) if future is None else None
                if future is not None:
                    if not future.done():
                        future.set_result(reply)
                elif late is not None:
                    if reply.kind != MessageKind.ACK and late[0] >= time.monotonic():
                        late[1](reply)
                elif reply.kind == MessageKind.ERROR:  # a refusal of the whole channel (ban, rate, bad frame)
                    error = ChannelClosed(
                        f"{short_peer_id(self.peer_id)} closed the channel: {reply.meta.get('reason')}"
                    )
                    return
                # else: the reply to a request that already timed out here; nobody waits for it
        except (EOFError, ConnectionError, OSError, asyncio.IncompleteReadError) as e:
            error = ChannelClosed(f"{self.service} channel to {short_peer_id(self.peer_id)} closed: {e!r}")
        except ProtocolError as e:
            error = e
        finally:
            self.close(error)

    def close(self, error: BaseException | None = None) -> None:
        """Close the stream and fail every request still waiting on it."""
        if self.closed:
            return
        self.closed = True
        self.writer.close()
        for future in list(self.pending.values()):
            if not future.done():
                future.set_exception(error or ChannelClosed(f"{self.service} channel closed"))
        if self._reader_task is not None and self._reader_task is not asyncio.current_task():
            self._reader_task.cancel()


class ChannelPool:
    """This peer's open channels, by (peer, service); `open_stream` opens the underlying stream."""

    def __init__(self, open_stream: OpenStream, limits: Limits, swarm_id: str, swarm_key: bytes | None):
        self._open_stream = open_stream
        self.limits, self.swarm_id, self.swarm_key = limits, swarm_id, swarm_key
        self._channels: dict[tuple[str, str], Channel] = {}
        self._opening: dict[tuple[str, str], asyncio.Future] = {}

    async def get(self, peer_id: str, service: str, timeout: float) -> Channel:
        """A usable channel to `peer_id` for `service`, opening one if needed (one at a time per key)."""
        key = (peer_id, service)
        channel = self._channels.get(key)
        if channel is not None and channel.usable(time.monotonic()):
            return channel
        if channel is not None:
            channel.close()
            del self._channels[key]
        opening = self._opening.get(key)
        if opening is not None:  # someone else is opening it: wait for theirs
            return await within(asyncio.shield(opening), timeout)
        opening = self._opening[key] = asyncio.get_running_loop().create_future()
        try:
            reader, writer = await self._open_stream(peer_id, service, timeout)
            channel = Channel(
                peer_id,
                service,
                reader,
                writer,
                self.limits,
                self.swarm_id,
                self.swarm_key,
                capacity=LinkCapacity.of(writer),
            )
            channel.start()
            self._channels[key] = channel
            opening.set_result(channel)
            return channel
        except BaseException as e:
            opening.set_exception(e)
            opening.exception()  # retrieved here: waiters re-raise it, a lone opener need not
            raise
        finally:
            del self._opening[key]

    def link_capacity(self, peer_id: str, service: str) -> float | None:
        """Bytes/s the open channel to `peer_id` for `service` carries, as its TCP connection measures it
        (node/p2p/link_capacity.py); None without an open channel or when it goes through p2pd."""
        channel = self._channels.get((peer_id, service))
        if channel is None or channel.closed or channel.capacity is None:
            return None
        return channel.capacity.bytes_per_second()

    def drop(self, peer_id: str, service: str) -> None:
        channel = self._channels.pop((peer_id, service), None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()


class ChannelOwner(Protocol):
    """What a channel server needs of the transport that owns it (node/p2p/transport.py)."""

    conduct: PeerConduct
    limits: Limits
    swarm_id: str
    swarm_key: bytes | None
    compression: str

    def error(self, reason: str, request_id: int = 0) -> Message: ...


class ChannelServer:
    """Serves the channels peers keep open to this transport's multiplexed services."""

    def __init__(self, owner: ChannelOwner):
        self.owner = owner
        self._writers: set[asyncio.StreamWriter] = set()

    def close(self) -> None:
        """End every channel served. Removing a stream handler leaves its open streams alone, so a
        channel would go on reaching the old handler (a peer that moved stage); closed, its client
        opens a new one to whatever handler is registered now."""
        for writer in list(self._writers):
            writer.close()

    async def serve(
        self,
        sender: str,
        service: str,
        answer: Callable[[Message], Awaitable[Message]],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        read_timeout: float,
    ) -> None:
        """Requests one after another on one stream (admitted once, when it opened), answered
        concurrently, at most CHANNEL_CONCURRENCY at once. Each request is charged to the sender's
        rate and ban state before it is decoded, each must arrive whole within `read_timeout` of
        the previous one (an idle or slow channel is closed), and a malformed one is a strike that
        ends the channel, as it ends a stream of the per-request path."""
        owner = self.owner
        slots = asyncio.Semaphore(CHANNEL_CONCURRENCY)
        answering: set[asyncio.Task] = set()

        async def reply_to(request: Message) -> None:
            try:
                reply = await answer(request)
            except Exception:
                logger.exception(f"{service} handler failed on a request from {short_peer_id(sender)}")
                reply = owner.error("internal error")
            if reply.kind == MessageKind.ACK and request.meta.get(POSTED_KEY) is True:
                slots.release()  # a posted request taken: silence is its answer
                return
            # the client matches replies to requests by id, whatever id the handler put in its reply
            reply = dataclasses.replace(reply, request_id=request.request_id)
            try:
                await send_message(writer, reply, owner.compression, owner.limits, owner.swarm_key)
            except (ConnectionError, OSError) as e:
                logger.debug(f"{service} channel from {short_peer_id(sender)} broke: {e!r}")
            finally:
                slots.release()

        async def refuse(reason: str) -> None:
            with contextlib.suppress(Exception):
                await within(send_message(writer, owner.error(reason), "none", owner.limits, owner.swarm_key), 1.0)

        def strike(error: ProtocolError) -> str:
            logger.info(f"bad {service} request from {short_peer_id(sender)}: {error!r}")
            owner.conduct.strike(sender, f"{service}: {error!r}")
            return f"bad request: {error}"

        self._writers.add(writer)
        loop = asyncio.get_running_loop()
        try:
            # one deadline for the channel's life, moved for each frame: cheaper than a timeout
            # context per frame, and it covers the reads alone (it is off between frames)
            async with asyncio.timeout(None) as frame_deadline:
                while True:
                    await slots.acquire()
                    frame_deadline.reschedule(loop.time() + read_timeout)
                    try:
                        payload = await read_frame(reader, owner.limits)
                    except EOFError:  # the client is done
                        return
                    except (ConnectionError, asyncio.IncompleteReadError) as e:
                        logger.debug(f"{service} channel from {short_peer_id(sender)} broke: {e!r}")
                        return
                    frame_deadline.reschedule(None)
                    refusal = owner.conduct.charge(sender)
                    if refusal is not None:
                        await refuse(refusal)
                        return
                    try:
                        request = open_message(payload, owner.limits, owner.swarm_id, owner.swarm_key)
                    except ProtocolError as e:
                        await refuse(strike(e))
                        return
                    task = asyncio.create_task(reply_to(request))
                    answering.add(task)
                    task.add_done_callback(answering.discard)
        except TimeoutError:  # idle, or a frame slower than read_timeout
            return
        except ProtocolError as e:  # a frame over the size limit or cut short
            await refuse(strike(e))
        finally:
            self._writers.discard(writer)
            for task in answering:
                task.cancel()

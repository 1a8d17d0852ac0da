"""Long-lived request channels: one libp2p stream per (peer, service), many requests on it.

Opening a libp2p stream per request costs a unix-socket connection to p2pd, a stream-open round
trip, protocol negotiation and a second connection from the remote daemon to its Python process.
Measured on this repository's 2-core machine (docs/changes.md, 49e685b): ~1.6 ms of Python
and ~2.4 ms of p2pd CPU per 64 KiB pipeline hop, against ~0.6 and ~1.0 ms for the same request on
a stream that stays open. So services that exchange many small requests with the same peers
(pipeline hops) keep one stream per peer open and tell replies apart by request id.

Both sides run on a FrameLink (node/p2p/frame_link.py): a stream through p2pd, or a direct link
(node/p2p/direct.py) whose frames arrive without a task or a stream reader in between.

Client side (`ChannelPool`): one `Channel` per (peer, service), opened on first use; each reply
that arrives settles its request's future by its id. A *posted* request (protocol POSTED_KEY) gets a
reply only when the server refuses it: the client settles it as taken once `refusal_window` passed
in silence, and a refusal later than that (a server whose loop lagged) still reaches the sender's
`on_late_refusal` until the request's timeout. Pipeline hops are posted (node/pipeline/hops.py): the
ACK was half of a hop's frames, each a wake-up of both event loops, for an answer that is "yes"
nearly every time (docs/changes.md, de097ca). A channel idle for `CLIENT_IDLE` seconds is
closed and a new one opened rather than reused, so the client never writes into a stream the
server is about to close for idleness (`SERVER_IDLE` is longer). Server side (`ChannelServer`,
admitted by node/p2p/transport.py): every rule of the per-request path still applies per message.
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
from node.p2p.frame_link import FrameLink
from node.p2p.link_capacity import LinkCapacity
from node.p2p.peer_conduct import PeerConduct
from node.runtime.timeouts import within
from protocol import POSTED_KEY, Limits, Message, MessageKind, ProtocolError, open_message, seal_message

logger = logging.getLogger(__name__)

# A server closes a channel on which no complete request arrived for this long (the per-request
# read deadline of the stream path, applied between requests); a client stops reusing a channel
# well before, so the two never race on an idle channel.
SERVER_IDLE = 30.0
CLIENT_IDLE = 20.0
# Requests one channel may have answers awaited for at the server; more wait in TCP (backpressure).
CHANNEL_CONCURRENCY = 16
# Reply bytes a channel's client may leave unread before the server closes the channel.
MAX_REPLY_BACKLOG = 4 * 1024 * 1024
# Posted requests whose refusal window passed, remembered for a late refusal: at most this many per channel.
MAX_LATE_REFUSALS = 4096
# Larger requests take a stream of their own: one big frame on a shared channel would hold up
# every small request behind it (head-of-line blocking), and saves nothing per byte.
CHANNEL_MAX_PAYLOAD = 4 * 1024 * 1024


class ChannelClosed(ConnectionError):
    """The channel ended (the peer closed it, refused a request or sent garbage) with requests pending."""


OpenLink = Callable[[str, str, float], Awaitable[FrameLink]]


@dataclass
class Channel:
    """One open link to a peer's channel handler for one service."""

    peer_id: str
    service: str
    link: FrameLink
    limits: Limits
    swarm_id: str
    swarm_key: bytes | None
    last_used: float = field(default_factory=time.monotonic)
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    # posted requests in their refusal window, in the order sent: id -> (loop time the window
    # closes, loop time a late refusal is no longer heard, the outcome, on_late_refusal)
    posted: OrderedDict[int, tuple[float, float, asyncio.Future, Callable[[Message], None] | None]] = field(
        default_factory=OrderedDict
    )
    # posted requests past their refusal window: id -> (loop time until which, on_late_refusal)
    late_refusals: OrderedDict[int, tuple[float, Callable[[Message], None]]] = field(default_factory=OrderedDict)
    closed: bool = False
    capacity: LinkCapacity | None = None  # what the link carries, when it is a TCP connection of its own
    _sweep: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self.link.start(self._on_reply, self._on_link_closed, self.limits)

    def usable(self, now: float) -> bool:
        return not self.closed and now - self.last_used < CLIENT_IDLE

    def _expect_reply(self, request_id: int) -> asyncio.Future:
        """A future `_on_reply` settles with the reply to `request_id`, registered before the send."""
        if self.closed:
            raise ChannelClosed(f"{self.service} channel to {short_peer_id(self.peer_id)} is closed")
        if request_id in self.pending:  # the same message twice at once: its replies could not be told apart
            raise ChannelClosed(f"request {request_id} is already pending on this channel")
        future = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        self.last_used = time.monotonic()
        return future

    async def _send(self, payload: bytes, timeout: float) -> None:
        self.link.send_frame(payload)
        if self.link.write_backlog():  # the connection did not take it all at once: wait while it is full
            await within(self.link.drain(), timeout)

    async def call(self, request_id: int, payload: bytes, timeout: float) -> Message:
        """Send one sealed request and wait up to `timeout` for the reply with its id."""
        future = self._expect_reply(request_id)
        try:
            async with asyncio.timeout(timeout):
                await self._send(payload, timeout)
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
        `timeout` after the send, goes to `on_late_refusal`. The windows are settled in the order
        the requests were sent, by one timer per channel (a timer per request cost more than the
        rest of a hop's bookkeeping), so a caller keeps one `refusal_window` for a channel."""
        future = self._expect_reply(request_id)
        try:
            await self._send(payload, timeout)
        except BaseException:
            self.pending.pop(request_id, None)
            raise
        loop = asyncio.get_running_loop()
        now = loop.time()
        self.posted[request_id] = (now + refusal_window, now + timeout, future, on_late_refusal)
        if self._sweep is None:
            self._sweep = loop.call_at(now + refusal_window, self._end_windows)
        return future

    def _end_windows(self) -> None:
        """Settle as taken every posted request whose refusal window passed in silence."""
        loop = asyncio.get_running_loop()
        now, posted = loop.time(), self.posted
        self._sweep = None
        while posted:
            request_id, (quiet_at, until, future, on_late_refusal) = next(iter(posted.items()))
            if quiet_at > now:
                self._sweep = loop.call_at(quiet_at, self._end_windows)
                return
            del posted[request_id]
            if future.done():  # refused (or the channel closed) within the window
                continue
            if self.pending.get(request_id) is future:
                del self.pending[request_id]
            future.set_result(None)
            if on_late_refusal is not None:
                self._remember_late(request_id, until, on_late_refusal, now)

    def _remember_late(
        self, request_id: int, until: float, on_late_refusal: Callable[[Message], None], now: float
    ) -> None:
        late = self.late_refusals
        while late and (len(late) >= MAX_LATE_REFUSALS or next(iter(late.values()))[0] < now):
            late.popitem(last=False)
        late[request_id] = (until, on_late_refusal)

    def _on_reply(self, payload: bytes | memoryview) -> None:
        """A frame from the server: the reply to a pending request, a late refusal, or the channel's end."""
        try:
            reply = open_message(payload, self.limits, self.swarm_id, self.swarm_key)
        except ProtocolError as e:
            self.close(e)
            return
        future = self.pending.pop(reply.request_id, None)
        if future is not None:
            if not future.done():
                future.set_result(reply)
            return
        late = self.late_refusals.pop(reply.request_id, None)
        if late is not None:
            if reply.kind != MessageKind.ACK and late[0] >= asyncio.get_running_loop().time():
                late[1](reply)
        elif reply.kind == MessageKind.ERROR:  # a refusal of the whole channel (ban, rate, bad frame)
            self.close(ChannelClosed(f"{short_peer_id(self.peer_id)} closed the channel: {reply.meta.get('reason')}"))
        # else: the reply to a request that already timed out here; nobody waits for it

    def _on_link_closed(self, error: BaseException | None) -> None:
        if isinstance(error, ProtocolError):
            self.close(error)
        else:
            suffix = f": {error!r}" if error is not None else ""
            self.close(ChannelClosed(f"{self.service} channel to {short_peer_id(self.peer_id)} closed{suffix}"))

    def close(self, error: BaseException | None = None) -> None:
        """Close the link and fail every request still waiting on it."""
        if self.closed:
            return
        self.closed = True
        self.link.close()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        self.posted.clear()
        for future in list(self.pending.values()):
            if not future.done():
                future.set_exception(error or ChannelClosed(f"{self.service} channel closed"))
        self.pending.clear()


class ChannelPool:
    """This peer's open channels, by (peer, service); `open_link` opens the link under one."""

    def __init__(self, open_link: OpenLink, limits: Limits, swarm_id: str, swarm_key: bytes | None):
        self._open_link = open_link
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
            link = await self._open_link(peer_id, service, timeout)
            channel = Channel(
                peer_id, service, link, self.limits, self.swarm_id, self.swarm_key, capacity=LinkCapacity.of(link)
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

    def peer_link_rate(self, peer_id: str) -> float | None:
        """The best rate any open channel to `peer_id` measures (bytes/s), or None (node/p2p/
        link_capacity.py): what a transfer to that peer outside the channels can expect."""
        rates = [self.link_capacity(peer, service) for peer, service in list(self._channels) if peer == peer_id]
        known = [rate for rate in rates if rate is not None]
        return max(known) if known else None

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
        self._links: set[FrameLink] = set()

    def close(self) -> None:
        """End every channel served. Removing a stream handler leaves its open streams alone, so a
        channel would go on reaching the old handler (a peer that moved stage); closed, its client
        opens a new one to whatever handler is registered now."""
        for link in list(self._links):
            link.close()

    def refuse(self, link: FrameLink, reason: str) -> None:
        """Answer a refused channel with one short ERROR, then close it."""
        link.start(_ignore_frame, _ignore_end, self.owner.limits)
        _send_refusal(self.owner, link, reason)
        link.close()  # what was written still goes out first

    async def serve(
        self,
        sender: str,
        service: str,
        answer: Callable[[Message], Message | Awaitable[Message]],
        link: FrameLink,
        read_timeout: float,
    ) -> None:
        """Admit `sender`'s channel, then serve its requests one after another until it ends. Each
        request is charged to the sender's rate and ban state before it is decoded, and each must
        arrive whole within `read_timeout` of the previous one (an idle or slow channel is closed);
        a malformed one is a strike that ends the channel, as it ends a stream of the per-request
        path. An answer given at once is sent at once, from the frame's arrival (a pipeline hop's
        handler only checks and queues); one that must be awaited runs in a task, at most
        CHANNEL_CONCURRENCY at once (past that the link is not read: backpressure)."""
        refusal = self.owner.conduct.admit(sender)  # one of the sender's stream slots, while it lasts
        if refusal is not None:
            logger.debug(f"refused a {service} channel from {short_peer_id(sender)}: {refusal}")
            self.refuse(link, refusal)
            return
        served = _ServedChannel(self.owner, sender, service, answer, link, read_timeout)
        self._links.add(link)
        try:
            await served.run()
        finally:
            self._links.discard(link)
            self.owner.conduct.release(sender)
            link.close()


def _send_refusal(owner: ChannelOwner, link: FrameLink, reason: str) -> None:
    """One short ERROR on `link`, best effort (a refused peer gets nothing more)."""
    with contextlib.suppress(Exception):
        link.send_frame(seal_message(owner.error(reason), "none", owner.limits, owner.swarm_key))


def _ignore_frame(payload: bytes | memoryview) -> None:
    pass


def _ignore_end(error: BaseException | None) -> None:
    pass


class _ServedChannel:
    """The server's side of one channel while it lasts (ChannelServer.serve)."""

    def __init__(
        self,
        owner: ChannelOwner,
        sender: str,
        service: str,
        answer: Callable[[Message], Message | Awaitable[Message]],
        link: FrameLink,
        read_timeout: float,
    ):
        self.owner, self.sender, self.service, self.answer, self.link = owner, sender, service, answer, link
        self.read_timeout = read_timeout
        self.loop = asyncio.get_running_loop()
        self.ended = self.loop.create_future()
        self.answering: set[asyncio.Task] = set()
        self.paused = False
        self.last_frame = self.loop.time()
        self.watching: asyncio.TimerHandle | None = None

    async def run(self) -> None:
        self.link.start(self.on_frame, self.on_link_closed, self.owner.limits)
        # one timer for the channel's life: cheaper than a deadline per frame
        self.watching = self.loop.call_later(self.read_timeout / 4, self.watch)
        try:
            await self.ended
        finally:  # the link is closed by ChannelServer.serve
            self.watching.cancel()
            for task in self.answering:
                task.cancel()

    def end(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)

    def watch(self) -> None:
        """Close a channel on which no whole request arrived for `read_timeout` (idle, or a frame
        slower than that), unless it is not read because its requests are still being answered."""
        if self.ended.done():
            return
        now = self.loop.time()
        if self.paused:
            self.last_frame = now
        elif now - self.last_frame > self.read_timeout:
            logger.debug(f"{self.service} channel from {short_peer_id(self.sender)} idle or slow: closed")
            self.end()
            return
        self.watching = self.loop.call_later(self.read_timeout / 4, self.watch)

    def on_frame(self, payload: bytes | memoryview) -> None:
        if self.ended.done():  # refused or struck: nothing after that is served
            return
        owner = self.owner
        self.last_frame = self.loop.time()
        refusal = owner.conduct.charge(self.sender)
        if refusal is not None:
            self.refuse(refusal)
            return
        try:
            request = open_message(payload, owner.limits, owner.swarm_id, owner.swarm_key)
        except ProtocolError as e:
            self.refuse(self.strike(e))
            return
        try:  # Transport.answer answers every failure itself: this guards any other `answer`
            reply = self.answer(request)
        except Exception as e:
            reply = self.failed(e)
        if isinstance(reply, Message):
            self.send_reply(request, reply)
            return
        task = self.loop.create_task(self.reply_later(request, reply))
        self.answering.add(task)
        if len(self.answering) >= CHANNEL_CONCURRENCY and not self.paused:
            self.paused = True
            self.link.pause_reading()

    async def reply_later(self, request: Message, answer: Awaitable[Message]) -> None:
        try:
            try:
                reply = await answer
            except Exception as e:
                reply = self.failed(e)
            self.send_reply(request, reply)
        finally:
            self.answering.discard(asyncio.current_task())  # type: ignore[arg-type]
            if self.paused and len(self.answering) < CHANNEL_CONCURRENCY and not self.ended.done():
                self.paused = False
                self.last_frame = self.loop.time()
                self.link.resume_reading()

    def send_reply(self, request: Message, reply: Message) -> None:
        if reply.kind == MessageKind.ACK and request.meta.get(POSTED_KEY) is True:
            return  # a posted request taken: silence is its answer
        owner = self.owner
        # the client matches replies to requests by id, whatever id the handler put in its reply
        reply = dataclasses.replace(reply, request_id=request.request_id)
        try:
            self.link.send_frame(seal_message(reply, owner.compression, owner.limits, owner.swarm_key))
        except (ConnectionError, OSError) as e:
            logger.debug(f"{self.service} channel from {short_peer_id(self.sender)} broke: {e!r}")
            self.end()
            return
        if self.link.write_backlog() > MAX_REPLY_BACKLOG:  # a client that sends and never reads
            logger.info(f"{self.service} channel from {short_peer_id(self.sender)} reads no replies: closed")
            self.end()

    def failed(self, error: Exception) -> Message:
        """The ERROR reply to a request whose answer raised, logged on one line (no traceback)."""
        logger.warning(f"{self.service} handler failed on a request from {short_peer_id(self.sender)}: {error!r:.300}")
        return self.owner.error(f"request failed: {type(error).__name__}")

    def refuse(self, reason: str) -> None:
        """One short ERROR (best effort), then the channel ends."""
        _send_refusal(self.owner, self.link, reason)
        self.end()

    def strike(self, error: ProtocolError) -> str:
        logger.info(f"bad {self.service} request from {short_peer_id(self.sender)}: {error!r}")
        self.owner.conduct.strike(self.sender, f"{self.service}: {error!r}")
        return f"bad request: {error}"

    def on_link_closed(self, error: BaseException | None) -> None:
        if isinstance(error, ProtocolError):  # a frame over the size limit or cut short
            self.refuse(self.strike(error))
        elif error is not None:
            logger.debug(f"{self.service} channel from {short_peer_id(self.sender)} broke: {error!r}")
        self.end()

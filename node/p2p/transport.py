"""Messages between peers over hivemind's libp2p streams.

Unary libp2p calls are capped at 4 MiB, so everything here rides on binary streams with
length-prefixed `protocol` frames. A request handler gets one decoded message and returns one
reply; a session handler owns the stream for multi-message exchanges (gossip, state download).
Requests of most services take one stream per exchange; services that `multiplex` (pipeline hops:
many small requests to the same few peers) keep one long-lived stream per peer and tell replies
apart by request id (node/p2p/channels.py), which cuts the per-request cost of opening a stream
(issue 16); a channel to a peer that announces a direct-link port runs on a TCP connection of its
own instead of through p2pd (node/p2p/direct.py), falling back to p2pd when that fails. Every path
admits, checks, MACs and strikes alike. Malformed input from a stranger is
answered with an ERROR message (when the stream still works) and logged; it never takes the node down.

Every request, on a stream or a channel, goes through one dispatcher (node/p2p/dispatch.py): the
service's contract is checked before its handler runs, and whatever the handler raises is one ERROR
reply and a strike against the sender, never a traceback in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import TracebackType

from hivemind.p2p import P2P, PeerID

from dht.records import short_peer_id
from node.p2p.channels import CHANNEL_MAX_PAYLOAD, SERVER_IDLE, Channel, ChannelPool, ChannelServer
from node.p2p.dialer import PeerDialer
from node.p2p.direct import DirectLinks
from node.p2p.dispatch import RequestDispatcher, RequestHandler
from node.p2p.frame_link import FrameLink, StreamFrameLink
from node.p2p.link_stream import SESSION_SUFFIX, link_stream
from node.p2p.metered_stream import metered
from node.p2p.peer_conduct import PeerConduct
from node.p2p.request_contract import RequestContract
from node.p2p.sealed_link import DirectLinkError, SealedLink
from node.p2p.stream_admission import SessionHandler, StreamAdmission
from node.runtime.meter import Meter
from node.runtime.timeouts import within
from protocol import (
    DEFAULT_LIMITS,
    POSTED_KEY,
    Limits,
    Message,
    MessageKind,
    ProtocolError,
    recv_message,
    seal_message,
    send_message,
    write_frame,
)

logger = logging.getLogger(__name__)

# what p2pd reports when the remote peer has no handler for a protocol (e.g. a peer running a
# version without channels): its requests then take a stream each
_UNSUPPORTED_PROTOCOL = "protocols not supported"


class _NoChannelHandler(Exception):
    """The peer serves a service but not its channel protocol."""


class TransportError(RuntimeError):
    """A peer could not be reached, timed out, or answered with an error."""


class StreamNotOpened(TransportError):
    """No stream to the peer could be opened at all (unreachable, or it serves no such protocol):
    nothing was sent, so nothing of an exchange is left to clean up."""


# What talking to another peer can raise: it died, timed out, closed the stream or sent garbage.
# Callers catch these to retry elsewhere; anything else is a bug of ours and propagates.
PEER_FAILURES: tuple[type[BaseException], ...] = (
    TransportError,
    ProtocolError,
    EOFError,
    ConnectionError,
    OSError,
    asyncio.IncompleteReadError,
    TimeoutError,
)


def timed_out(error: BaseException) -> bool:
    """Whether `error` (a TransportError, raised `from` what went wrong) was a timeout rather than
    a failure: Transport.request wraps a TimeoutError, so look down the cause chain (bounded)."""
    cause: BaseException | None = error
    for _ in range(8):
        if cause is None:
            return False
        if isinstance(cause, TimeoutError):
            return True
        cause = cause.__cause__
    return False


class _AsTransportError:
    """What talking to a peer raises, as a TransportError raised from it (timed_out looks there).
    A class rather than a @contextmanager generator: it wraps every pipeline hop."""

    __slots__ = ("peer_id", "service", "timeout")

    def __init__(self, service: str, peer_id: str, timeout: float) -> None:
        self.service, self.peer_id, self.timeout = service, peer_id, timeout

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: TracebackType | None) -> bool:
        if error is None or isinstance(error, TransportError):
            return False
        where = f"{self.service} to {short_peer_id(self.peer_id)}"
        if isinstance(error, TimeoutError):
            raise TransportError(f"{where} timed out after {self.timeout:.1f} s") from error
        if isinstance(error, (ProtocolError, EOFError, ConnectionError, OSError, asyncio.IncompleteReadError)):
            raise TransportError(f"{where} failed: {error!r}") from error
        return False


class Transport:
    """Sends and serves messages for one swarm. `stage` is this peer's current stage (it moves)."""

    def __init__(
        self,
        p2p: P2P,
        swarm_id: str,
        stage: int,
        limits: Limits = DEFAULT_LIMITS,
        compression: str = "none",
        conduct: PeerConduct | None = None,
        swarm_key: bytes | None = None,
        dialer: PeerDialer | None = None,
        meter: Meter | None = None,
        direct: DirectLinks | None = None,
        direct_addresses: Callable[[str], Sequence[tuple[str, int]]] = lambda peer_id: (),
    ):
        self.p2p = p2p
        # channels to peers that take direct links bypass p2pd (node/p2p/direct.py); None: p2pd only
        self.direct, self.direct_addresses = direct, direct_addresses
        self.meter = meter or Meter()  # bytes per service and hop latencies (node/runtime/meter.py)
        self.dialer = dialer  # dials a peer at its announced addresses before a stream (None: p2pd's routing only)
        self.swarm_key = swarm_key  # a private swarm: every message carries a MAC under it
        self.conduct = conduct or PeerConduct()
        self.swarm_id = swarm_id
        self.stage = stage
        self.limits = limits
        self.compression = compression
        self._request_ids = itertools.count(1)
        # every stream and session a peer opens to us is admitted (or refused) here first
        self.admission = StreamAdmission(
            self.conduct,
            self.meter,
            lambda writer, reason: send_message(writer, self.error(reason), "none", self.limits, self.swarm_key),
        )
        self._handler_names: list[str] = []
        self.requests = RequestDispatcher(self)  # every request's way to its handler (node/p2p/dispatch.py)
        self._multiplexed: set[str] = set()  # services whose requests share a channel per peer
        self._direct_services: set[str] = set()  # what this transport serves on direct links
        self.channels = ChannelPool(self._open_channel_link, limits, swarm_id, swarm_key)  # ours to peers
        self._stream_only: set[tuple[str, str]] = set()  # (peer, service) without a channel handler
        self._channel_server = ChannelServer(self)  # the channels peers keep open to us

    async def _add_handler(self, service: str, on_stream, name: str | None = None) -> None:
        name = name or self.protocol_name(service)
        await self.p2p.add_binary_stream_handler(name, on_stream)
        self._handler_names.append(name)

    async def close(self) -> None:
        """Remove every handler this transport registered. p2pd refuses to register a protocol
        twice, so a peer that serves another stage in the same process (a move) needs them gone;
        at shutdown the daemon may already be gone: failures are logged, not raised."""
        self.channels.close()
        self._channel_server.close()
        if self.direct is not None:
            for service in self._direct_services:
                self.direct.unserve(self.swarm_id, service)
        while self._handler_names:
            name = self._handler_names.pop()
            try:
                await self.p2p.remove_binary_stream_handler(name)
            except Exception as e:
                logger.debug(f"could not remove handler {name}: {e!r}")

    def protocol_name(self, service: str) -> str:
        return f"/pipeswarm/{self.swarm_id}/{service}"

    def channel_protocol_name(self, service: str) -> str:
        return f"/pipeswarm/{self.swarm_id}/{service}/channel"

    def multiplex(self, *services: str) -> None:
        """Carry these services' requests (to CHANNEL_MAX_PAYLOAD) on a channel per peer; before `serve_requests`."""
        self._multiplexed.update(services)

    def message(
        self, kind: MessageKind, meta: dict | None = None, tensors: dict | None = None, request_id: int | None = None
    ) -> Message:
        return Message(
            kind=kind,
            swarm_id=self.swarm_id,
            sender_stage=self.stage,
            request_id=next(self._request_ids) if request_id is None else request_id,
            meta=meta or {},
            tensors=tensors or {},
        )

    def error(self, reason: str, request_id: int = 0) -> Message:
        return self.message(MessageKind.ERROR, {"reason": reason[:500]}, request_id=request_id)

    async def serve_requests(
        self, service: str, handler: RequestHandler, contract: RequestContract, read_timeout: float = 30.0
    ) -> None:
        """One request, one reply per stream (and many on a channel for `multiplex` services). A
        request must arrive within `read_timeout` (a slow sender cannot hold the stream longer);
        malformed input, or a request that breaks `contract`, is a strike against the sender."""
        self.requests.serve(service, handler, contract)

        async def one_request(sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                request = await within(recv_message(reader, self.limits, self.swarm_id, self.swarm_key), read_timeout)
                reply = self.requests.answer(sender, service, request)
                if not isinstance(reply, Message):
                    reply = await reply
                await send_message(writer, reply, self.compression, self.limits, self.swarm_key)
            except (TimeoutError, ProtocolError, EOFError) as e:
                logger.info(f"bad {service} request from {short_peer_id(sender)}: {e!r}")
                if not isinstance(e, EOFError):
                    self.conduct.strike(sender, f"{service}: {e!r}")
                with contextlib.suppress(Exception):
                    await within(
                        send_message(writer, self.error(f"bad request: {e}"), "none", self.limits, self.swarm_key), 1.0
                    )
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                logger.debug(f"{service} stream from {short_peer_id(sender)} broke: {e!r}")
            except Exception as e:  # the reply could not be sent (the handler's failures are answered)
                logger.warning(f"{service} reply to {short_peer_id(sender)} failed: {e!r:.300}")

        await self._add_handler(service, self.admission.handler(service, one_request))
        self._serve_direct_sessions(service, one_request)
        if service in self._multiplexed:
            channel_timeout = min(read_timeout, SERVER_IDLE)

            def answering(sender: str) -> Callable[[Message], Message | Awaitable[Message]]:
                return lambda request: self.requests.answer(sender, service, request)

            async def channel(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                sender = info.peer_id.to_base58()
                link = StreamFrameLink(*metered(reader, writer, self.meter, service))
                await self._channel_server.serve(sender, service, answering(sender), link, channel_timeout)

            await self._add_handler(service, channel, self.channel_protocol_name(service))
            if self.direct is not None:  # the same channel, on a direct link (node/p2p/direct.py)

                async def direct_channel(sender: str, link: SealedLink) -> None:
                    link.count_into(self.meter, service)
                    await self._channel_server.serve(sender, service, answering(sender), link, channel_timeout)

                self.direct.serve(self.swarm_id, service, direct_channel)
                self._direct_services.add(service)

    async def serve_sessions(self, service: str, handler: SessionHandler) -> None:
        """A handler that owns the whole stream (gossip, state download); it bounds its own reads."""

        async def session(sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await handler(sender, reader, writer)
            except ProtocolError as e:
                logger.info(f"{service} session with {short_peer_id(sender)} ended: {e!r}")
                self.conduct.strike(sender, f"{service}: {e}")
            except (TimeoutError, EOFError, ConnectionError, asyncio.IncompleteReadError) as e:
                logger.info(f"{service} session with {short_peer_id(sender)} ended: {e!r}")
            except Exception as e:  # one line, as a request's handler failure: see the module docstring
                logger.warning(f"{service} session with {short_peer_id(sender)} failed: {e!r:.300}")
                self.conduct.strike(sender, f"{service}: session failed: {type(e).__name__}")

        await self._add_handler(service, self.admission.handler(service, session))
        self._serve_direct_sessions(service, session)

    def _serve_direct_sessions(self, service: str, body: SessionHandler) -> None:
        """Serve what a p2pd stream of `service` carries on direct links too (node/p2p/link_stream.py)."""
        if self.direct is None:
            return

        async def direct_session(sender: str, link: SealedLink) -> None:
            link.count_into(self.meter, service)
            await self.admission.run(sender, service, *link_stream(link, self.limits), body, metered_here=False)

        self.direct.serve(self.swarm_id, service + SESSION_SUFFIX, direct_session)
        self._direct_services.add(service + SESSION_SUFFIX)

    async def request(self, peer_id: str, service: str, message: Message, timeout: float) -> Message:
        """Send one message and wait for the reply. Raises TransportError on any failure, including
        an ERROR reply (BUSY is returned, not raised: the caller decides where to go next)."""
        began = time.monotonic()
        with _AsTransportError(service, peer_id, timeout):
            payload = seal_message(message, self.compression, self.limits, self.swarm_key)
            channel = await self._channel_for(peer_id, service, len(payload), timeout)
            if channel is not None:
                reply = await channel.call(message.request_id, payload, timeout)
            else:
                reply = await self._exchange_on_stream(peer_id, service, payload, timeout)
        if reply.kind == MessageKind.ERROR:
            raise TransportError(f"{short_peer_id(peer_id)} refused {service}: {reply.meta.get('reason')}")
        self.meter.hop(service, time.monotonic() - began)  # answered hops only: timeouts are counted apart
        return reply

    def seal_posted(self, message: Message, compression: str | None = None) -> bytes:
        """`message` as a posted request's payload (protocol POSTED_KEY), tensors in `compression` or ours."""
        posted = message.with_meta({**message.meta, POSTED_KEY: True})
        return seal_message(posted, compression or self.compression, self.limits, self.swarm_key)

    async def post(
        self,
        peer_id: str,
        service: str,
        request_id: int,
        payload: bytes,
        timeout: float,
        refusal_window: float,
        on_late_refusal: Callable[[Message], None] | None = None,
    ) -> asyncio.Future:
        """Send a request `seal_posted` made, which `peer_id` answers only to refuse, and return once
        it is written, with a future of its outcome (node/p2p/channels.py, Channel.post). One that
        cannot take a channel takes a stream of its own, and its reply, whatever it is, settles the
        outcome. Raises TransportError when the send itself fails."""
        began = time.monotonic()
        with _AsTransportError(service, peer_id, timeout):
            channel = await self._channel_for(peer_id, service, len(payload), timeout)
            if channel is not None:
                outcome = await channel.post(request_id, payload, timeout, refusal_window, on_late_refusal)
            else:
                outcome = asyncio.get_running_loop().create_future()
                outcome.set_result(await self._exchange_on_stream(peer_id, service, payload, timeout))
        self.meter.hop(service, time.monotonic() - began)  # a posted hop: until it is written
        return outcome

    async def _exchange_on_stream(self, peer_id: str, service: str, payload: bytes, timeout: float) -> Message:
        """Send one request on a stream of its own and read its reply."""
        async with self.session(peer_id, service, timeout) as (reader, writer):
            await within(write_frame(writer, payload, self.limits), timeout)
            return await within(recv_message(reader, self.limits, self.swarm_id, self.swarm_key), timeout)

    async def _channel_for(self, peer_id: str, service: str, size: int, timeout: float) -> Channel | None:
        """The channel to `peer_id` for `service` a request of `size` bytes takes; None when it takes
        a stream of its own (not multiplexed, too large, or the peer has no channel handler)."""
        if service not in self._multiplexed or size > CHANNEL_MAX_PAYLOAD or (peer_id, service) in self._stream_only:
            return None
        try:
            return await self.channels.get(peer_id, service, timeout)
        except _NoChannelHandler as e:
            logger.info(f"{short_peer_id(peer_id)} has no {service} channel, one stream per request: {e}")
            self._stream_only.add((peer_id, service))
            return None

    async def _direct_link(self, peer_id: str, service: str, timeout: float, suffix: str = "") -> SealedLink | None:
        """A direct link to `peer_id` for `service` (`service + suffix` there); None: p2pd carries it."""
        if self.direct is None or not self.direct.usable(peer_id):
            return None
        addresses = self.direct_addresses(peer_id)
        if not (addresses or self.direct.reaches_through_relay(peer_id)):
            return None
        try:
            link = await self.direct.open(peer_id, addresses, self.swarm_id, service + suffix, timeout)
        except DirectLinkError as e:  # through p2pd then, which may know a way (a relay)
            logger.info(f"{service} to {short_peer_id(peer_id)} goes through p2pd: {e}")
            return None
        link.count_into(self.meter, service)
        return link

    async def _open_channel_link(self, peer_id: str, service: str, timeout: float) -> FrameLink:
        if (link := await self._direct_link(peer_id, service, timeout)) is not None:
            return link
        try:
            return StreamFrameLink(
                *await self._open_stream(peer_id, service, self.channel_protocol_name(service), timeout)
            )
        except TransportError as e:
            if _UNSUPPORTED_PROTOCOL in str(e):
                raise _NoChannelHandler(str(e)) from e
            raise

    def _forget(self, peer_id: str) -> None:
        if self.dialer is not None:
            self.dialer.forget(peer_id)

    @contextlib.asynccontextmanager
    async def session(
        self, peer_id: str, service: str, timeout: float
    ) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        """A stream to `peer_id`'s `service`, closed on exit: p2pd's, or a direct link's to a peer behind a NAT."""
        link = None
        if self.direct is not None and self.direct.reaches_through_relay(peer_id):
            link = await self._direct_link(peer_id, service, timeout, SESSION_SUFFIX)
        if link is not None:
            reader, writer = link_stream(link, self.limits)
        else:
            reader, writer = await self._open_stream(peer_id, service, self.protocol_name(service), timeout)
        try:
            yield reader, writer
        finally:
            writer.close()

    async def _open_stream(
        self, peer_id: str, service: str, protocol: str, timeout: float
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new metered stream to `peer_id`'s handler of `protocol`; TransportError if it cannot open."""
        if self.dialer is not None:
            with contextlib.suppress(TimeoutError):  # a slow dial still leaves p2pd's own routing
                await within(self.dialer.ensure(peer_id), timeout)
        try:
            _, reader, writer = await within(
                self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), protocol), timeout
            )
        except TimeoutError as e:
            self._forget(peer_id)
            raise StreamNotOpened(f"opening {service} stream to {short_peer_id(peer_id)} timed out") from e
        except Exception as e:  # p2pd reports unreachable peers and unknown protocols as generic errors
            self._forget(peer_id)
            raise StreamNotOpened(f"cannot open {service} stream to {short_peer_id(peer_id)}: {e}") from e
        return metered(reader, writer, self.meter, service)

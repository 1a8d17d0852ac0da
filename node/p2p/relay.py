"""A relay: a publicly reachable peer that introduces peers behind NATs to each other, and carries
their link when even then they cannot reach each other (docs/operations.md, "Peers behind NATs").

p2pd's own ways fail two home peers (node/p2p/reachability.py): its relayed circuits cannot be
relied on past 128 KiB, and go-libp2p starts hole punching only once peers saw a public address for the host. So
the direct links (node/p2p/direct.py) traverse NATs themselves, the way DCUtR and iroh do:

- *Registration.* A peer behind a NAT opens a direct link to each relay it uses (service
  RELAY_SERVICE: the handshake tells the relay who it is) and keeps it open; the relay answers with
  the address it sees the peer come from. Over that link the relay tells the peer of others who
  want a link to it (INCOMING).
- *Pairing.* A peer A that wants a link to a registered peer B asks the relay over a link of its
  own (CONNECT, with a mode); the relay hands each of them a one-time token, A in its answer, B over
  its registration. Each opens a plain TCP connection to the relay's direct port and sends its
  token as the first message. Once both are in, the relay answers each, signed with its key, with
  the address it sees the other one's connection come from:
  - mode PUNCH: both connect at once from the local port of that connection to the other's seen
    address (TCP simultaneous open). Behind NATs that keep a connection's source port (a plain
    masquerade), each side's SYN leaves the mapping that the other side's SYN then matches; behind
    NATs that pick a new port for every connection (symmetric) the seen address is the wrong one
    and the punch fails.
  - mode RELAY: the relay splices the two connections. A and B run the direct-link handshake end
    to end through it (A names B, B signs), so the relay sees only sealed records and can neither
    read nor alter them unnoticed. It carries at most its operator's budget (`--relay-budget`)
    at its rate, and announces what is left in its record (`relay_budget`).

Everything a relay reads is bounded before it is read (CONTROL_LIMITS, the handshake's 4 KiB),
tokens are single-use and expire (PAIR_TIMEOUT), and registrations, pairings and splices are capped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgpack

from dht.identity_keys import Identity
from dht.records import short_peer_id
from node.p2p.sealed_link import DirectLinkError, SealedLink
from protocol import Limits

logger = logging.getLogger(__name__)

RELAY_SERVICE = "relay"
PAIR_KEY = "pair"  # the first message of a pairing connection: {PAIR_KEY: token}
TOKEN_BYTES = 16
PAIR_TIMEOUT = 10.0  # seconds a token waits for the other side's connection
CONTROL_TIMEOUT = 5.0  # for one answer on a control link
# a registered peer pings this often; a registration silent for PINGS_MISSED of them has ended (a
# router restarted and its NAT forgot the connection, or the peer is gone)
PING_EVERY = 10.0
PINGS_MISSED = 3
MAX_REGISTRATIONS = 256
MAX_PAIRINGS = 64
MAX_SPLICES = 64
CONTROL_LIMITS = Limits(max_frame_bytes=4096)
SPLICE_HIGH_WATER = 1 << 20  # bytes queued towards one side before the other side's reads pause


class Op(StrEnum):
    """The messages of a relay's control links."""

    REGISTER = "register"  # peer -> relay: tell me of peers that want a link to me
    REGISTERED = "registered"  # relay -> peer: {seen: the address your link comes from}
    CONNECT = "connect"  # peer -> relay: {to: peer id, mode}
    PAIRING = "pairing"  # relay -> peer: {token}: connect to me with it
    INCOMING = "incoming"  # relay -> registered peer: {from: peer id, token, mode}
    REFUSED = "refused"  # relay -> peer: {reason}
    PING = "ping"  # registered peer -> relay, every PING_EVERY: keeps its NAT's mapping (and tells it is alive)
    PONG = "pong"  # relay -> registered peer


class PairMode(StrEnum):
    PUNCH = "punch"  # the relay only introduces: the two peers connect to each other
    RELAY = "relay"  # the relay carries the link


def pair_signed(token: bytes, peer: str, seen: str) -> bytes:
    """What a relay signs in a pairing's answer: the other side's address and the one it sees you at."""
    return b"|".join([b"pipeswarm-pair/1", token, peer.encode(), seen.encode()])


def host_port(address: Any) -> tuple[str, int] | None:
    """`"host:port"` from a peer (bounded, checked) as a tuple; None if it is not one."""
    if not isinstance(address, str) or len(address) > 64 or ":" not in address:
        return None
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def format_address(peername: Any) -> str:
    return f"{peername[0]}:{peername[1]}" if isinstance(peername, tuple) and len(peername) >= 2 else ""


class ControlLink:
    """A sealed direct link carrying a relay's control messages (msgpack maps, one per frame)."""

    def __init__(self, link: SealedLink, queue_limit: int = 16):
        self.link = link
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(queue_limit)
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        link.start(self._on_frame, self._on_closed, CONTROL_LIMITS)

    def _on_frame(self, frame: bytes | memoryview) -> None:
        try:
            message = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=False)
        except Exception:  # msgpack raises several unrelated types on junk
            message = None
        if not isinstance(message, dict) or message.get("op") not in set(Op) or self._queue.full():
            self.link.close()  # junk, or more than a well-behaved peer ever leaves unanswered
            return
        self._queue.put_nowait(message)

    def _on_closed(self, error: BaseException | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def send(self, op: Op, **fields: Any) -> None:
        self.link.send_frame(msgpack.packb({"op": op.value, **fields}, use_bin_type=True))

    async def receive(self, timeout: float | None = CONTROL_TIMEOUT) -> dict[str, Any]:
        """The next message; DirectLinkError if the link closes first, TimeoutError after `timeout`."""
        getting = asyncio.ensure_future(self._queue.get())
        done, _ = await asyncio.wait({getting, self.closed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if getting in done:
            return getting.result()
        getting.cancel()
        if self.closed.done():
            raise DirectLinkError("the control link closed")
        raise TimeoutError("no answer on the control link")

    def close(self) -> None:
        self.link.close()


class BudgetSpent(Exception):
    pass


@dataclass
class RelayBudget:
    """What the relay's operator lets it carry: `total` bytes in all, at `rate` bytes a second."""

    total: int
    rate: float
    used: int = 0
    _allowance: float = 0.0
    _updated: float = field(default_factory=time.monotonic)

    @property
    def left(self) -> int:
        return max(self.total - self.used, 0)

    def take(self, size: int, now: float | None = None) -> float:
        """Charge `size` bytes; the seconds to wait before carrying more (the rate), or BudgetSpent."""
        if self.used + size > self.total:
            raise BudgetSpent(f"the relay's budget of {self.total} bytes is spent")
        now = time.monotonic() if now is None else now
        self._allowance = min(self._allowance + (now - self._updated) * self.rate, self.rate)  # one second's burst
        self._updated = now
        self.used += size
        self._allowance -= size
        return 0.0 if self._allowance >= 0 else -self._allowance / self.rate


class _SpliceSide(asyncio.Protocol):
    """One of the two connections a relay splices: what arrives goes to the other side as it is."""

    def __init__(self, splice: _Splice, index: int):
        self.splice, self.index = splice, index

    def data_received(self, data: bytes) -> None:
        self.splice.carry(self.index, data)

    def eof_received(self) -> bool:
        self.splice.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.splice.close()

    def pause_writing(self) -> None:
        self.splice.pause(1 - self.index, "backlog")

    def resume_writing(self) -> None:
        self.splice.resume(1 - self.index, "backlog")


class _Splice:
    """Two connections joined byte for byte, charged to the relay's budget."""

    def __init__(self, relay: Relay, links: tuple[SealedLink, SealedLink]):
        self.relay = relay
        self.transports = [link.transport() for link in links]
        self._paused: list[set[str]] = [set(), set()]
        self.closed = False
        for index, transport in enumerate(self.transports):
            transport.set_write_buffer_limits(high=SPLICE_HIGH_WATER)
            transport.set_protocol(_SpliceSide(self, index))
        for index, link in enumerate(links):  # bytes that came in with the pairing message
            if leftover := link.take_received():
                self.carry(index, leftover)

    def carry(self, index: int, data: bytes) -> None:
        if self.closed:
            return
        try:
            wait = self.relay.budget.take(len(data))
        except BudgetSpent as e:
            logger.info(f"relay: a spliced link ends: {e}")
            self.close()
            return
        self.relay.stats.relayed_bytes += len(data)
        self.transports[1 - index].write(data)
        if wait > 0:
            self.pause(index, "rate")
            asyncio.get_running_loop().call_later(wait, self.resume, index, "rate")

    def pause(self, index: int, why: str) -> None:
        if not self._paused[index] and not self.closed:
            self.transports[index].pause_reading()
        self._paused[index].add(why)

    def resume(self, index: int, why: str) -> None:
        self._paused[index].discard(why)
        if not self._paused[index] and not self.closed:
            self.transports[index].resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.relay.splices.discard(self)
            for transport in self.transports:
                transport.close()


@dataclass
class _Pairing:
    mode: PairMode
    tokens: tuple[bytes, bytes]  # (the asker's, the registered peer's)
    peers: tuple[str, str]
    expires: float
    arrived: dict[int, SealedLink] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class RelayStats:
    introduced: int = 0  # pairings of either mode completed
    spliced: int = 0  # of those, links the relay carried
    refused: int = 0
    relayed_bytes: int = 0


class Relay:
    """The relay side of NAT traversal, on this peer's direct-link listener (`attach`)."""

    def __init__(self, identity: Identity, swarm_id: str, budget: RelayBudget):
        self.identity, self.swarm_id, self.budget = identity, swarm_id, budget
        self.stats = RelayStats()
        self.splices: set[_Splice] = set()
        self._registered: dict[str, ControlLink] = {}
        self._pairings: dict[bytes, tuple[_Pairing, int]] = {}

    def attach(self, direct: Any) -> None:
        """Serve registrations and requests on `direct` (node/p2p/direct.py DirectLinks), and its pairings."""
        direct.serve(self.swarm_id, RELAY_SERVICE, self._on_link)
        direct.on_pair = self._on_pair

    @property
    def registered(self) -> list[str]:
        return list(self._registered)

    async def _on_link(self, peer_id: str, link: SealedLink) -> None:
        control = ControlLink(link)
        try:
            first = await control.receive()
        except (TimeoutError, DirectLinkError):
            return
        if first["op"] == Op.REGISTER:
            await self._hold_registration(peer_id, control)
        elif first["op"] == Op.CONNECT:
            self._answer_connect(peer_id, control, first)
            with contextlib.suppress(TimeoutError, DirectLinkError):  # until the asker read it and left
                await control.receive(CONTROL_TIMEOUT)

    async def _hold_registration(self, peer_id: str, control: ControlLink) -> None:
        if len(self._registered) >= MAX_REGISTRATIONS and peer_id not in self._registered:
            control.send(Op.REFUSED, reason="this relay holds as many registrations as it takes")
            return
        previous = self._registered.get(peer_id)
        self._registered[peer_id] = control
        if previous is not None:
            previous.close()
        control.send(Op.REGISTERED, seen=format_address(control.link.get_extra_info("peername")))
        try:
            while True:
                if (await control.receive(PING_EVERY * PINGS_MISSED))["op"] == Op.PING:
                    control.send(Op.PONG)
        except (TimeoutError, DirectLinkError):
            control.close()
        finally:
            if self._registered.get(peer_id) is control:
                del self._registered[peer_id]

    def _answer_connect(self, asker: str, control: ControlLink, message: dict[str, Any]) -> None:
        to, mode = message.get("to"), message.get("mode")
        target = self._registered.get(to) if isinstance(to, str) else None
        refusal = None
        if mode not in set(PairMode):
            refusal = f"unknown mode {str(mode)[:16]!r}"
        elif target is None:
            refusal = f"{short_peer_id(str(to)[:64])} is not registered here"
        elif mode == PairMode.RELAY and (self.budget.left <= 0 or len(self.splices) >= MAX_SPLICES):
            refusal = "this relay's budget is spent" if self.budget.left <= 0 else "this relay carries enough links"
        elif len(self._pairings) >= 2 * MAX_PAIRINGS:
            self._expire()
            if len(self._pairings) >= 2 * MAX_PAIRINGS:
                refusal = "too many pairings in progress"
        if refusal is not None or target is None:
            self.stats.refused += 1
            control.send(Op.REFUSED, reason=refusal)
            return
        pairing = _Pairing(
            PairMode(mode),
            (secrets.token_bytes(TOKEN_BYTES), secrets.token_bytes(TOKEN_BYTES)),
            (asker, to),
            time.monotonic() + PAIR_TIMEOUT,
        )
        for side, token in enumerate(pairing.tokens):
            self._pairings[token] = (pairing, side)
        target.send(Op.INCOMING, **{"from": asker, "token": pairing.tokens[1], "mode": mode})
        control.send(Op.PAIRING, token=pairing.tokens[0])

    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, (p, _) in self._pairings.items() if p.expires < now]:
            del self._pairings[token]

    async def _on_pair(self, link: SealedLink, message: dict[str, Any]) -> None:
        """A pairing connection (its token read by DirectLinks): answered once its other side is in."""
        token = message.get(PAIR_KEY)
        entry = self._pairings.pop(token, None) if isinstance(token, bytes) else None
        if entry is None or entry[0].expires < time.monotonic():
            link.close()
            return
        pairing, side = entry
        pairing.arrived[side] = link
        if len(pairing.arrived) < 2:
            try:
                await asyncio.wait_for(pairing.done.wait(), max(pairing.expires - time.monotonic(), 0.01))
            except TimeoutError:
                link.close()
            return
        self._introduce(pairing)

    def _introduce(self, pairing: _Pairing) -> None:
        """Answer both sides of a complete pairing at once, then splice them or let them go."""
        links = (pairing.arrived[0], pairing.arrived[1])
        pairing.done.set()
        if any(link.transport().is_closing() for link in links):  # one side left while waiting
            for link in links:
                link.close()
            return
        seen = [format_address(link.get_extra_info("peername")) for link in links]
        for side, link in enumerate(links):
            token, other = pairing.tokens[side], seen[1 - side]
            answer = {
                "peer": other,
                "seen": seen[side],
                "mode": pairing.mode.value,
                "pk": self.identity.public_key,
                "sig": self.identity.sign(pair_signed(token, other, seen[side])),
            }
            link.write_handshake(msgpack.packb(answer, use_bin_type=True))
        self.stats.introduced += 1
        if pairing.mode == PairMode.RELAY:
            self.stats.spliced += 1
            self.splices.add(_Splice(self, links))
            logger.info(
                f"relay: carrying a link between {short_peer_id(pairing.peers[0])} and {short_peer_id(pairing.peers[1])}"
            )
        else:  # the peers punch: their connections here have served (the side closing first waits in TIME_WAIT)
            for link in links:
                link.close()

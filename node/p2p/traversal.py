"""A peer's own side of NAT traversal: links to peers behind NATs through a relay, and, when this
peer is behind one, registrations that let others reach it (the relay side and the protocol:
node/p2p/relay.py; docs/operations.md, "Peers behind NATs").

A link to a peer B behind a NAT is asked of a relay B is registered with (B's record lists them):
first a hole punch (mode PUNCH: the relay tells each side where the other's connection came from,
both connect at once from that port), then, if the punch does not connect within PUNCH_TIMEOUT,
the relay carries it (mode RELAY). Either way the result is an ordinary direct link: A runs the
initiator's handshake naming B, so only B can answer, and B serves it as any link it accepts.
After a failed punch with a peer, links to it go through the relay at once for a while
(PUNCH_RETRY_AFTER, doubled after each failure in a row), so one symmetric NAT costs one punch.

Every outcome is kept per peer (`PathLog`): the record announces the last path to each (`paths`),
`node status --json` and the dashboard's `reach` column show them, and the metrics count them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from dht.announcer import PeerAnnouncer
from dht.identity_keys import SignatureError, verify_signature
from dht.records import MAX_PATHS, LinkPath, PeerRecord, Reachability, short_peer_id
from dht.swarm_view import SwarmView
from node.p2p.direct import MAX_HANDSHAKE_BYTES, DirectLinks, direct_addresses_of, initiate
from node.p2p.relay import (
    PAIR_KEY,
    PING_EVERY,
    PINGS_MISSED,
    RELAY_SERVICE,
    ControlLink,
    Op,
    PairMode,
    host_port,
    pair_signed,
)
from node.p2p.sealed_link import DirectLinkError, SealedLink

logger = logging.getLogger(__name__)

# a simultaneous open that has not connected by then will not: a SYN the other NAT dropped (it came
# before the other side's own left) is resent 1 s and 3 s later, and a busy peer may start late
PUNCH_TIMEOUT = 6.0
PUNCH_RETRY_AFTER = 120.0  # seconds a peer's links skip the punch after it failed, doubled per failure in a row
PUNCH_RETRY_MAX = 3600.0
REGISTER_RETRY = (2.0, 60.0)  # backoff between registration attempts with one relay
MAX_RELAYS_USED = 2  # relays a peer behind a NAT registers with


class PunchFailed(DirectLinkError):
    """The relay introduced us, and no connection formed: the NATs in between defeat punching."""


@dataclass(frozen=True)
class RelayRoute:
    """A relay and where to dial it."""

    relay: str
    addresses: tuple[tuple[str, int], ...]


def relay_routes(record: PeerRecord | None, record_of: Callable[[str], PeerRecord | None]) -> list[RelayRoute]:
    """The relays through which the peer `record` describes can be reached: those it announces it is
    registered with that announce a budget and a direct address of their own."""
    if record is None or record.reachability != Reachability.RELAYED:
        return []
    routes = []
    for relay in record.relays:
        relay_record = record_of(relay)
        addresses = direct_addresses_of(relay_record)
        if relay_record is not None and relay_record.relay_budget > 0 and addresses:
            routes.append(RelayRoute(relay, tuple(addresses)))
    return routes


def relay_candidates(records: Sequence[PeerRecord], own_id: str) -> list[RelayRoute]:
    """Relays a peer behind a NAT may register with, the ones with most budget left first."""
    ranked = sorted(
        (r for r in records if r.peer_id != own_id and r.relay_budget > 0 and direct_addresses_of(r)),
        key=lambda r: (-r.relay_budget, r.peer_id),
    )
    return [RelayRoute(r.peer_id, tuple(direct_addresses_of(r))) for r in ranked]


class PathLog:
    """The outcome of this peer's links to each peer behind a NAT: counts, and the last path."""

    def __init__(self, remember: int = 1024):
        self.remember = remember
        self.counts = {kind: 0 for kind in LinkPath}
        self.punch_failures = 0
        self._last: OrderedDict[str, LinkPath] = OrderedDict()
        self._skip_punch: dict[str, tuple[float, int]] = {}  # peer -> (until, failures in a row)

    def record(self, peer_id: str, kind: LinkPath) -> bool:
        """Count a link's path; whether it differs from the last one to that peer."""
        self.counts[kind] += 1
        changed = self._last.get(peer_id) != kind
        self._last[peer_id] = kind
        self._last.move_to_end(peer_id)
        while len(self._last) > self.remember:
            self._last.popitem(last=False)
        return changed

    def punch_failed(self, peer_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.punch_failures += 1
        failures = self._skip_punch.get(peer_id, (0.0, 0))[1] + 1
        self._skip_punch[peer_id] = (now + min(PUNCH_RETRY_AFTER * 2 ** (failures - 1), PUNCH_RETRY_MAX), failures)
        if len(self._skip_punch) > self.remember:
            self._skip_punch.pop(next(iter(self._skip_punch)))

    def punched(self, peer_id: str) -> None:
        self._skip_punch.pop(peer_id, None)

    def worth_punching(self, peer_id: str, now: float | None = None) -> bool:
        skip = self._skip_punch.get(peer_id)
        return skip is None or (time.monotonic() if now is None else now) >= skip[0]

    def announced(self) -> dict[str, str]:
        """The last path to each of the most recent peers, for the record."""
        return {peer: kind.value for peer, kind in list(self._last.items())[-MAX_PATHS:]}


def _bound_socket(port: int = 0) -> socket.socket:
    """A non-blocking TCP socket bound to `port` (0: any), which another socket may bind to as well:
    the punch leaves from the port of the connection the relay saw."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setblocking(False)
    sock.bind(("0.0.0.0", port))
    return sock


async def _connected_link(sock: socket.socket, address: tuple[str, int], timeout: float) -> SealedLink:
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(loop.sock_connect(sock, address), timeout)
        _, link = await loop.create_connection(SealedLink, sock=sock)
    except BaseException:
        sock.close()
        raise
    return link


@dataclass(frozen=True)
class PairAnswer:
    link: SealedLink  # the connection to the relay (spliced to the peer in mode RELAY)
    local_port: int
    peer: tuple[str, int]  # where the relay sees the other side's connection come from
    seen: str  # where it sees ours come from


async def pair(relay: str, relay_address: tuple[str, int], token: bytes, timeout: float) -> PairAnswer:
    """Our side of a pairing: a connection to the relay from a port of its own, the token, and the
    relay's signed answer once the other side is in too."""
    sock = _bound_socket()
    local_port = sock.getsockname()[1]
    link = await _connected_link(sock, relay_address, timeout)
    try:
        link.write_handshake(msgpack.packb({PAIR_KEY: token}, use_bin_type=True))
        raw = await asyncio.wait_for(link.read_handshake(MAX_HANDSHAKE_BYTES, "pairing answer"), timeout)
        answer = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=False)
        if not isinstance(answer, dict):
            raise DirectLinkError("the pairing answer is not a map")
        peer, seen, public_key, signature = (answer.get(k) for k in ("peer", "seen", "pk", "sig"))
        if not all(isinstance(v, str) for v in (peer, seen)) or not all(
            isinstance(v, bytes) for v in (public_key, signature)
        ):
            raise DirectLinkError("the pairing answer lacks its fields")
        try:
            signer = verify_signature(public_key, signature, pair_signed(token, peer, seen))
        except SignatureError as e:
            raise DirectLinkError(f"the pairing answer's signature does not verify: {e}") from None
        if signer != relay or (address := host_port(peer)) is None:
            raise DirectLinkError("the pairing answer is not the relay's, or names no address")
    except BaseException:
        link.close()
        raise
    return PairAnswer(link, local_port, address, seen)


async def punch(local_port: int, address: tuple[str, int], timeout: float) -> SealedLink:
    """Connect from `local_port` to `address` while the other side connects to us (simultaneous open).
    A NAT drops a SYN that arrives before the other side's own left (TCP resends it after a second);
    without a NAT in between the other host refuses it instead, so a refused attempt is tried again."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await _connected_link(_bound_socket(local_port), address, max(deadline - time.monotonic(), 0.01))
        except ConnectionRefusedError:
            if time.monotonic() + 0.1 >= deadline:
                raise
            await asyncio.sleep(random.uniform(0.01, 0.05))


async def punch_back(local_port: int, address: tuple[str, int], timeout: float) -> SealedLink:
    """The registered side's punch: connect as `punch` does, and listen on the same port meanwhile,
    so the other side's SYN is taken whether it arrives before our own connect or after it failed.
    Both ends share one port pair, so at most one connection forms, whichever way."""
    loop = asyncio.get_running_loop()
    listener = _bound_socket(local_port)
    listener.listen(1)
    accepting = asyncio.ensure_future(loop.sock_accept(listener))
    connecting = asyncio.ensure_future(punch(local_port, address, timeout))
    try:
        done, _ = await asyncio.wait({accepting, connecting}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if connecting in done and connecting.exception() is None:
            return connecting.result()
        if accepting in done:
            connection, _ = accepting.result()
            connection.setblocking(False)
            _, link = await loop.create_connection(SealedLink, sock=connection)
            return link
        if connecting in done:
            return connecting.result()  # raises how the connect failed
        raise TimeoutError(f"no punched connection with {address[0]}:{address[1]} within {timeout:.0f} s")
    finally:
        listener.close()
        for task in (accepting, connecting):
            task.cancel()  # the other way never completes: one port pair holds one connection


class Traversal:
    """Links through relays for this peer's DirectLinks, and its registrations when behind a NAT."""

    def __init__(self, direct: DirectLinks, swarm_id: str):
        self.direct, self.swarm_id = direct, swarm_id
        self.paths = PathLog()
        self.relays_of: Callable[[str], list[RelayRoute]] = lambda peer_id: []  # set by the stage service
        self.registered: dict[str, str] = {}  # relay -> the address it sees our registration come from
        self._tasks: set[asyncio.Task] = set()
        direct.traversal = self

    def reaches(self, peer_id: str) -> bool:
        return bool(self.relays_of(peer_id))

    # -- links to peers behind NATs ------------------------------------------------------------------

    async def open(self, peer_id: str, service: str, timeout: float) -> SealedLink:
        """A direct link to `peer_id` (behind a NAT) for `service`: punched, else relayed."""
        deadline = time.monotonic() + timeout
        errors = []
        for route in self.relays_of(peer_id)[:MAX_RELAYS_USED]:
            modes = [PairMode.PUNCH, PairMode.RELAY] if self.paths.worth_punching(peer_id) else [PairMode.RELAY]
            for mode in modes:
                if deadline - time.monotonic() <= 0.5:
                    break
                try:
                    link = await self._through(route, peer_id, service, mode, deadline)
                except (DirectLinkError, TimeoutError, ConnectionError, OSError) as e:
                    errors.append(f"{mode.value} via {short_peer_id(route.relay)}: {e!r:.160}")
                    if isinstance(e, PunchFailed):  # the NATs in between (not the relay, not a refusal)
                        logger.info(f"no hole punched to {short_peer_id(peer_id)}: {e}; its links go through the relay")
                        self.paths.punch_failed(peer_id)
                    continue
                kind = LinkPath.PUNCHED if mode == PairMode.PUNCH else LinkPath.RELAYED
                if mode == PairMode.PUNCH:
                    self.paths.punched(peer_id)
                log = logger.info if self.paths.record(peer_id, kind) else logger.debug  # each change once
                log(
                    f"{service} to {short_peer_id(peer_id)}: a {kind.value} direct link via {short_peer_id(route.relay)}"
                )
                return link
        self.paths.record(peer_id, LinkPath.FAILED)
        raise DirectLinkError(f"no link to {short_peer_id(peer_id)} through a relay: {'; '.join(errors) or 'no relay'}")

    async def _through(
        self, route: RelayRoute, peer_id: str, service: str, mode: PairMode, deadline: float
    ) -> SealedLink:
        left = deadline - time.monotonic()
        control = ControlLink(await self.direct.open(route.relay, route.addresses, self.swarm_id, RELAY_SERVICE, left))
        try:
            control.send(Op.CONNECT, to=peer_id, mode=mode.value)
            answer = await control.receive(min(deadline - time.monotonic(), 5.0))
            if answer["op"] != Op.PAIRING or not isinstance(answer.get("token"), bytes):
                raise DirectLinkError(f"the relay refused: {str(answer.get('reason'))[:200]}")
            relay_address = control.link.get_extra_info("peername")[:2]
            paired = await pair(route.relay, relay_address, answer["token"], deadline - time.monotonic())
        finally:
            control.close()
        link = paired.link
        try:
            if mode == PairMode.PUNCH:
                link.close()
                try:
                    link = await punch(paired.local_port, paired.peer, min(PUNCH_TIMEOUT, deadline - time.monotonic()))
                except (TimeoutError, OSError) as e:
                    raise PunchFailed(f"{paired.peer[0]}:{paired.peer[1]} did not connect: {e!r:.120}") from None
            return await asyncio.wait_for(
                initiate(link, self.direct.identity, peer_id, self.swarm_id, service, self.direct.swarm_key),
                max(deadline - time.monotonic(), 0.01),
            )
        except BaseException:
            link.close()
            raise

    # -- being reached behind a NAT ------------------------------------------------------------------

    async def keep_registered(
        self, candidates: Callable[[], list[RelayRoute]], on_change: Callable[[list[str]], None]
    ) -> None:
        """Hold registrations with up to MAX_RELAYS_USED relays among `candidates()`, replacing any
        that ends; `on_change` hears the relays registered with (the record announces them)."""
        holding: dict[str, asyncio.Task] = {}
        backoff: dict[str, tuple[float, float]] = {}  # relay -> (not before, next delay)
        try:
            while True:
                for relay, task in list(holding.items()):
                    if task.done():
                        del holding[relay]
                        if not task.cancelled() and task.result():  # it held: the next one is tried soon
                            backoff.pop(relay, None)
                now = time.monotonic()
                for route in candidates():
                    if len(holding) >= MAX_RELAYS_USED:
                        break
                    if route.relay in holding or backoff.get(route.relay, (0.0, 0.0))[0] > now:
                        continue
                    delay = backoff.get(route.relay, (0.0, REGISTER_RETRY[0]))[1]
                    backoff[route.relay] = (now + delay, min(delay * 2, REGISTER_RETRY[1]))
                    holding[route.relay] = asyncio.create_task(self._registration(route, on_change))
                await asyncio.sleep(1.0)
        finally:
            for task in holding.values():
                task.cancel()

    async def _registration(self, route: RelayRoute, on_change: Callable[[list[str]], None]) -> bool:
        """Hold one registration until it ends; whether the relay took it."""
        try:
            link = await self.direct.open(route.relay, route.addresses, self.swarm_id, RELAY_SERVICE, 10.0)
        except DirectLinkError as e:
            logger.info(f"cannot register with relay {short_peer_id(route.relay)}: {e}")
            return False
        control = ControlLink(link)
        try:
            control.send(Op.REGISTER)
            answer = await control.receive()
            if answer["op"] != Op.REGISTERED:
                logger.info(f"relay {short_peer_id(route.relay)} refused us: {str(answer.get('reason'))[:200]}")
                return False
            self.registered[route.relay] = str(answer.get("seen"))[:64]
            on_change(list(self.registered))
            logger.info(f"registered with relay {short_peer_id(route.relay)}, which sees us at {answer.get('seen')}")
            relay_address = link.get_extra_info("peername")[:2]
            # a ping every PING_EVERY, however busy the link: it keeps our NAT's mapping, tells the
            # relay we are here, and its answers tell us the relay still is
            heard = next_ping = time.monotonic()
            while True:
                try:
                    message = await control.receive(max(next_ping - time.monotonic(), 0.01))
                except TimeoutError:
                    message = None
                now = time.monotonic()
                if message is not None:
                    heard = now
                    if message["op"] == Op.INCOMING:
                        self._spawn(self._answer_incoming(route.relay, relay_address, message))
                if now >= next_ping:
                    if now - heard > PING_EVERY * PINGS_MISSED:
                        logger.info(f"relay {short_peer_id(route.relay)} stopped answering: registering again")
                        break
                    control.send(Op.PING)
                    next_ping = now + PING_EVERY
        except (DirectLinkError, TimeoutError) as e:
            logger.info(f"registration with relay {short_peer_id(route.relay)} ended: {e}")
        finally:
            control.close()
            if self.registered.pop(route.relay, None) is not None:
                on_change(list(self.registered))
        return True

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer_incoming(self, relay: str, relay_address: tuple[str, int], message: dict[str, Any]) -> None:
        """The registered side of a pairing: punch back, or take the relayed connection; then serve
        the link as any accepted one (its initiator's hello decides the service)."""
        token, mode, asker = message.get("token"), message.get("mode"), message.get("from")
        if not isinstance(token, bytes) or mode not in set(PairMode) or not isinstance(asker, str):
            return
        try:
            paired = await pair(relay, relay_address, token, 10.0)
            link = paired.link
            if mode == PairMode.PUNCH:
                link.close()
                link = await punch_back(paired.local_port, paired.peer, PUNCH_TIMEOUT)
        except (DirectLinkError, TimeoutError, ConnectionError, OSError) as e:
            logger.info(f"a {mode} link from {short_peer_id(asker[:64])} via {short_peer_id(relay)} failed: {e!r:.200}")
            return
        kind = LinkPath.PUNCHED if mode == PairMode.PUNCH else LinkPath.RELAYED
        # each change once, as the opener logs its own: both sides open links to each other (hops go
        # both ways), so whichever side records a path first is the one that says so
        log = logger.info if self.paths.record(asker[:64], kind) else logger.debug
        log(f"from {short_peer_id(asker[:64])}: a {kind.value} direct link via {short_peer_id(relay)}")
        with contextlib.suppress(Exception):
            await self.direct.accept(link)


async def serve_traversal(traversal: Traversal, view: SwarmView, me: PeerAnnouncer, period: float = 5.0) -> None:
    """A stage service's NAT traversal: links to peers behind NATs through the relays their records
    name; while this peer is behind one, registrations with relays of the swarm; and the record
    announcing both (`relays`, `paths`)."""
    traversal.relays_of = lambda peer_id: relay_routes(view.record_of(peer_id), view.record_of)

    def candidates() -> list[RelayRoute]:
        if me.reachability != Reachability.RELAYED:
            return []
        return relay_candidates([p for peers in view.peers_by_stage.values() for p in peers], me.peer_id)

    registering = asyncio.create_task(traversal.keep_registered(candidates, me.set_relays), name="relay-registrations")
    try:
        while True:
            me.set_paths(traversal.paths.announced())
            await asyncio.sleep(period)
    finally:
        registering.cancel()
        traversal.relays_of = lambda peer_id: []

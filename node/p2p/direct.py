"""Direct links: pipeline channels over a TCP connection of their own, authenticated by the peers'
libp2p keys and encrypted, instead of through two p2pd daemons.

Why: a pipeline hop through p2pd crosses four unix-socket legs and two Go daemons (Noise, yamux).
Profiled on this repository's 2-core machine (docs/changes.md, 49e685b), relaying a 3 x 1
swarm's 12 frames per microbatch cost ~8.8 ms of p2pd CPU and most of ~17.5 ms of event-loop CPU,
against ~26 ms of torch for the whole model; a raw TCP round trip of the same 128 KiB costs
~0.1 ms. So peers that can reach each other directly carry their channels (node/p2p/channels.py)
on a TCP connection each (and their sessions too, to peers behind NATs: node/p2p/link_stream.py). A
peer behind a NAT is reached by a link punched or carried through a relay it is registered with
(node/p2p/traversal.py, relay.py); one that cannot be reached directly at all (a firewall, an old
version) is reached through p2pd as before.

What the link guarantees is what a libp2p connection does (docs/security.md, "Direct links"):
- *authentication*: each side proves it holds the RSA key its peer id is the hash of, by signing
  its ephemeral X25519 key; the initiator names the peer it means to reach and accepts only that
  peer's signature, so a wrong address or a man in the middle fails instead of reaching an impostor;
- *confidentiality and integrity*: every record is sealed with AES-256-GCM under keys derived
  (HKDF-SHA256) from the X25519 secret and the handshake transcript, with a per-direction counter
  nonce, so nothing can be read, altered, replayed, dropped or reordered unnoticed;
- *private swarms*: the swarm key salts the key derivation, so without it no record opens (and
  every message inside still carries its MAC, protocol/framing.py).

The handshake (two messages, the initiator's first so the listener verifies before it signs):

    I -> L  hello  {v, swarm, service, to: L's peer id, time, eph: I's X25519 key, pk: I's key,
                    sig: I signs LABEL|"initiator"|swarm|service|to|time|eph}
    L -> I  accept {eph: L's X25519 key, pk: L's key, sig: L signs LABEL|"listener"|sha256(hello)|eph}

A replayed hello gets nowhere (its sender cannot derive the keys without I's ephemeral secret), and
the listener refuses a hello it has seen or whose time is off by more than HELLO_WINDOW before it
spends an RSA signature on it. Every handshake message is bounded (MAX_HANDSHAKE_BYTES, checked
before it is read), every step has a deadline, and at most MAX_PENDING_HANDSHAKES run at once.
After the handshake the link is a channel like any other: the same frames, limits, per-request
admission, rate and strikes (node/p2p/channels.py, ChannelServer), on the sealed records of
node/p2p/sealed_link.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from dht.identity_keys import Identity, SignatureError, verify_signature
from dht.records import CIRCUIT, PeerRecord, Reachability, short_peer_id
from node.p2p import sealed_link
from node.p2p.relay import PAIR_KEY
from node.p2p.sealed_link import DirectLinkError, SealedLink


class NatTraversal(Protocol):
    """What DirectLinks asks of NAT traversal (node/p2p/traversal.py, which builds on this module)."""

    def reaches(self, peer_id: str) -> bool: ...

    async def open(self, peer_id: str, service: str, timeout: float) -> SealedLink: ...


logger = logging.getLogger(__name__)

DIRECT_VERSION = 1
LABEL = b"pipeswarm-direct/1"
HANDSHAKE_TIMEOUT = 5.0  # seconds for each side's whole handshake
CONNECT_TIMEOUT = 3.0  # for the TCP connect of one address (an unreachable peer falls back to p2pd)
MAX_HANDSHAKE_BYTES = 4096  # an RSA-4096 key (~550 B) and signature (512 B) fit with room to spare
MAX_PENDING_HANDSHAKES = 16
HELLO_WINDOW = 120.0  # seconds a hello's clock may differ from ours (hellos seen within it are refused again)
# a peer whose direct link failed is reached through p2pd for FAILED_FOR seconds, doubled after each
# failure in a row up to FAILED_FOR_MAX: a direct port that is closed (a router forwarding only the
# libp2p port) then costs a connect timeout every half hour, not every minute
FAILED_FOR = 60.0
FAILED_FOR_MAX = 1800.0


# -- the handshake -------------------------------------------------------------------------------


async def _read_message(link: SealedLink, what: str) -> tuple[bytes, dict[str, Any]]:
    """One length-prefixed msgpack map of the handshake (its length checked before it is read)."""
    raw = await link.read_handshake(MAX_HANDSHAKE_BYTES, what)
    try:
        message = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=False)
    except Exception as e:  # msgpack raises several unrelated types on junk
        raise DirectLinkError(f"{what} is not msgpack ({type(e).__name__})") from None
    if not isinstance(message, dict):
        raise DirectLinkError(f"{what} is not a map")
    return raw, message


def _field(message: dict[str, Any], name: str, kind: type, what: str, size: int | None = None) -> Any:
    value = message.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise DirectLinkError(f"{what}: field {name!r} is not a {kind.__name__}")
    if size is not None and len(value) != size:
        raise DirectLinkError(f"{what}: field {name!r} has {len(value)} bytes, not {size}")
    return value


def _write_message(link: SealedLink, message: dict[str, Any]) -> bytes:
    raw = msgpack.packb(message, use_bin_type=True)
    link.write_handshake(raw)
    return raw


def _initiator_signed(swarm_id: str, service: str, to: str, sent_at: float, eph: bytes) -> bytes:
    return b"|".join(
        [LABEL, b"initiator", swarm_id.encode(), service.encode(), to.encode(), repr(sent_at).encode(), eph]
    )


def _listener_signed(hello: bytes, eph: bytes) -> bytes:
    return b"|".join([LABEL, b"listener", hashlib.sha256(hello).digest(), eph])


def _public_bytes(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def _session_keys(
    own: X25519PrivateKey, their_eph: bytes, hello: bytes, accept: bytes, swarm_key: bytes | None
) -> tuple[bytes, bytes]:
    """(initiator -> listener key, listener -> initiator key)."""
    try:
        shared = own.exchange(X25519PublicKey.from_public_bytes(their_eph))
    except ValueError as e:  # a low-order point: the exchange would give an all-zero secret
        raise DirectLinkError(f"unusable ephemeral key: {e}") from None
    transcript = hashlib.sha256(hello + accept).digest()
    okm = HKDF(hashes.SHA256(), 64, salt=swarm_key, info=LABEL + transcript).derive(shared)
    return okm[:32], okm[32:]


@dataclass(frozen=True)
class Hello:
    """A verified hello: who is asking, for which swarm and service."""

    peer_id: str
    swarm_id: str
    service: str


async def initiate(
    link: SealedLink,
    identity: Identity,
    peer_id: str,
    swarm_id: str,
    service: str,
    swarm_key: bytes | None,
) -> SealedLink:
    """The initiator's side: `link` sealed to `peer_id` (and only to it) for `service`, or DirectLinkError."""
    eph = X25519PrivateKey.generate()
    eph_public, sent_at = _public_bytes(eph), time.time()
    signed = _initiator_signed(swarm_id, service, peer_id, sent_at, eph_public)
    hello = _write_message(
        link,
        {
            "v": DIRECT_VERSION,
            "swarm": swarm_id,
            "service": service,
            "to": peer_id,
            "time": sent_at,
            "eph": eph_public,
            "pk": identity.public_key,
            "sig": identity.sign(signed),
        },
    )
    accept, message = await _read_message(link, "accept")
    their_eph = _field(message, "eph", bytes, "accept", 32)
    try:
        signer = verify_signature(
            _field(message, "pk", bytes, "accept"),
            _field(message, "sig", bytes, "accept"),
            _listener_signed(hello, their_eph),
        )
    except SignatureError as e:
        raise DirectLinkError(f"the listener's signature does not verify: {e}") from None
    if signer != peer_id:
        raise DirectLinkError(f"the listener is {short_peer_id(signer)}, not {short_peer_id(peer_id)}")
    to_listener, to_initiator = _session_keys(eph, their_eph, hello, accept, swarm_key)
    link.seal(to_listener, to_initiator)
    return link


class HelloGuard:
    """The listener's checks on a hello before it spends a signature on it."""

    def __init__(self, peer_id: str, window: float = HELLO_WINDOW, remember: int = 4096):
        self.peer_id, self.window, self.remember = peer_id, window, remember
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def check(self, message: dict[str, Any], now: float) -> Hello:
        if message.get("v") != DIRECT_VERSION:
            raise DirectLinkError(f"hello of version {str(message.get('v'))[:16]!r}, not {DIRECT_VERSION}")
        swarm_id = _field(message, "swarm", str, "hello")
        service = _field(message, "service", str, "hello")
        to = _field(message, "to", str, "hello")
        sent_at = _field(message, "time", float, "hello")
        eph = _field(message, "eph", bytes, "hello", 32)
        if to != self.peer_id:
            raise DirectLinkError(f"hello for {short_peer_id(to)}, and this is {short_peer_id(self.peer_id)}")
        if abs(now - sent_at) > self.window:
            raise DirectLinkError(f"hello sent {now - sent_at:+.0f} s from now (clock or replay)")
        while self._seen and (
            len(self._seen) >= self.remember or self._seen[next(iter(self._seen))] < now - self.window
        ):
            self._seen.popitem(last=False)
        if eph in self._seen:
            raise DirectLinkError("a hello seen before (replayed)")
        try:
            signer = verify_signature(
                _field(message, "pk", bytes, "hello"),
                _field(message, "sig", bytes, "hello"),
                _initiator_signed(swarm_id, service, to, sent_at, eph),
            )
        except SignatureError as e:
            raise DirectLinkError(f"the initiator's signature does not verify: {e}") from None
        self._seen[eph] = now
        return Hello(signer, swarm_id, service)


@dataclass(frozen=True)
class PairRequest:
    """The first message of a pairing connection to this peer as a relay (node/p2p/relay.py)."""

    message: dict[str, Any]


def direct_addresses(addrs: Sequence[str], port: int | None) -> list[tuple[str, int]]:
    """Where to open a direct link to a peer whose record lists `addrs` (its libp2p multiaddrs) and
    `port` (its direct-link port, None: it takes none): the IP hosts of its non-relayed TCP addresses."""
    if port is None:
        return []
    hosts: list[tuple[str, int]] = []
    for addr in addrs:
        parts = addr.split("/")
        if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or CIRCUIT in addr:
            continue
        if (parts[2], port) not in hosts:
            hosts.append((parts[2], port))
    return hosts


def direct_addresses_of(record: PeerRecord | None) -> list[tuple[str, int]]:
    """Where to open a direct link to the peer `record` describes: none behind a NAT (it holds
    relay reservations, so nobody can dial it; it is reached through p2pd and its relays)."""
    if record is None or record.reachability == Reachability.RELAYED:
        return []
    return direct_addresses(record.addrs, record.direct_port)


# -- one peer's listener and dialer --------------------------------------------------------------

LinkHandler = Callable[[str, SealedLink], Awaitable[None]]


class DirectLinks:
    """This peer's direct-link listener (one per process, beside its p2pd) and the side that opens
    links to others. Transports register the services they serve on it (node/p2p/transport.py)."""

    def __init__(self, identity: Identity, swarm_key: bytes | None = None):
        self.identity = identity
        self.swarm_key = swarm_key
        self.port: int | None = None
        self.opened = self.accepted = 0  # links set up, as initiator / as listener
        self._server: asyncio.Server | None = None
        self._handlers: dict[tuple[str, str], LinkHandler] = {}
        self._guard = HelloGuard(identity.peer_id)
        self._handshakes = asyncio.Semaphore(MAX_PENDING_HANDSHAKES)
        self._links: set[SealedLink] = set()
        self._failed: dict[str, tuple[float, int]] = {}  # peer -> (monotonic time until which p2pd is used, failures)
        # NAT traversal (node/p2p/traversal.py, relay.py): links to peers behind NATs through relays,
        # and, on a relay, the pairing connections that arrive on this listener
        self.traversal: NatTraversal | None = None
        self.on_pair: Callable[[SealedLink, dict[str, Any]], Awaitable[None]] | None = None

    async def listen(self, host: str, port: int = 0) -> int:
        """Start accepting links on `host`:`port` (0: any free port); returns the port."""
        self._server = await sealed_link.listen(self._accept, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def serve(self, swarm_id: str, service: str, handler: LinkHandler) -> None:
        self._handlers[(swarm_id, service)] = handler

    def unserve(self, swarm_id: str, service: str) -> None:
        self._handlers.pop((swarm_id, service), None)

    async def _accept(self, link: SealedLink) -> None:
        await self.accept(link)

    async def accept(self, link: SealedLink) -> None:
        """Serve `link` as an accepted direct link: the listener's handshake, then the handler of the
        service its hello asks for. A relay's pairing connection goes to the relay instead."""
        if self._handshakes.locked():  # a flood of half-open handshakes: refuse at once
            link.close()
            return
        try:
            async with self._handshakes:
                hello = await asyncio.wait_for(self._listener_handshake(link), HANDSHAKE_TIMEOUT)
        except (DirectLinkError, TimeoutError, ConnectionError, OSError) as e:
            logger.debug(f"refused a direct link from {link.get_extra_info('peername')}: {e}")
            link.close()
            return
        except Exception:  # a bug of ours: logged, and only this connection ends
            logger.exception(f"direct link handshake with {link.get_extra_info('peername')} failed")
            link.close()
            return
        if isinstance(hello, PairRequest):  # the relay owns the connection from here (node/p2p/relay.py)
            try:
                await self.on_pair(link, hello.message)  # type: ignore[misc]
            except (DirectLinkError, ConnectionError, OSError) as e:  # a side left mid-pairing
                logger.debug(f"a pairing from {link.get_extra_info('peername')} ended: {e!r}")
                link.close()
            return
        handler = self._handlers.get((hello.swarm_id, hello.service))
        if handler is None:  # the service stopped during the handshake (a stage move)
            link.close()
            return
        self.accepted += 1
        self._links.add(link)
        try:
            await handler(hello.peer_id, link)
        finally:
            self._links.discard(link)
            link.close()

    async def _listener_handshake(self, link: SealedLink) -> Hello | PairRequest:
        hello_bytes, message = await _read_message(link, "hello")
        if PAIR_KEY in message and self.on_pair is not None:
            return PairRequest(message)
        hello = self._guard.check(message, time.time())
        if (hello.swarm_id, hello.service) not in self._handlers:
            raise DirectLinkError(f"no direct {hello.service} service for swarm {hello.swarm_id[:40]!r} here")
        eph = X25519PrivateKey.generate()
        eph_public = _public_bytes(eph)
        accept = _write_message(
            link,
            {
                "eph": eph_public,
                "pk": self.identity.public_key,
                "sig": self.identity.sign(_listener_signed(hello_bytes, eph_public)),
            },
        )
        to_listener, to_initiator = _session_keys(eph, message["eph"], hello_bytes, accept, self.swarm_key)
        link.seal(to_initiator, to_listener)
        return hello

    def reaches_through_relay(self, peer_id: str) -> bool:
        """Whether `peer_id`, behind a NAT, is reached through a relay it announces (node/p2p/traversal.py)."""
        return self.traversal is not None and self.traversal.reaches(peer_id)

    def usable(self, peer_id: str) -> bool:
        """Whether to try a direct link to `peer_id` (not after one failed recently)."""
        failed = self._failed.get(peer_id)
        return failed is None or time.monotonic() >= failed[0]

    async def open(
        self, peer_id: str, addresses: Sequence[tuple[str, int]], swarm_id: str, service: str, timeout: float
    ) -> SealedLink:
        """A link to `peer_id` for `service` at the first of `addresses` that answers, within
        `timeout`; DirectLinkError (and p2pd for this peer during FAILED_FOR) if none does."""
        if not addresses and self.reaches_through_relay(peer_id):
            return await self.traversal.open(peer_id, service, timeout)  # behind a NAT: through a relay
        errors = []
        # bounded by our own deadlines too: the caller's timeout is for p2pd, which comes next if this fails
        deadline = time.monotonic() + min(timeout, CONNECT_TIMEOUT + HANDSHAKE_TIMEOUT)
        for host, port in addresses[:4]:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            link = None
            try:
                link = await asyncio.wait_for(sealed_link.connect(host, port), min(left, CONNECT_TIMEOUT))
                await asyncio.wait_for(
                    initiate(link, self.identity, peer_id, swarm_id, service, self.swarm_key),
                    max(deadline - time.monotonic(), 0.01),
                )
            except (DirectLinkError, TimeoutError, ConnectionError, OSError) as e:
                errors.append(f"{host}:{port}: {e!r}")
                if link is not None:
                    link.close()
                continue
            self.opened += 1
            self._failed.pop(peer_id, None)
            return link
        failures = self._failed.get(peer_id, (0.0, 0))[1] + 1
        self._failed[peer_id] = (time.monotonic() + min(FAILED_FOR * 2 ** (failures - 1), FAILED_FOR_MAX), failures)
        if len(self._failed) > 4096:  # bounded: forget the oldest half
            for stale in sorted(self._failed, key=lambda peer: self._failed[peer][0])[:2048]:
                del self._failed[stale]
        raise DirectLinkError(f"no direct link to {short_peer_id(peer_id)}: {'; '.join(errors) or 'no address'}")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

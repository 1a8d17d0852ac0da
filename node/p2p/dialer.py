"""Dial a peer at the addresses it announced, before opening a stream to it.

Without this, a stream to a peer relies on p2pd's own routing knowing that peer's addresses. It
often does (the DHT's traffic taught it), but not always: on hosts joined through a private or
unusual range we measured every stream fail with `routing: not found`, and a peer we have never
exchanged DHT traffic with may be unknown. Every peer therefore puts the multiaddrs it can be
reached at (its listen addresses, `--announce` ones, and `/p2p-circuit` ones through a relay when
it is behind a NAT) in its signed record (dht/records.py, `PeerRecord.addrs`), and `PeerDialer`
connects to them explicitly before the first stream, and again after a stream to the peer failed.

A peer behind a NAT cannot be dialed at all, so it dials out instead: `keep_connected` keeps a
connection open to every peer that may need to send it something (the stages next to it, its own
stage's gossip partners), re-dialing after a connection was pruned or dropped. libp2p connections
carry streams both ways, so those peers open their streams over the connection the home peer made.
Public peers run the same loop; for them it only saves the first stream a dial.

The addresses come from a signed record, so a stranger cannot point us at someone else's
addresses under an honest peer's id; and a libp2p connection authenticates the remote peer id, so
dialing a wrong address fails rather than reaching an impostor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import varint
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr  # hivemind vendors it; PyPI's multiaddr comes only with the test extra
from hivemind.utils.multiaddr.codecs import LENGTH_PREFIXED_VAR_SIZE
from hivemind.utils.multiaddr.transforms import bytes_iter

from dht.records import short_peer_id

logger = logging.getLogger(__name__)

AddressBook = Callable[[str], Sequence[str]]
MAX_DIAL_ADDRS = 16
_CIDV1_LIBP2P_KEY = b"\x01\x72"  # CID version 1, multicodec libp2p-key


def p2pd_multiaddr(addr: str) -> Multiaddr:
    """`addr` in the binary form p2pd reads, for its CONNECT request.

    hivemind's vendored multiaddr writes a /p2p/ peer id as a CIDv1 (0x01 0x72, then the multihash);
    p2pd's go-multiaddr reads a bare multihash there and refuses the whole request ("length greater
    than remaining number of bytes in buffer"). Every address we dial carries one (records announce
    `.../p2p/<id>`, relay circuits name the relay), so each is written with bare multihashes."""
    parts = []
    for _, proto, codec, part in bytes_iter(Multiaddr(addr).to_bytes()):
        if proto.name == "p2p" and part.startswith(_CIDV1_LIBP2P_KEY):
            part = part[len(_CIDV1_LIBP2P_KEY) :]
        parts.append(varint.encode(proto.code))
        if codec.SIZE == LENGTH_PREFIXED_VAR_SIZE:
            parts.append(varint.encode(len(part)))
        parts.append(part)
    return Multiaddr(b"".join(parts))


class PeerDialer:
    def __init__(self, p2p: P2P, addresses: AddressBook, fresh_for: float = 60.0, timeout: float = 10.0):
        self.p2p = p2p
        self.addresses = addresses
        self.fresh_for = fresh_for
        self.timeout = timeout
        self._dialed: dict[str, float] = {}  # peer -> monotonic time of the last successful dial
        self._dialing: dict[str, asyncio.Task] = {}

    def forget(self, peer_id: str) -> None:
        """A stream to `peer_id` failed: dial its announced addresses again next time."""
        self._dialed.pop(peer_id, None)

    async def ensure(self, peer_id: str) -> bool:
        """Dial `peer_id` at its announced addresses unless we did recently; False when that failed
        (the caller still tries its stream: p2pd may know a way the record does not)."""
        dialed = self._dialed.get(peer_id)
        if dialed is not None and time.monotonic() - dialed < self.fresh_for:
            return True
        task = self._dialing.get(peer_id)
        if task is None:  # one dial per peer at a time, however many streams wait for it
            task = self._dialing[peer_id] = asyncio.ensure_future(self._dial(peer_id))
            task.add_done_callback(lambda _: self._dialing.pop(peer_id, None))
        return await asyncio.shield(task)

    async def _dial(self, peer_id: str) -> bool:
        addrs = list(self.addresses(peer_id))[:MAX_DIAL_ADDRS]
        maddrs = []
        for addr in addrs:
            try:
                maddrs.append(p2pd_multiaddr(addr))
            except Exception:  # an unparsable address in a signed record: the peer's own mistake
                logger.debug(f"{short_peer_id(peer_id)} announced an unparsable address {addr[:80]!r}")
        if not maddrs:
            return False
        try:
            # hivemind's P2P has no public connect; its daemon client does
            await asyncio.wait_for(self.p2p._client.connect(PeerID.from_base58(peer_id), maddrs), self.timeout)
        except Exception as e:
            logger.debug(f"could not dial {short_peer_id(peer_id)} at {addrs}: {e!r}")
            return False
        self._dialed[peer_id] = time.monotonic()
        if len(self._dialed) > 4096:  # bounded: forget the oldest half
            for stale in sorted(self._dialed, key=self._dialed.get)[:2048]:  # type: ignore[arg-type]
                del self._dialed[stale]
        return True


async def keep_connected(dialer: PeerDialer, peers: Callable[[], Sequence[str]], period: float = 20.0) -> None:
    """Dial every peer `peers()` names at least every `dialer.fresh_for` seconds, one at a time."""
    while True:
        for peer_id in list(peers()):
            await dialer.ensure(peer_id)
        await asyncio.sleep(period)

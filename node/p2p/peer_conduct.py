"""How much of this node a remote peer may use, and what happens when it sends bad input.

Two separate concerns with one owner per peer:
- *limits*: concurrent incoming streams per peer, all incoming streams together, and a request
  rate per peer (a token bucket). The stream slots are sized from the process's open-file limit
  (`stream_slots`), and peers without a record in the swarm (strangers) share a quarter of them, so
  hoarded streams can neither use up the descriptors nor the slots members need. Over a limit the
  stream is refused at once; nothing is allocated for it.
- *conduct*: every malformed message, non-finite or absurd tensor, or forged reference to a
  microbatch is a strike. `strikes_to_ban` strikes within `strike_window` seconds ban the peer
  until its DHT record expires (SWARM bans the same way): its streams are refused at the door and
  routing avoids it. An honest peer's occasional bad message (a bug, a race) decays away.

Bans are kept in the node's one `BanList` (node/p2p/bans.py), which routing, gossip and the
spot-checks read and write too: a peer any of them banned (a hop sender for an ERROR reply, gossip
for a poisoned tensor, a spot-check for a wrong result) has its streams refused here, and a peer
banned here is avoided by all of them.
"""

from __future__ import annotations

import logging
import resource
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dht.records import short_peer_id
from node.p2p.bans import BanList

logger = logging.getLogger(__name__)


# Descriptors kept for the node's own files whatever the limit: the event loop's, the DHT's and
# the metrics server's sockets, p2pd's control sockets, logs, data files, direct-link listeners.
OWN_FILES = 128
# What is left is shared three ways: streams peers open to us (each one of our descriptors once p2pd
# hands it over), streams and direct links we open, and p2pd's own connections, since p2pd inherits
# the same limit and holds a descriptor for each stream it carries for us.
STREAM_SHARE = 3
MIN_TOTAL_STREAMS, MAX_TOTAL_STREAMS = 16, 1024  # more than 1024 would only cost memory (a task each)
# One identity may hold 1/HOARDERS of the slots: it takes that many identities to fill them. An
# honest peer holds one channel per pipeline service (forward, backward, abort; twice while a
# direct link replaces a p2pd one), a spot-check or two, a gossip round and a state download: 8
# leave room; 32 as before for a node with descriptors to spare.
HOARDERS = 16
MIN_STREAMS_PER_PEER, MAX_STREAMS_PER_PEER = 8, 32
STRANGER_SHARE = 4  # peers without a record in the swarm share 1/4 of the slots: members keep the rest


@dataclass(frozen=True)
class StreamSlots:
    """How many incoming streams this node admits at once, in all and to one peer."""

    total: int
    per_peer: int


def stream_slots(open_files: int | None = None) -> StreamSlots:
    """The slots an open-file soft limit of `open_files` (None: this process's) affords: at 1024,
    298 in all and 18 per peer; from 3200 on, 1024 and 32."""
    if open_files is None:
        open_files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if open_files == resource.RLIM_INFINITY:
        open_files = OWN_FILES + STREAM_SHARE * MAX_TOTAL_STREAMS
    total = min(MAX_TOTAL_STREAMS, max(MIN_TOTAL_STREAMS, (open_files - OWN_FILES) // STREAM_SHARE))
    return StreamSlots(total, min(MAX_STREAMS_PER_PEER, max(MIN_STREAMS_PER_PEER, total // HOARDERS)))


@dataclass(frozen=True)
class ConductLimits:
    """Per-peer and total limits on incoming streams (see docs/security.md)."""

    streams_per_peer: int | None = None
    """Concurrent incoming streams one peer may hold; None: from the open-file limit (stream_slots)."""
    total_streams: int | None = None
    """All incoming streams together; None: from the open-file limit (stream_slots)."""
    requests_per_second: float = 200.0
    """Sustained request rate per peer (token bucket refill)."""
    request_burst: int = 400
    """Requests a peer may send at once before the rate applies."""
    strikes_to_ban: int = 3
    """Bad messages within `strike_window` that ban the sender."""
    strike_window: float = 60.0
    """Seconds a strike counts."""
    min_ban_seconds: float = 30.0
    """A ban lasts at least this long, even when the peer's record is about to expire."""


def raise_fd_soft_limit(wanted: int = 65536) -> int:
    """Raise this process's file-descriptor soft limit towards `wanted` (never above the hard
    limit) and return the limit now in force: many peers and streams need many descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.info(f"could not raise the open-file limit from {soft}: {e}")
    return soft


class _Bucket:
    __slots__ = ("tokens", "updated")

    def __init__(self, tokens: float, now: float):
        self.tokens, self.updated = tokens, now


class PeerConduct:
    """Admission of incoming streams and strikes/bans for bad input, per remote peer."""

    def __init__(
        self,
        limits: ConductLimits | None = None,
        *,
        ban_until: Callable[[str], float] | None = None,
        bans: BanList | None = None,
        clock: Callable[[], float] = time.time,
        is_member: Callable[[str], bool] | None = None,
        open_files: int | None = None,
    ):
        """`bans`: the node's one ban store, shared with routing and gossip; None: a store of this
        conduct's own (the DHT guard, tests). `is_member`: whether a peer has a record in the swarm
        (None: every peer counts as one); `open_files`: the open-file limit the slots are sized
        from (None: this process's)."""
        self.limits = limits or ConductLimits()
        slots = stream_slots(open_files)
        self.total_streams = self.limits.total_streams or slots.total
        self.streams_per_peer = self.limits.streams_per_peer or slots.per_peer
        self.stranger_streams = max(1, self.total_streams // STRANGER_SHARE)
        self.is_member = is_member
        self.ban_until = ban_until or (lambda peer_id: 0.0)
        self.banlist = bans if bans is not None else BanList(clock=clock, min_seconds=self.limits.min_ban_seconds)
        self._clock = clock
        self._open: dict[str, int] = {}
        self._open_total = 0
        self._strangers: dict[str, int] = {}  # of `_open`, the slots taken from the strangers' share
        self._open_strangers = 0
        self._buckets: dict[str, _Bucket] = {}
        self._strikes: dict[str, deque[float]] = {}
        self.refused = 0  # streams refused at the door (limits or bans), for status and tests

    # -- bans --------------------------------------------------------------------------------
    def is_banned(self, peer_id: str) -> bool:
        """Whether `peer_id`'s streams are refused: evidence against it (node/p2p/bans.py)."""
        return self.banlist.refuses(peer_id)

    def bans(self) -> dict[str, tuple[float, str]]:
        """{peer: (until, reason)} of the bans in force, whoever imposed them."""
        return self.banlist.active()

    def strike(self, peer_id: str, reason: str) -> bool:
        """Count one piece of bad input from `peer_id`; True when this strike banned it."""
        now = self._clock()
        strikes = self._strikes.setdefault(peer_id, deque(maxlen=self.limits.strikes_to_ban))
        strikes.append(now)
        while strikes and now - strikes[0] > self.limits.strike_window:
            strikes.popleft()
        if len(strikes) < self.limits.strikes_to_ban or self.is_banned(peer_id):
            logger.info(f"strike {len(strikes)}/{self.limits.strikes_to_ban} for {short_peer_id(peer_id)}: {reason}")
            return False
        strikes.clear()
        self.ban(peer_id, f"repeated bad input: {reason}")
        return True

    def ban(self, peer_id: str, reason: str, at_least: float = 0.0) -> float:
        """Ban `peer_id` until its record expires, for at least `min_ban_seconds` and `at_least`
        seconds; returns until when. Also how evidence other than bad input bans a peer
        (spot-checks: node/pipeline/verifier.py)."""
        now = self._clock()
        until = self.banlist.ban(
            peer_id, max(self.ban_until(peer_id), now + max(self.limits.min_ban_seconds, at_least)), reason
        )
        logger.warning(f"banned {short_peer_id(peer_id)} for {until - now:.0f} s: {reason}")
        return until

    # -- admission ---------------------------------------------------------------------------
    def admit(self, peer_id: str, cost: float = 1.0) -> str | None:
        """Reserve a stream slot for `peer_id`, charging `cost` request tokens; None if admitted (call
        `release` when done), else why not."""
        stranger = self.is_member is not None and not self.is_member(peer_id)
        if self.is_banned(peer_id):
            reason = "banned for bad input"
        elif self._open_total >= self.total_streams:
            reason = "too many open streams"
        elif self._open.get(peer_id, 0) >= self.streams_per_peer:
            reason = "too many streams from this peer"
        elif stranger and self._open_strangers >= self.stranger_streams:
            reason = "too many open streams from peers without a record in the swarm"
        elif not self._take_tokens(peer_id, cost):
            reason = "request rate exceeded"
        else:
            self._open[peer_id] = self._open.get(peer_id, 0) + 1
            self._open_total += 1
            if stranger:
                self._strangers[peer_id] = self._strangers.get(peer_id, 0) + 1
                self._open_strangers += 1
            return None
        self.refused += 1
        return reason

    def charge(self, peer_id: str, cost: float = 1.0) -> str | None:
        """Charge one more request on a stream `admit` already let in (a long-lived channel carries
        many): None if it may be served, else why not (banned since, or over its rate)."""
        if self.is_banned(peer_id):
            reason = "banned for bad input"
        elif not self._take_tokens(peer_id, cost):
            reason = "request rate exceeded"
        else:
            return None
        self.refused += 1
        return reason

    def release(self, peer_id: str) -> bool:
        """Give back a slot `admit` gave `peer_id`; False, and no count changed, when it holds none
        (a release without its admit would free another peer's share of `total_streams`)."""
        count = self._open.get(peer_id, 0)
        if count <= 0:
            logger.debug(f"release of a stream {short_peer_id(peer_id)} was never admitted for: ignored")
            return False
        if count > 1:
            self._open[peer_id] = count - 1
        else:
            del self._open[peer_id]
        self._open_total -= 1
        # from the share it was taken from, even if the peer has published a record since
        strangers = self._strangers.get(peer_id, 0)
        if strangers > 1:
            self._strangers[peer_id] = strangers - 1
        elif strangers == 1:
            del self._strangers[peer_id]
        if strangers:
            self._open_strangers -= 1
        return True

    def open_streams(self, peer_id: str | None = None) -> int:
        return self._open_total if peer_id is None else self._open.get(peer_id, 0)

    def stranger_streams_open(self) -> int:
        """Of `open_streams()`, the slots held by peers that had no record when admitted."""
        return self._open_strangers

    def _take_tokens(self, peer_id: str, cost: float) -> bool:
        now = self._clock()
        bucket = self._buckets.get(peer_id)
        if bucket is None:
            if len(self._buckets) > 4 * self.total_streams:  # forget idle peers: the map stays bounded
                self._buckets = {p: b for p, b in self._buckets.items() if now - b.updated < 60.0}
            bucket = self._buckets[peer_id] = _Bucket(float(self.limits.request_burst), now)
        bucket.tokens = min(
            float(self.limits.request_burst), bucket.tokens + (now - bucket.updated) * self.limits.requests_per_second
        )
        bucket.updated = now
        if bucket.tokens < cost:
            return False
        bucket.tokens -= cost
        return True

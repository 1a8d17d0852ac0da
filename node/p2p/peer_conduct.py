"""How much of this node a remote peer may use, and what happens when it sends bad input.

Two separate concerns with one owner per peer:
- *limits*: concurrent incoming streams per peer, all incoming streams together (well under the
  process's file-descriptor limit) with a quarter of them for all peers that are not members,
  and a request rate per peer (a token bucket). Over a limit the stream is refused at once;
  nothing is allocated for it.
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


@dataclass(frozen=True)
class ConductLimits:
    """Per-peer and total limits on incoming streams (see docs/security.md)."""

    streams_per_peer: int = 32
    """Concurrent incoming streams one peer may hold (a pipeline peer needs ~2 x max_in_flight)."""
    total_streams: int | None = None
    """All incoming streams together; None: a quarter of the file-descriptor soft limit, at most 1024."""
    stranger_share: float = 0.25
    """The part of `total_streams` that peers which are not members (node/p2p/membership.py) may
    hold together: a stranger hoarding streams leaves the members three quarters."""
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


def default_total_streams() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(16, min(1024, soft // 4))


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
    ):
        """`bans`: the node's one ban store, shared with routing and gossip; None: a store of this
        conduct's own (the DHT guard, tests). `is_member`: whether a peer is a member now (its
        record and its answer to our ping); None: every peer counts as one (no strangers' share)."""
        self.limits = limits or ConductLimits()
        self.total_streams = self.limits.total_streams or default_total_streams()
        self.ban_until = ban_until or (lambda peer_id: 0.0)
        self.banlist = bans if bans is not None else BanList(clock=clock, min_seconds=self.limits.min_ban_seconds)
        self._clock = clock
        self._open: dict[str, int] = {}
        self._open_total = 0
        self.is_member = is_member
        self._strangers: dict[str, int] = {}  # streams admitted to a peer while it was no member
        self._strangers_total = 0
        self.strangers_cap = max(1, int(self.total_streams * self.limits.stranger_share))
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
        if self.is_banned(peer_id):
            reason = "banned for bad input"
        elif self._open_total >= self.total_streams:
            reason = "too many open streams"
        elif self._open.get(peer_id, 0) >= self.limits.streams_per_peer:
            reason = "too many streams from this peer"
        elif (stranger := self.is_member is not None and not self.is_member(peer_id)) and (
            self._strangers_total >= self.strangers_cap
        ):
            reason = "too many open streams from peers that are not members"
        elif not self._take_tokens(peer_id, cost):
            reason = "request rate exceeded"
        else:
            self._open[peer_id] = self._open.get(peer_id, 0) + 1
            self._open_total += 1
            if stranger:
                self._strangers[peer_id] = self._strangers.get(peer_id, 0) + 1
                self._strangers_total += 1
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
        if (as_stranger := self._strangers.get(peer_id, 0)) > 0:  # which of its streams: any, the counts agree
            if as_stranger > 1:
                self._strangers[peer_id] = as_stranger - 1
            else:
                del self._strangers[peer_id]
            self._strangers_total -= 1
        return True

    def open_streams(self, peer_id: str | None = None) -> int:
        return self._open_total if peer_id is None else self._open.get(peer_id, 0)

    def strangers_streams(self) -> int:
        """Streams held by peers admitted while they were not members."""
        return self._strangers_total

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

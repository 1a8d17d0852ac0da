"""The one store of this node's bans: every part that refuses or avoids a peer reads it, and every
part that has evidence against one writes it.

Stream admission (node/p2p/peer_conduct.py), routing (node/pipeline/routing.py), gossip
(node/averaging) and spot-checks (node/pipeline/verifier.py) once kept bans of their own, synced one
way, so a peer banned for bad gossip or by a hop sender still had its pipeline streams admitted. Now
the service builds one `BanList` and hands the same object to each of them.

Bans key on DHT time (the record expirations are DHT times: hivemind's `get_dht_time()`, i.e.
wall-clock `time.time`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

MIN_BAN_SECONDS = 10.0  # a ban lasts at least this long, even if the peer's record is about to expire


class BanList:
    """Peers that errored, each banned until a DHT time (its record's expiration, or later).

    SWARM bans an expert until the expiration of the DHT record it was found under, so a peer that
    keeps heartbeating comes back once a fresh record replaces the one it failed under, and a dead
    one never does. `min_seconds` keeps a ban from being a no-op when the record is about to expire
    (or its expiration is unknown: 0).
    """

    def __init__(self, clock: Callable[[], float] = time.time, min_seconds: float = MIN_BAN_SECONDS):
        self._clock = clock
        self._min_seconds = float(min_seconds)
        self._bans: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()
        self.total = 0  # bans imposed (a ban extended while it runs is not a new one): a metric

    def ban(self, peer_id: str, until: float, reason: str) -> float:
        """Ban `peer_id` until max(until, now + min_seconds); an existing longer ban is kept.
        Returns until when the ban now runs."""
        until = float(until) if until is not None and math.isfinite(float(until)) else 0.0
        until = max(until, self._clock() + self._min_seconds)
        with self._lock:
            previous = self._bans.get(peer_id)
            if previous is None or previous[0] <= self._clock():
                self.total += 1
            elif previous[0] > until:
                until = previous[0]
            self._bans[peer_id] = (until, str(reason))
        return until

    def is_banned(self, peer_id: str, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        with self._lock:
            entry = self._bans.get(peer_id)
            if entry is None:
                return False
            if entry[0] <= now:
                del self._bans[peer_id]
                return False
            return True

    def active(self, now: float | None = None) -> dict[str, tuple[float, str]]:
        """{peer_id: (until, reason)} of the bans still running (expired ones are dropped)."""
        now = self._clock() if now is None else now
        with self._lock:
            for peer_id in [p for p, (until, _) in self._bans.items() if until <= now]:
                del self._bans[peer_id]
            return dict(self._bans)

    def __len__(self) -> int:
        return len(self.active())

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

    Two weights of ban share the store. Evidence (bad input, a failed spot-check, implausible
    gossip) refuses the peer everywhere: its streams at the door, routing, gossip. A hop that
    failed or was refused only says the peer could not serve it (a connection reset, a peer that
    just moved stage): SWARM avoids such a peer until its record expires, and so do routing and
    gossip here, but its own streams are still admitted, since nothing it sent was wrong.
    """

    def __init__(self, clock: Callable[[], float] = time.time, min_seconds: float = MIN_BAN_SECONDS):
        self._clock = clock
        self._min_seconds = float(min_seconds)
        self._bans: dict[str, tuple[float, str, bool]] = {}  # peer -> (until, reason, evidence)
        self._lock = threading.Lock()
        self.total = 0  # bans imposed (a ban extended while it runs is not a new one): a metric

    def ban(self, peer_id: str, until: float, reason: str, *, evidence: bool = True) -> float:
        """Ban `peer_id` until max(until, now + min_seconds); an existing longer ban is kept, and so
        is evidence already held against the peer. `evidence=False`: avoid it (routing, gossip)
        without refusing its streams. Returns until when the ban now runs."""
        until = float(until) if until is not None and math.isfinite(float(until)) else 0.0
        until = max(until, self._clock() + self._min_seconds)
        with self._lock:
            previous = self._bans.get(peer_id)
            if previous is None or previous[0] <= self._clock():
                self.total += 1
            else:
                until, evidence = max(until, previous[0]), evidence or previous[2]
            self._bans[peer_id] = (until, str(reason), evidence)
        return until

    def _entry(self, peer_id: str, now: float | None) -> tuple[float, str, bool] | None:
        now = self._clock() if now is None else now
        with self._lock:
            entry = self._bans.get(peer_id)
            if entry is not None and entry[0] <= now:
                del self._bans[peer_id]
                return None
            return entry

    def is_banned(self, peer_id: str, now: float | None = None) -> bool:
        """Whether to avoid `peer_id` (route, gossip, check): any ban in force."""
        return self._entry(peer_id, now) is not None

    def refuses(self, peer_id: str, now: float | None = None) -> bool:
        """Whether to refuse `peer_id`'s streams: a ban for evidence against it in force."""
        entry = self._entry(peer_id, now)
        return entry is not None and entry[2]

    def active(self, now: float | None = None) -> dict[str, tuple[float, str]]:
        """{peer_id: (until, reason)} of the bans still running (expired ones are dropped)."""
        now = self._clock() if now is None else now
        with self._lock:
            for peer_id in [p for p, (until, _, _) in self._bans.items() if until <= now]:
                del self._bans[peer_id]
            return {peer_id: (until, reason) for peer_id, (until, reason, _) in self._bans.items()}

    def __len__(self) -> int:
        return len(self.active())

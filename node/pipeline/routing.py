"""SWARM's load-aware randomized choice of the next-stage peer (pure logic, no networking).

Reads beside Ryabinin et al., "SWARM Parallelism: Training Large Models Can Be Surprisingly
Communication-Efficient", ICML 2023 (code: yandex-research/swarm, `ExpertBalancer` in
swarm/pipeline/src/moe/client/balancer.py and `PerformanceEMA` in .../optim/performance_ema.py).

The released rule: per stage a min-heap of peers keyed by accumulated expected time; a task goes to
the peer with the smallest key, which then grows by task_size / measured throughput (an EMA with
alpha 0.1); random numbers only break ties; new peers enter at the current minimum; a peer that
errors is banned until its DHT record expires; a timeout retries on the next peer.

Made time-aware here (see docs/algorithms.md, "SWARM routing"). Per peer we keep

    virtual_finish  the clock time at which everything we sent it is expected to be done
    sec_per_unit    1 / the throughput the peer announces in its DHT record

and a task of size w goes to the peer with the earliest expected completion

    key(p) = max(virtual_finish_p, now) + w * sec_per_unit_p            (argmin, ties: rng)

after which virtual_finish_p = key(p). `max(., now)` makes the accumulated load decay with real time,
so a peer that sat idle holds no credit; once the stage is busy (every virtual_finish > now) this is
SWARM's accumulated-time rule, and the shares converge to throughput-proportional ones. Candidates
whose key is within TIE_RTOL (relative, on the key measured from now) of the smallest are
considered tied and one of them is drawn with the injected `random.Random`.

Where the speed comes from: SWARM's client times each call around the whole request. Our hops are
acknowledged as soon as the receiver has queued the work (so no peer waits for a round trip), which
means a hop's latency says nothing about the receiver's speed. Instead every peer measures its own
compute (an EMA of microbatches per second on its stage worker, node/stage/stage_worker.py) and
announces it in its record every heartbeat; the router follows the latest announcement on each
refresh. A peer that announces none starts from the median of its stage (1.0 if nothing is known).
Announcements are self-reported: a peer that lies about its speed only attracts or repels work it
then has to do (a wrong *result* is the spot-check's business, not routing's).

`RoutingMode.RANDOM` (`training.routing = "random"`) replaces the argmin by a uniform draw among the
same candidates (live, unbanned, not excluded), as NoLoCo's authors route every microbatch to the
next-stage replica given by a seeded random permutation (docs/algorithms.md, "What the authors
report"): it mixes gradients across replicas, which equal-speed load-aware routing (round-robin in
effect) does not. Loads are still charged and released, so `loads()` reads the same in every mode.

`RoutingMode.SHUFFLED` deals the candidates like a shuffled deck: a fresh random permutation, one
peer per microbatch, a new permutation when it is used up (a peer gone, banned or excluded meanwhile
is skipped). Each peer gets an equal share in random order, as the authors' per-microbatch
permutation gives each replica exactly one microbatch per step. Independent uniform draws (RANDOM)
give some replicas two microbatches of a step and others none, and so unequal inner-step counts
(docs/results.md, gossip). One router dealing for every sender (the simulator) is the authors'
permutation exactly; in a swarm every sender deals its own deck.

Timeouts are not errors: a hop that times out is retried on another peer with `exclude`, and only
a peer that errors is banned (SWARM's `use_another_expert`; node/pipeline/hops.py applies it).

Bans: `BanList` (node/p2p/bans.py, the node's one ban store) keys on DHT time (the record
expirations are DHT times: hivemind's `get_dht_time()`, i.e. wall-clock `time.time`), while
`StageRouter` keeps virtual finish times on its own monotonic clock; the two never meet.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from dht.records import PeerRecord
from node.config import RoutingMode
from node.p2p.bans import MIN_BAN_SECONDS, BanList

DEFAULT_THROUGHPUT = 1.0  # SWARM's initial_throughput, used when nothing is known about a stage
TIE_RTOL = 1e-9  # keys within this relative distance of the minimum are ties (drawn at random)
TIE_ATOL = 1e-12  # seconds: absolute floor of the tie window (keys of ~0)


def _usable_throughput(value: float | None) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value > 0.0 else None


class _PeerLoad:
    __slots__ = ("guessed", "sec_per_unit", "sidelined", "virtual_finish")

    def __init__(self, virtual_finish: float, sec_per_unit: float, guessed: bool):
        self.virtual_finish = virtual_finish
        self.sec_per_unit = sec_per_unit
        self.guessed = guessed  # estimate is the stage median / default, not the peer's announcement
        self.sidelined = False  # was skipped as banned: re-enters at the current minimum


class StageRouter:
    """Chooses among the online peers of one target stage (one instance per target stage)."""

    def __init__(
        self,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
        mode: RoutingMode = RoutingMode.LOAD_AWARE,
    ):
        self._rng = rng
        self._clock = clock
        self.mode = RoutingMode(mode)
        self._peers: dict[str, _PeerLoad] = {}
        self._deck: list[str] = []  # mode SHUFFLED: the rest of the current permutation, dealt from the end
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ membership

    def _default_sec_per_unit(self) -> float:
        known = [p.sec_per_unit for p in self._peers.values() if not p.guessed]
        return statistics.median(known) if known else 1.0 / DEFAULT_THROUGHPUT

    def _floor_load(self, now: float, among: Iterable[_PeerLoad]) -> float:
        """The current minimum: the earliest time one of `among` is free (now if one is idle)."""
        finishes = [p.virtual_finish for p in among]
        return max(now, min(finishes)) if finishes else now

    def update_peers(self, records: Iterable[PeerRecord]) -> None:
        """Replace the peer set with `records` (the stage's current online peers from the DHT).

        New peers enter at the current minimum load; peers absent from `records` are dropped;
        every peer's speed follows its latest announced throughput (a peer that announces none
        keeps the stage median it was given). Records that are not `online` are skipped.
        """
        now = self._clock()
        with self._lock:
            fresh: dict[str, PeerRecord] = {}
            for record in records:
                if record.serving:
                    fresh[record.peer_id] = record
            for peer_id in [p for p in self._peers if p not in fresh]:
                del self._peers[peer_id]
            floor = self._floor_load(now, (p for p in self._peers.values() if not p.sidelined))
            added: list[tuple[str, float | None]] = []
            for peer_id, record in fresh.items():
                announced = _usable_throughput(record.throughput)
                state = self._peers.get(peer_id)
                if state is None:
                    added.append((peer_id, announced))
                elif announced is not None:
                    state.sec_per_unit, state.guessed = 1.0 / announced, False
            default = None
            for peer_id, announced in added:
                if announced is not None:
                    self._peers[peer_id] = _PeerLoad(floor, 1.0 / announced, guessed=False)
            for peer_id, announced in added:
                if announced is None:
                    if default is None:
                        default = self._default_sec_per_unit()
                    self._peers[peer_id] = _PeerLoad(floor, default, guessed=True)

    def remove(self, peer_id: str) -> None:
        with self._lock:
            self._peers.pop(peer_id, None)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    # ------------------------------------------------------------------ choosing

    def choose(
        self,
        exclude: Collection[str] = (),
        bans: BanList | None = None,
        task_size: float = 1.0,
    ) -> str | None:
        """The peer with the earliest expected completion of a `task_size` task (in mode RANDOM: a
        uniform draw among the candidates; SHUFFLED: the next of a shuffled deck), charged for it.

        Skips peers in `exclude` (a retry after a timeout) and peers banned in `bans`. Among keys
        within TIE_RTOL of the smallest one is drawn at random. Returns None if no candidate.
        """
        if not (task_size > 0.0 and math.isfinite(task_size)):
            raise ValueError(f"task_size must be a positive finite number, got {task_size}")
        now = self._clock()
        with self._lock:
            eligible: list[tuple[str, _PeerLoad]] = []
            for peer_id in sorted(self._peers):  # sorted: the draw depends on the rng only
                state = self._peers[peer_id]
                if bans is not None and bans.is_banned(peer_id):
                    state.sidelined = True
                    continue
                if peer_id in exclude:
                    continue
                eligible.append((peer_id, state))
            if not eligible:
                return None
            returning = [state for _, state in eligible if state.sidelined]
            if returning:  # back from a ban: re-enter at the current minimum, like a new peer
                floor = self._floor_load(now, (s for s in self._peers.values() if not s.sidelined))
                for state in returning:
                    state.virtual_finish = max(state.virtual_finish, floor)
                    state.sidelined = False
            offsets = [max(state.virtual_finish - now, 0.0) + task_size * state.sec_per_unit for _, state in eligible]
            if self.mode == RoutingMode.RANDOM:
                index = self._rng.randrange(len(eligible))
            elif self.mode == RoutingMode.SHUFFLED:
                index = self._deal([peer_id for peer_id, _ in eligible])
            else:
                best = min(offsets)
                window = best * (1.0 + TIE_RTOL) + TIE_ATOL
                tied = [i for i, offset in enumerate(offsets) if offset <= window]
                index = tied[0] if len(tied) == 1 else self._rng.choice(tied)
            peer_id, state = eligible[index]
            state.virtual_finish = now + offsets[index]
            return peer_id

    def _deal(self, eligible: list[str]) -> int:
        """The position in `eligible` of the next card of the deck (a fresh shuffle of `eligible`
        when none of the deck's remaining peers is eligible now)."""
        position = {peer_id: i for i, peer_id in enumerate(eligible)}
        while self._deck and self._deck[-1] not in position:
            self._deck.pop()
        if not self._deck:
            self._deck = list(eligible)
            self._rng.shuffle(self._deck)
        return position[self._deck.pop()]

    def release(self, peer_id: str, task_size: float) -> None:
        """Un-charge a task `choose` assigned but the peer never got (the send failed)."""
        with self._lock:
            state = self._peers.get(peer_id)
            if state is not None and task_size > 0.0:
                state.virtual_finish -= task_size * state.sec_per_unit

    # ------------------------------------------------------------------ reporting

    def throughput(self, peer_id: str) -> float | None:
        with self._lock:
            state = self._peers.get(peer_id)
            return None if state is None else 1.0 / state.sec_per_unit

    def loads(self) -> list[tuple[str, float, float]]:
        """(peer_id, load, throughput) per peer, sorted by peer id; load = expected seconds of
        work we have queued on it from now (0 when idle)."""
        now = self._clock()
        with self._lock:
            return [
                (peer_id, max(state.virtual_finish - now, 0.0), 1.0 / state.sec_per_unit)
                for peer_id, state in sorted(self._peers.items())
            ]


class Router:
    """The StageRouters of every target stage of one node, plus the BanList they share."""

    def __init__(
        self,
        rng: random.Random,
        num_stages: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        dht_clock: Callable[[], float] = time.time,
        min_ban_seconds: float = MIN_BAN_SECONDS,
        mode: RoutingMode = RoutingMode.LOAD_AWARE,
        bans: BanList | None = None,
    ):
        """`bans`: the node's one ban store (node/p2p/bans.py), shared with stream admission and
        gossip; None: a store of this router's own (tests, the simulator)."""
        if num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {num_stages}")
        self.num_stages = num_stages
        self.bans = bans if bans is not None else BanList(clock=dht_clock, min_seconds=min_ban_seconds)
        self._dht_clock = dht_clock
        self.mode = RoutingMode(mode)
        self._stages = [StageRouter(rng, clock=clock, mode=self.mode) for _ in range(num_stages)]

    def for_stage(self, stage: int) -> StageRouter:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} outside [0, {self.num_stages})")
        return self._stages[stage]

    def refresh(self, peers_by_stage: Mapping[int, Sequence[PeerRecord]]) -> None:
        """Update each stage listed in `peers_by_stage` (stages not listed keep their peers: a
        failed DHT read must not empty a router). Only `online` records filed under their own
        stage and not yet expired (by `expires`, when known) are routable."""
        now = self._dht_clock()
        for stage, records in peers_by_stage.items():
            if not 0 <= stage < self.num_stages:
                continue
            self._stages[stage].update_peers(
                r for r in records if r.serving and r.stage == stage and not (0.0 < r.expires <= now)
            )

    def choose(self, stage: int, exclude: Collection[str] = (), task_size: float = 1.0) -> str | None:
        """`for_stage(stage).choose(...)` with the shared ban list."""
        return self.for_stage(stage).choose(exclude=exclude, bans=self.bans, task_size=task_size)

    def ban(self, peer_id: str, until: float, reason: str) -> None:
        """Avoid a peer that errored (until its record's expiration, or the minimum); its own
        streams stay admitted (node/p2p/bans.py: an error is no evidence against its input)."""
        self.bans.ban(peer_id, until, reason, evidence=False)

    def loads(self) -> dict[int, list[tuple[str, float, float]]]:
        return {stage: router.loads() for stage, router in enumerate(self._stages)}

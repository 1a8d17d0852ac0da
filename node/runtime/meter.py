"""What a peer counts that no other object keeps: compute and hop latencies, bytes per service,
rebuilds and state downloads.

Most numbers a scrape reports are read from where they already live (PipelineStats, the ban list,
gossip's round outcomes). A `Meter` holds the rest: facts that arrive as events (a latency to put
in a histogram bucket) or must outlive the objects that saw them (a stage service is rebuilt when
the peer moves to another stage; the process's totals must not restart). One Meter per process,
handed to the transport and the stage worker; node/monitor/metrics.py turns it into Prometheus
series at scrape time. Pure Python, no prometheus_client here: lower layers stay free of it.

Thread safety: the stage worker observes from its compute thread, the transport from the event
loop, and a scrape reads from the metrics server's thread, so every update and snapshot takes
one small lock (held for a few additions, never across I/O).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

T = TypeVar("T")

# seconds: from a tiny CPU stage's forward (about a millisecond) up to a hop near its timeout
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class ComputePass(StrEnum):
    """One timed piece of a stage worker's compute (pipeswarm_compute_seconds{pass})."""

    FORWARD = "forward"  # a block stage's forward, or stage 0's embedding
    BACKWARD = "backward"  # a block stage's backward, or stage 0's embedding backward
    HEAD = "head"  # stage 0: norm + head + loss and its gradient


# the StageWorker methods a microbatch runs, by name: what StageWorker.compute times (other work on
# the compute thread, a gossip step or a fingerprint, is not a microbatch's latency)
COMPUTE_PASSES: dict[str, ComputePass] = {
    "embed": ComputePass.FORWARD,
    "forward": ComputePass.FORWARD,
    "head_loss_backward": ComputePass.HEAD,
    "backward": ComputePass.BACKWARD,
    "embed_backward": ComputePass.BACKWARD,
}


class Direction(StrEnum):
    SENT = "sent"
    RECEIVED = "received"


class Tally(StrEnum):
    """Event counts kept for the whole process (they survive a move to another stage)."""

    REBUILDS = "rebuilds"  # stages this peer rebuilt (CheckFree / CheckFree+ / a baseline)
    STATE_DOWNLOADS = "state_downloads"  # stage states downloaded from a donor
    STATE_DOWNLOAD_FAILURES = "state_download_failures"  # downloads that failed (the next donor is tried)


@dataclass
class Histogram:
    """Bucket counts (not cumulative), their sum and count, for LATENCY_BUCKETS."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))  # the last: +Inf
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' view: (upper bound, observations at or below it), ending with +Inf."""
        running, buckets = 0, []
        for bound, count in zip((*(str(b) for b in LATENCY_BUCKETS), "+Inf"), self.counts, strict=True):
            running += count
            buckets.append((bound, running))
        return buckets


@dataclass(frozen=True)
class MeterSnapshot:
    """A consistent copy of a Meter, taken under its lock (what one scrape reports)."""

    compute: dict[ComputePass, Histogram]
    hops: dict[str, Histogram]  # by service
    traffic: dict[tuple[Direction, str], int]  # (direction, service) -> bytes
    tallies: dict[Tally, int]


class Meter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._compute: dict[ComputePass, Histogram] = {}
        self._hops: dict[str, Histogram] = {}
        self._traffic: Counter[tuple[Direction, str]] = Counter()
        self._tallies: Counter[Tally] = Counter()

    def compute(self, kind: ComputePass, seconds: float) -> None:
        with self._lock:
            self._compute.setdefault(kind, Histogram()).observe(seconds)

    def timed(self, fn: Callable[..., T]) -> Callable[..., T]:
        """`fn`, timed into pipeswarm_compute_seconds when it is one of COMPUTE_PASSES (run on the
        compute thread: the time excludes the wait in the worker's queue)."""
        kind = COMPUTE_PASSES.get(getattr(fn, "__name__", ""))
        if kind is None:
            return fn

        # no functools.wraps: it copies fn's metadata on each of the two or three calls per
        # microbatch, and nothing reads the wrapper's name
        def run(*args: Any) -> T:
            began = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.compute(kind, time.perf_counter() - began)

        return run

    def hop(self, service: str, seconds: float) -> None:
        """A request to another peer answered after `seconds` (send, then the reply read back), or a
        posted pipeline hop written after `seconds` (it gets no reply when taken)."""
        with self._lock:
            self._hops.setdefault(service, Histogram()).observe(seconds)

    def traffic(self, direction: Direction, service: str, size: int) -> None:
        with self._lock:
            self._traffic[(direction, service)] += size

    def count(self, tally: Tally, amount: int = 1) -> None:
        with self._lock:
            self._tallies[tally] += amount

    def snapshot(self) -> MeterSnapshot:
        def copy(h: Histogram) -> Histogram:
            return Histogram(list(h.counts), h.total)

        with self._lock:
            return MeterSnapshot(
                compute={k: copy(h) for k, h in self._compute.items()},
                hops={k: copy(h) for k, h in self._hops.items()},
                traffic=dict(self._traffic),
                tallies={tally: self._tallies[tally] for tally in Tally},
            )

"""How many microbatches a stage-0 peer keeps in the pipeline: a window sized from measured delay.

A stage-0 peer that waits for each microbatch's gradient before starting another is idle for a
whole pipeline round trip; with W microbatches in flight its throughput is at most W / RTT
(Little's law). On one host the round trip is mostly compute and a handful in flight keeps every
stage busy; across the internet (docs/reliability.md: ~1.2 s for a 3-stage round trip on 100 ms
links) a fixed window of 4 leaves the stages idle most of the time.

The window follows BBR's congestion-window rule (Cardwell et al., "BBR: Congestion-Based
Congestion Control", 2016): W = gain x (delivery rate) x (minimum RTT), the bandwidth-delay product
with headroom. The minimum RTT over a recent window estimates the pipeline's delay without
queueing; the delivery rate is what the swarm actually completed. Each round the window may at
most double (rate <= W / RTT), so it grows while more in flight means more completed and stops
where the slowest stage saturates: past that, more in flight would only queue. `floor` keeps the
one-host behaviour, `ceiling` bounds stored activations and queues on the stages.

The window has no clock or networking of its own: the caller reports completions with their times.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable

logger = logging.getLogger(__name__)

BBR_WINDOW_GAIN = 2.0  # BBR's cwnd_gain: headroom over the bandwidth-delay product
MIN_RTT_HORIZON = 30.0  # seconds a minimum-RTT sample is trusted before it is measured again (BBR: 10 s)
MIN_RATE_SPAN = 5.0  # seconds: never judge the delivery rate over less than this
DRAIN_SAMPLES = 1  # round trips measured one at a time while draining (the lowest since is kept too)


class InFlightWindow:
    """The number of microbatches a stage-0 peer may have in flight, from its completions.

    With more in flight than the pipeline can serve, microbatches queue and every round trip
    includes the queue, so the minimum RTT can only be re-measured by draining it: when the
    minimum is older than MIN_RTT_HORIZON the window drops to one microbatch until DRAIN_SAMPLES
    sent after the drain began have come back (BBR's ProbeRTT), and their minimum replaces it: at
    the floor itself a saturated stage would still queue. A drain costs about DRAIN_SAMPLES round
    trips every MIN_RTT_HORIZON (~5 % at a 1.2 s round trip).
    """

    def __init__(self, floor: int, ceiling: int, *, gain: float = BBR_WINDOW_GAIN) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"need 1 <= floor <= ceiling, got floor={floor} ceiling={ceiling}")
        self.floor = floor
        self.ceiling = ceiling
        self.gain = gain
        self.min_rtt: float | None = None
        self._min_rtt_at = 0.0
        self._completions: deque[float] = deque()
        self._drain_started: float | None = None
        self._drain_samples: list[float] = []
        self.size = floor
        self._logged_size = floor

    @property
    def draining(self) -> bool:
        return self._drain_started is not None

    def on_completed(self, now: float, round_trip: float) -> int:
        """Record a microbatch whose gradient came back `round_trip` seconds after it left; the new size."""
        self._completions.append(now)
        if self.min_rtt is None or round_trip <= self.min_rtt:
            self.min_rtt, self._min_rtt_at = round_trip, now
        if self._drain_started is not None:
            if now - round_trip >= self._drain_started:  # sent after the drain began: no queue of ours
                self._drain_samples.append(round_trip)
            if len(self._drain_samples) >= DRAIN_SAMPLES:
                self.min_rtt, self._min_rtt_at = min(self._drain_samples), now
                self._drain_started, self._drain_samples = None, []
        elif now - self._min_rtt_at > MIN_RTT_HORIZON:
            self._drain_started = now
        self.size = 1 if self.draining else self._target(now)
        self._log_if_changed(now)
        return self.size

    def _log_if_changed(self, now: float) -> None:
        """Log the window when it doubled or halved since last logged (drains excluded): enough to
        see it adapt to a link without a line per microbatch."""
        if self.draining or self._logged_size / 2 < self.size < 2 * self._logged_size:
            return
        logger.info(
            f"in-flight window {self._logged_size} -> {self.size} (min round trip {self.min_rtt or 0.0:.2f} s, "
            f"{self.delivery_rate(now):.1f} microbatches/s)"
        )
        self._logged_size = self.size

    def delivery_rate(self, now: float) -> float:
        """Completions per second over the last max(MIN_RATE_SPAN, 4 x min RTT) seconds."""
        if self.min_rtt is None:
            return 0.0
        span = max(MIN_RATE_SPAN, 4 * self.min_rtt)
        while self._completions and now - self._completions[0] > span:
            self._completions.popleft()
        # a young window has not seen a whole span yet: divide by what it has seen
        observed = max(now - self._completions[0], self.min_rtt) if self._completions else span
        return len(self._completions) / observed

    def _target(self, now: float) -> int:
        if self.min_rtt is None:
            return self.floor
        bandwidth_delay = self.delivery_rate(now) * self.min_rtt
        return max(self.floor, min(self.ceiling, math.ceil(self.gain * bandwidth_delay)))


async def keep_in_flight(
    window: InFlightWindow, launch: Callable[[], asyncio.Task], stop: asyncio.Event, ready: Callable[[], bool]
) -> None:
    """Call `launch()` whenever fewer than `window.size` of the tasks it returned are running,
    until `stop`; while `ready()` is false launch nothing (polled every half second)."""
    running: set[asyncio.Task] = set()
    freed = asyncio.Event()

    def finished(task: asyncio.Task) -> None:
        running.discard(task)
        freed.set()

    while not stop.is_set():
        if len(running) >= window.size:
            freed.clear()
            await freed.wait()
            continue
        while not ready() and not stop.is_set():
            await asyncio.sleep(0.5)
        if stop.is_set():
            break
        task = launch()
        running.add(task)
        task.add_done_callback(finished)

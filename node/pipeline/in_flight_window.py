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

A microbatch that is not back within its deadline (hop_timeout x num_stages) is retried, and its
late gradient is thrown away. Where a stage takes seconds a microbatch (a real preset on a CPU or a
small GPU) a window the ceiling allows can queue past that deadline: every microbatch times out,
is retried, queues again behind the abandoned work, and the pipeline delivers nothing (seen: the
15m preset on 2 CPU cores, a window of 14 at stage 0's 2.9 s a microbatch, nothing back for two
minutes). The minimum RTT cannot see it coming, and the delivery rate, counted over bursts, does
not either. So the window also keeps the round trips it measures within DEADLINE_SHARE of the
deadline, as delay-based congestion control does: a microbatch back later than that came back from
about `size` in flight, so the size is cut to what would have fit, size x budget / round trip
(at most once per round trip, never below the floor); while round trips fit, the cut is lifted
again by one microbatch per round trip. A failed attempt caps the window at FAILURE_CUT of its
size (`on_failed`), once per round trip, and the cap is lifted by one per round trip (additive
increase, multiplicative decrease, as loss-based congestion control does): a stage that evicts or
refuses for lack of room, or that lost a replica and serves twice its share until a replacement
comes, is congestion neither the minimum RTT nor the delivery rate shows (docs/reliability.md,
"Churn").
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

BBR_WINDOW_GAIN = 2.0  # BBR's cwnd_gain: headroom over the bandwidth-delay product
MIN_RTT_HORIZON = 30.0  # seconds a minimum-RTT sample is trusted before it is measured again (BBR: 10 s)
# ... and at least this many minimum round trips: a drain first empties the queue (the window's worth of
# the slowest stage's work), so at seconds a round trip (a real preset on CPUs) a drain every 30 s
# left stage 0 idle a third of the time (docs/benchmarks.md, "The wire at real size")
MIN_RTT_HORIZON_TRIPS = 50
MIN_RATE_SPAN = 5.0  # seconds: never judge the delivery rate over less than this
DRAIN_SAMPLES = 1  # round trips measured one at a time while draining (the lowest since is kept too)
PROBE_QUIET = 3  # rate spans of quiet (no drain, no probe) before the next probe: probes take ~1/4 of the time
PROBE_GROWTH = 1.5  # a probe's window over the size it starts from
PROBE_GAIN = 1.05  # what a probe must deliver over the span before it to be kept: above a shared host's noise
DEADLINE_SHARE = 0.5  # round trips are kept within this share of the microbatch deadline
FAILURE_CUT = 0.7  # the window after a failed attempt, x its size (CUBIC's beta): at most once per round trip


@dataclass
class _Probe:
    """One probe: `size` in flight until `ends`; its delivery counted from `measure_from` on."""

    size: int
    baseline: float  # microbatches/s over the span before the probe
    measure_from: float
    ends: float
    completed: int = 0
    before_drain: int | None = None  # a check after a drain: the larger size that ran before it


class InFlightWindow:
    """The number of microbatches a stage-0 peer may have in flight, from its completions.

    With more in flight than the pipeline can serve, microbatches queue and every round trip
    includes the queue, so the minimum RTT can only be re-measured by draining it: when the
    minimum is older than its horizon (MIN_RTT_HORIZON, or MIN_RTT_HORIZON_TRIPS minimum round trips
    where that is longer) the window drops to one microbatch until DRAIN_SAMPLES
    sent after the drain began have come back (BBR's ProbeRTT), and their minimum replaces it: at
    the floor itself a saturated stage would still queue. A drain costs about DRAIN_SAMPLES round
    trips every horizon (~5 % at a 1.2 s round trip; at seconds a round trip the drain empties a
    queue first: about 18 s every ~175 s for a 15m stage 0 on a CPU), so once a probe has learned the
    ceiling (the size can no longer move: it is never below `learned`) the window stops draining.
    """

    def __init__(
        self, floor: int, ceiling: int, deadline: float | None = None, *, gain: float = BBR_WINDOW_GAIN
    ) -> None:
        """`deadline`: seconds after which a microbatch in flight is given up and retried (None: none)."""
        if not 1 <= floor <= ceiling:
            raise ValueError(f"need 1 <= floor <= ceiling, got floor={floor} ceiling={ceiling}")
        self.floor = floor
        self.ceiling = ceiling
        self.deadline = deadline
        self.in_time = ceiling  # the largest size whose round trips fit DEADLINE_SHARE of the deadline
        self._cut_at = -math.inf  # when `in_time` was last cut
        self._in_time_lifted_at = -math.inf  # when `in_time` was last lifted (or cut)
        self.after_failures = ceiling  # the cap failed attempts left (on_failed), lifted by one per round trip
        self._failure_cut_at = -math.inf
        self._lifted_at = -math.inf  # when `after_failures` was last lifted
        self.gain = gain
        self.min_rtt: float | None = None
        self._min_rtt_at = 0.0
        self._completions: deque[float] = deque()
        self._drain_started: float | None = None
        self._drain_samples: list[float] = []
        self.size = floor
        self._logged_size = floor
        self.learned = floor  # the largest size a probe found to deliver more
        self._probe: _Probe | None = None
        self._quiet_since: float | None = None  # when the last drain or probe ended (or the first completion)
        self._climbing = False  # the last probe was kept: the next one starts without a quiet wait
        self._before_drain: tuple[int, float] | None = None  # (size, microbatches/s) when the last drain began

    @property
    def draining(self) -> bool:
        return self._drain_started is not None

    def on_completed(self, now: float, round_trip: float) -> int:
        """Record a microbatch whose gradient came back `round_trip` seconds after it left; the new size."""
        self._completions.append(now)
        if self._quiet_since is None:
            self._quiet_since = now  # the start-up ramp is no baseline for a probe
        if self.min_rtt is None or round_trip <= self.min_rtt:
            self.min_rtt, self._min_rtt_at = round_trip, now
        if self._drain_started is not None:
            if now - round_trip >= self._drain_started:  # sent after the drain began: no queue of ours
                self._drain_samples.append(round_trip)
            if len(self._drain_samples) >= DRAIN_SAMPLES:
                self.min_rtt, self._min_rtt_at = min(self._drain_samples), now
                self._drain_started, self._drain_samples = None, []
                self._quiet_since = now
                self._check_after_drain(now, round_trip)
        elif now - self._min_rtt_at > self._min_rtt_horizon() and self._probe is None and self.learned < self.ceiling:
            # a probe finishes first; and a window whose probes reached the ceiling stays there
            # whatever the minimum RTT says, so a drain would only empty the pipeline
            self._drain_started = now
            self._before_drain = (self.size, self.delivery_rate(now))
        if self.draining:
            self.size = 1
        else:
            self._fit_deadline(now, round_trip)
            if self.after_failures < self.ceiling and now - round_trip >= self._lifted_at:  # sent after the last lift
                self.after_failures, self._lifted_at = self.after_failures + 1, now
            wanted = self._probed(now, round_trip, max(self._target(now), self.learned))
            self.size = min(wanted, self.in_time, self.after_failures)
        self._log_if_changed(now)
        return self.size

    def on_failed(self, now: float, started: float) -> int:
        """Record an attempt that left at `started` and failed (refused by a full stage, its stored
        activations evicted, lost with a peer); the new size. The delivery rate and the minimum RTT
        cannot see an overfull stage that refuses or evicts: the window takes a failure as loss-based
        congestion control does, capped at FAILURE_CUT of its size, once per round trip (attempts
        that left before a cut fail with it); on_completed lifts the cap by one per round trip."""
        if started >= self._failure_cut_at:
            self.after_failures = max(self.floor, math.floor(self.size * FAILURE_CUT))
            self._failure_cut_at = self._lifted_at = now
            self.size = min(self.size, self.after_failures)
            self._log_if_changed(now)
        return self.size

    def _check_after_drain(self, now: float, round_trip: float) -> None:
        """After a drain the new minimum RTT may put BBR's target below the size that ran before it.
        Where stages share cores that size may have delivered more (the minimum RTT cannot see it):
        run one rate span at the new size, and keep the old one as learned if it did (a probe down)."""
        before, self._before_drain = self._before_drain, None
        size = max(self._target(now), self.learned)
        if before is None or before[0] <= size:
            return
        measure_from = now + round_trip
        self._probe = _Probe(size, before[1], measure_from, measure_from + self._rate_span(), before_drain=before[0])

    def _probed(self, now: float, round_trip: float, size: int) -> int:
        """`size`, or a probe's larger one while a probe runs (starting and judging probes)."""
        probe = self._probe
        if probe is not None:
            if now >= probe.measure_from:
                probe.completed += 1
            if now < probe.ends:
                return probe.size
            delivered = probe.completed / max(probe.ends - probe.measure_from, 1e-9)
            if probe.before_drain is not None:  # the check after a drain: did the larger size deliver more?
                self._climbing = False
                if probe.baseline >= PROBE_GAIN * delivered:
                    self.learned = max(self.learned, probe.before_drain)
                    logger.info(
                        f"in-flight window: {probe.before_drain} delivered {probe.baseline:.1f} microbatches/s "
                        f"before the drain against {delivered:.1f} at {probe.size}: kept"
                    )
            else:
                self._climbing = delivered >= PROBE_GAIN * probe.baseline
            if self._climbing:
                self.learned = probe.size
                logger.info(
                    f"in-flight window: {probe.size} delivered {delivered:.1f} microbatches/s against "
                    f"{probe.baseline:.1f}: kept"
                )
            self._probe, self._quiet_since = None, now
            size = max(size, self.learned)
            if not self._climbing:
                return size
        span = self._rate_span()
        quiet = now - (self._quiet_since or now)
        if size < self.ceiling and self.min_rtt is not None and (self._climbing or quiet >= PROBE_QUIET * span):
            self._climbing = False
            # measure once the larger window has filled the pipeline: one current round trip
            measure_from = now + round_trip
            larger = min(self.ceiling, max(size + 1, math.ceil(size * PROBE_GROWTH)))
            self._probe = _Probe(larger, self.delivery_rate(now), measure_from, measure_from + span)
            return larger
        return size

    def _min_rtt_horizon(self) -> float:
        return max(MIN_RTT_HORIZON, MIN_RTT_HORIZON_TRIPS * (self.min_rtt or 0.0))

    def _rate_span(self) -> float:
        return max(MIN_RATE_SPAN, 4 * (self.min_rtt or 0.0))

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
        span = self._rate_span()
        while self._completions and now - self._completions[0] > span:
            self._completions.popleft()
        # a young window has not seen a whole span yet: divide by what it has seen
        observed = max(now - self._completions[0], self.min_rtt) if self._completions else span
        return len(self._completions) / observed

    def _fit_deadline(self, now: float, round_trip: float) -> None:
        """Cut `in_time` when a round trip took more than DEADLINE_SHARE of the deadline (once per
        round trip: the microbatches that left before a cut come back as late), else lift it by one."""
        if self.deadline is None:
            return
        budget = DEADLINE_SHARE * self.deadline
        if round_trip <= budget:
            # by one a round trip (sent after the last lift or cut), as congestion avoidance grows:
            # one a completion refilled a cut within a second at 2 microbatches/s, and the round trips
            # went over the budget again at once
            if now - round_trip >= self._in_time_lifted_at:
                self.in_time, self._in_time_lifted_at = min(self.ceiling, self.in_time + 1), now
        elif now - round_trip >= self._cut_at:
            self.in_time = max(self.floor, math.floor(self.size * budget / round_trip))
            self._cut_at = self._in_time_lifted_at = now
            logger.info(
                f"in-flight window cut to {self.in_time}: a round trip took {round_trip:.1f} s of a {self.deadline:.0f} s deadline"
            )

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

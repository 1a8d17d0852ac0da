"""The stage-0 in-flight window (node/pipeline/in_flight_window.py) against simulated pipelines: a
fixed propagation delay plus one bottleneck stage serving microbatches one at a time, and stages
sharing cores, whose delivery grows with what is in flight."""

from __future__ import annotations

import asyncio
import collections
import heapq
from collections.abc import Callable

import pytest

from node.pipeline.in_flight_window import InFlightWindow, keep_in_flight


def simulate(window: InFlightWindow, delay: float, service_time: float, duration: float) -> tuple[list[int], float]:
    """Run a driver that keeps `window.size` microbatches in flight for `duration` simulated seconds.

    Each microbatch travels `delay` seconds in total and waits its turn at a single bottleneck
    server that takes `service_time` per microbatch. Returns the window sizes seen outside the
    drains (ProbeRTT) and the throughput over the second half (microbatches per second)."""
    now = 0.0
    server_free_at = 0.0
    completions: list[tuple[float, float]] = []  # heap of (finish time, start time)
    sizes: list[int] = []
    finished_late = 0
    in_flight = 0
    for _ in range(200_000):  # bounded: the simulated clock ends the loop long before this
        while in_flight < window.size:
            arrival = now + delay / 2
            start_service = max(arrival, server_free_at)
            server_free_at = start_service + service_time
            heapq.heappush(completions, (server_free_at + delay / 2, now))
            in_flight += 1
        finish, started = heapq.heappop(completions)
        now = finish
        if now > duration:
            break
        in_flight -= 1
        size = window.on_completed(now, now - started)
        if not window.draining:
            sizes.append(size)
        if now > duration / 2:
            finished_late += 1
    return sizes, finished_late / (duration / 2)


def test_starts_at_the_floor_and_refuses_a_bad_range() -> None:
    assert InFlightWindow(4, 16).size == 4
    with pytest.raises(ValueError):
        InFlightWindow(5, 4)
    with pytest.raises(ValueError):
        InFlightWindow(0, 4)


def simulate_shared_cores(window: InFlightWindow, rate_at: Callable[[int], float], duration: float) -> float:
    """A pipeline that completes rate_at(W) microbatches/s with W in flight, each after W / rate_at(W)
    seconds (Little's law): one microbatch alone is fast, more at once deliver more. Returns the
    throughput over the second half."""
    now, finished_late = 0.0, 0
    for _ in range(200_000):  # bounded: the simulated clock ends the loop long before this
        rate = rate_at(window.size)
        now += 1.0 / rate
        if now > duration:
            break
        window.on_completed(now, window.size / rate)
        finished_late += now > duration / 2
    return finished_late / (duration / 2)


def test_one_host_pipeline_stays_at_the_floor() -> None:
    # round trip mostly compute: 20 ms of travel, 25 ms per microbatch at the slowest stage
    window = InFlightWindow(4, 16)
    sizes, throughput = simulate(window, delay=0.02, service_time=0.025, duration=120)
    late = collections.Counter(sizes[len(sizes) // 2 :])
    assert late.most_common(1)[0][0] == 4  # probes try 6 now and then, and keep nothing
    assert window.learned == 4
    assert throughput == pytest.approx(40, rel=0.05)  # the bottleneck is saturated already


def test_stages_sharing_cores_get_a_window_the_minimum_rtt_cannot_see() -> None:
    # alone a microbatch takes 33 ms; up to 12 at once deliver more (sqrt: diminishing returns).
    # BBR's 2 x rate x min RTT stays at 4 here, where 60/s come back; the probes find ~12
    def rate_at(in_flight: int) -> float:
        return 30.0 * min(in_flight, 12) ** 0.5

    window = InFlightWindow(4, 16)
    throughput = simulate_shared_cores(window, rate_at, duration=300)
    assert 12 <= window.learned <= 16
    assert throughput > 0.9 * rate_at(12) > 1.5 * rate_at(4)


def test_a_window_that_delivered_more_before_a_drain_is_not_thrown_away() -> None:
    # the same shared cores: the start-up ramp reaches 16 (its round trips include the queue), the
    # first drain's minimum RTT puts BBR's target near 7, and the rate span after it delivers less:
    # the size from before the drain is learned at once, where probing back up from 7 with
    # PROBE_QUIET spans between probes would still be at 8-10 here (and kept probes now follow
    # each other without those spans)
    def rate_at(in_flight: int) -> float:
        return 30.0 * min(in_flight, 12) ** 0.5

    window = InFlightWindow(4, 16)
    simulate_shared_cores(window, rate_at, duration=45)
    assert window.learned >= 12


def test_a_window_that_learned_its_ceiling_stops_draining() -> None:
    # shared cores that deliver more up to 16 in flight, under a ceiling of 12: the probes climb to
    # the ceiling, and from then on a drain (the whole pipeline emptied for a round trip every
    # MIN_RTT_HORIZON) could not change the size, so none happens
    def rate_at(in_flight: int) -> float:
        return 30.0 * min(in_flight, 16) ** 0.5

    window = InFlightWindow(4, 12)
    now, learned_ceiling_at, drained_after = 0.0, None, 0
    for _ in range(200_000):  # bounded: the simulated clock ends the loop long before this
        rate = rate_at(window.size)
        now += 1.0 / rate
        if now > 300:
            break
        window.on_completed(now, window.size / rate)
        if learned_ceiling_at is None and window.learned == window.ceiling:
            learned_ceiling_at = now
        drained_after += learned_ceiling_at is not None and window.draining
    assert learned_ceiling_at is not None and learned_ceiling_at < 100
    assert drained_after == 0
    assert window.size == 12


def test_wide_area_pipeline_grows_until_the_bottleneck_saturates() -> None:
    # 1.2 s round trip (three stages over 100 ms links), the slowest stage does 10 microbatches/s:
    # a fixed window of 4 gets 4 / 1.3 ~ 3 microbatches/s
    _, fixed_throughput = simulate(InFlightWindow(4, 4), delay=1.2, service_time=0.1, duration=300)
    window = InFlightWindow(4, 32)
    sizes, throughput = simulate(window, delay=1.2, service_time=0.1, duration=300)
    assert fixed_throughput < 3.5
    assert throughput > 9.0  # the bottleneck's 10/s, within 10 %
    late = collections.Counter(sizes[len(sizes) // 2 :])
    # bandwidth-delay product 10/s x 1.3 s = 13 in flight; BBR's gain 2 keeps at most twice that
    assert 13 <= min(late) and 13 <= late.most_common(1)[0][0] <= 28
    assert window.learned == 4  # probing past saturation delivered nothing: not kept


def test_the_ceiling_bounds_the_window() -> None:
    window = InFlightWindow(4, 8)
    sizes, throughput = simulate(window, delay=2.0, service_time=0.01, duration=200)
    assert max(sizes) == 8
    assert throughput == pytest.approx(8 / 2.01, rel=0.1)  # window-limited, as the cap says


def test_keep_in_flight_never_runs_more_than_the_window_and_stops() -> None:
    async def scenario() -> tuple[int, int]:
        window = InFlightWindow(3, 8)
        stop = asyncio.Event()
        running = peak = launched = 0

        async def work() -> None:
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.01)
            running -= 1

        def launch() -> asyncio.Task:
            nonlocal launched
            launched += 1
            if launched == 30:
                stop.set()
            return asyncio.ensure_future(work())

        await asyncio.wait_for(keep_in_flight(window, launch, stop, lambda: True), 10)
        await asyncio.sleep(0.05)
        return peak, launched

    peak, launched = asyncio.run(scenario())
    assert peak == 3 and launched == 30


def test_the_window_keeps_its_round_trips_within_half_the_deadline() -> None:
    # a long pipeline (10 s round trip) whose slowest stage does 2 microbatches/s: BBR alone wants
    # 2 x 2/s x 10.5 s = 42 in flight, whose round trip is 21 s; with a 30 s deadline the round trips
    # are kept within 15 s, about 30 in flight, which still saturates the stage (21 fill the pipe)
    unbounded = InFlightWindow(4, 64)
    sizes_unbounded, throughput_unbounded = simulate(unbounded, delay=10.0, service_time=0.5, duration=900)
    window = InFlightWindow(4, 64, deadline=30.0)
    sizes, throughput = simulate(window, delay=10.0, service_time=0.5, duration=900)
    late, late_unbounded = sizes[len(sizes) // 2 :], sizes_unbounded[len(sizes_unbounded) // 2 :]
    assert collections.Counter(late_unbounded).most_common(1)[0][0] > 32
    assert 26 <= collections.Counter(late).most_common(1)[0][0] <= 32
    assert throughput >= 0.95 * throughput_unbounded  # both lose the same to their drains (one in 900 s at 10 s)
    # a round trip over half the deadline even at the floor: the window stays at the floor
    window = InFlightWindow(4, 32, deadline=20.0)
    sizes, _ = simulate(window, delay=11.0, service_time=0.5, duration=600)
    assert set(sizes) == {4}


def grown_to_40() -> tuple[InFlightWindow, float]:
    """1 microbatch/s back after 20 s each for 120 s: BBR's 2 x 1/s x 20 s = 40 in flight, within a
    60 s deadline. The window and the clock."""
    window = InFlightWindow(4, 64, deadline=60.0)
    now = 0.0
    for _ in range(120):
        now += 1.0
        window.on_completed(now, round_trip=20.0)
    return window, now


def test_round_trips_growing_past_half_the_deadline_cut_the_window_to_its_floor() -> None:
    window, now = grown_to_40()
    assert 40 <= window.size <= 42  # BBR's target, give or take the delivery rate's rounding
    before = window.size
    # then the round trips grow to 50 s (a stage slowed down): cut to size x 30/50 at once, and again
    # each time microbatches sent after the last cut are back as late; never below the floor, never
    # lifted while they stay late (a drain re-measuring the round trip runs one microbatch meanwhile)
    sizes = []
    for _ in range(200):
        now += 1.0
        sizes.append(window.on_completed(now, round_trip=50.0))
    assert sizes[0] == before * 30 // 50
    outside_drains = [size for size in sizes if size > 1]
    assert outside_drains == sorted(outside_drains, reverse=True) and outside_drains[-1] == 4
    assert window.size == 4


def test_a_failed_attempt_cuts_the_window_once_per_round_trip_and_each_round_trip_lifts_it_by_one() -> None:
    window, now = grown_to_40()  # then a stage that refuses or evicts: attempts fail
    before = window.size
    assert before >= 40
    assert window.on_failed(now, started=now - 20.0) == int(before * 0.7)
    # the other attempts that left before the cut fail with it: no second cut for them
    assert window.on_failed(now + 0.5, started=now - 19.0) == int(before * 0.7)
    # an attempt sent after the cut fails too: cut again
    now += 1.0
    cut = window.on_failed(now, started=now - 0.5)
    assert cut == int(int(before * 0.7) * 0.7)
    # completions lift the cap by one per round trip (20 s here), not one per completion
    sizes = []
    for _ in range(70):
        now += 1.0
        sizes.append(window.on_completed(now, round_trip=20.0))
    assert sizes[:19] == [cut] * 19
    assert sizes[-1] == cut + 3  # lifted at 20, 40 and 60 s


def test_failures_never_cut_below_the_floor() -> None:
    window = InFlightWindow(4, 32, deadline=10.0)
    for second in range(10):
        window.on_failed(float(second), started=float(second) - 0.1)
    assert window.size == 4

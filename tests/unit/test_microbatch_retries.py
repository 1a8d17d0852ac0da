"""A stage-0 microbatch whose attempt failed is retried after a pause; while a stage has no peer at
all (churn emptied it, CheckFree is rebuilding it) the next attempt waits for the stage to be back,
up to the microbatch's budget (its attempts x its deadline), then one heartbeat period more for the
other peers' views to catch up, instead of being spent where no peer can take it and the microbatch
dropped; the attempts lost to that outage are given back, once. The pauses add up to a record's lifetime, so that the last attempt comes after the view has
dropped the records of a stage that died whole."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import torch

from node.config import SwarmConfig
from node.pipeline.retry_pause import RetryPause
from tests.helpers.served_handlers import served_node

HOP_TIMEOUT = 0.5  # a 2-stage microbatch's deadline is 1 s
BASE = SwarmConfig(num_stages=2)
# one retry, paused for a record's lifetime (ttl + period = 0.5 s) before it
CONFIG = dataclasses.replace(
    BASE,
    training=dataclasses.replace(BASE.training, hop_timeout=HOP_TIMEOUT, max_retries=1),
    heartbeat=dataclasses.replace(BASE.heartbeat, period=0.2, ttl=0.3),
)


def attempt_times(served_after: float | None) -> tuple[list[float], int]:
    """Run one microbatch at a stage 0 whose stage 1 has no peer in its router (each attempt fails at
    once); `stages_served` turns true `served_after` seconds in (None: never). The seconds at which
    each attempt started, and how many microbatches were dropped."""

    async def scenario() -> tuple[list[float], int]:
        node = await served_node(CONFIG, 0, "origin-peer", ())
        pipeline = node.pipeline
        started = time.monotonic()
        pipeline.retry.stages_served = lambda: served_after is not None and time.monotonic() - started >= served_after
        attempts: list[float] = []
        embed = pipeline.worker.embed

        def timed_embed(*args):
            attempts.append(time.monotonic() - started)
            return embed(*args)

        pipeline.worker.embed = timed_embed
        tokens = torch.zeros(1, 4, dtype=torch.long)
        try:
            loss = await asyncio.wait_for(pipeline.run_microbatch(tokens, tokens), 10.0)
        finally:
            await pipeline.close()
        assert loss is None  # no peer of stage 1 ever took it
        return attempts, pipeline.stats.dropped

    return asyncio.run(scenario())


def test_a_retry_waits_for_the_emptied_stage_to_be_back_and_gets_its_attempts_back():
    attempts, dropped = attempt_times(served_after=0.8)
    # the first attempt was lost to the outage: given back, so two more came after the stage was back
    assert len(attempts) == 3 and dropped == 1
    # the pause alone is 0.5 s; the view is looked at every 0.5 s, so the stage is seen back at 1.0 s;
    # then one heartbeat period (0.2 s) for the other peers' views to see the stage's new peer
    assert 1.0 + 0.2 <= attempts[1] < 1.0 + 0.2 + 0.3, attempts
    assert 0.5 <= attempts[2] - attempts[1] < 0.5 + 0.3, attempts  # an ordinary pause: no outage now


def test_a_retry_waits_at_most_the_microbatch_budget_for_a_stage_that_stays_empty():
    attempts, dropped = attempt_times(served_after=None)
    assert len(attempts) == 2 and dropped == 1
    # pause 0.5 s, then the budget of waiting: 2 attempts x the 1 s deadline
    assert 2.5 <= attempts[1] < 2.5 + 0.6, attempts


def test_a_retry_with_every_stage_served_only_pauses():
    attempts, dropped = attempt_times(served_after=0.0)
    assert len(attempts) == 2 and dropped == 1
    assert 0.5 <= attempts[1] < 0.5 + 0.4, attempts


def test_the_pauses_double_and_add_up_to_a_record_lifetime():
    heartbeat = BASE.heartbeat
    pause = RetryPause(BASE.training.max_retries, heartbeat, deadline=1.0)
    slept = [pause.seconds(attempt) for attempt in range(pause.retries)]
    assert all(later == 2 * earlier for earlier, later in itertools.pairwise(slept))
    assert abs(sum(slept) - (heartbeat.ttl + heartbeat.period)) < 1e-9


def test_attempts_lost_to_outages_are_given_back_only_once():
    served = iter([False, True, True, False, True, True])  # two outages, each seen by one pause
    pause = RetryPause(1, CONFIG.heartbeat, deadline=5.0, stages_served=lambda: next(served))

    async def numbers() -> list[int]:
        return [attempt async for attempt in pause.attempts()]

    assert asyncio.run(numbers()) == [0, 0, 1]


def test_no_pause_after_the_last_attempt():
    pause = RetryPause(0, BASE.heartbeat, deadline=60.0, stages_served=lambda: False)

    async def numbers() -> list[int]:
        return [attempt async for attempt in pause.attempts()]

    started = time.monotonic()
    assert asyncio.run(numbers()) == [0]  # the microbatch is dropped now: nothing to wait for
    assert time.monotonic() - started < 0.1

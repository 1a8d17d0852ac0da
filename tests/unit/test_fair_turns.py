"""Block-stage compute turns shared round-robin among origins (node/pipeline/fair_turns.py)."""

from __future__ import annotations

import asyncio

import pytest

from node.pipeline.fair_turns import FairTurns


async def _run_all(turns: FairTurns, calls: list[str], steps: int = 1) -> list[str]:
    """Start every call at once (origins in `calls` order); each holds its turn for `steps` loop
    iterations. Returns the origins in the order their calls ran."""
    order: list[str] = []

    async def call(origin: str) -> None:
        async with turns.turn(origin):
            order.append(origin)
            for _ in range(steps):
                await asyncio.sleep(0)

    await asyncio.wait_for(asyncio.gather(*(call(origin) for origin in calls)), 5.0)
    return order


def test_a_flooding_origin_gets_one_turn_per_round_like_the_others():
    # "a" queued 12 calls before "b" queued 4: first come, first served would run all of a's first
    order = asyncio.run(_run_all(FairTurns(concurrent=1), ["a"] * 12 + ["b"] * 4))
    # a's first call took the free turn; from then on the two waiting origins alternate
    assert order[:10] == ["a", "a", "b", "a", "b", "a", "b", "a", "b", "a"]
    assert order.count("a") == 12 and order.count("b") == 4


def test_three_origins_share_evenly_with_two_turns_at_once():
    turns = FairTurns(concurrent=2)
    order = asyncio.run(_run_all(turns, ["a"] * 20 + ["b"] * 10 + ["c"] * 10, steps=3))
    # the first two ran at once, before anything waited; after that every window of three turns
    # while all three origins wait holds each of them once
    rounds = order[2:26]
    for start in range(0, len(rounds), 3):
        assert sorted(rounds[start : start + 3]) == ["a", "b", "c"], order
    assert turns.held == 0 and turns.waiting == 0


def test_one_origin_keeps_its_order_and_never_more_than_the_bound_at_once():
    turns = FairTurns(concurrent=2)
    running, most = 0, 0
    order: list[int] = []

    async def call(index: int) -> None:
        nonlocal running, most
        async with turns.turn("a"):
            running += 1
            most = max(most, running)
            order.append(index)
            await asyncio.sleep(0)
            running -= 1

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(call(i) for i in range(10))), 5.0)

    asyncio.run(main())
    assert order == list(range(10))
    assert most == 2


def test_a_cancelled_waiter_gives_up_its_place_and_the_turns_still_flow():
    async def main() -> list[str]:
        turns = FairTurns(concurrent=1)
        order: list[str] = []
        release = asyncio.Event()

        async def call(origin: str, hold: bool = False) -> None:
            async with turns.turn(origin):
                order.append(origin)
                if hold:
                    await release.wait()

        first = asyncio.create_task(call("a", hold=True))
        await asyncio.sleep(0)
        doomed = asyncio.create_task(call("b"))
        after = asyncio.create_task(call("c"))
        await asyncio.sleep(0)
        assert turns.waiting == 2
        doomed.cancel()
        await asyncio.sleep(0)
        assert turns.waiting == 1
        release.set()
        await asyncio.wait_for(asyncio.gather(first, after), 5.0)
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert turns.held == 0 and turns.waiting == 0
        return order

    assert asyncio.run(main()) == ["a", "c"]


def test_an_error_inside_a_turn_ends_it():
    async def main() -> FairTurns:
        turns = FairTurns(concurrent=1)
        with pytest.raises(RuntimeError):
            async with turns.turn("a"):
                raise RuntimeError("the compute failed")
        async with turns.turn("b"):
            pass
        return turns

    turns = asyncio.run(main())
    assert turns.held == 0 and turns.waiting == 0


def test_concurrent_must_be_positive():
    with pytest.raises(ValueError):
        FairTurns(concurrent=0)

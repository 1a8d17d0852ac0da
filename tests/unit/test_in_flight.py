"""Finding 12: an abort racing a backward that just completed settled a microbatch's future twice
(`InvalidStateError ... ticket.done.set_result`, "Task exception was never retrieved")."""

from __future__ import annotations

import asyncio

import pytest
import torch

from node.p2p.transport import TransportError
from node.pipeline.in_flight import InFlight


def ticket(loop: asyncio.AbstractEventLoop) -> InFlight:
    return InFlight(7, torch.zeros(1), [1, 2], 0.0, loop.create_future(), "token", loss=1.25)


def test_an_abort_after_the_backward_finished_changes_nothing():
    async def main() -> None:
        attempt = ticket(asyncio.get_running_loop())
        attempt.finish(attempt.loss)
        attempt.finish(error=TransportError("peer gave up"))  # the abort arrives late
        assert await attempt.done == 1.25

    asyncio.run(main())


def test_a_backward_finishing_after_an_abort_changes_nothing():
    async def main() -> None:
        attempt = ticket(asyncio.get_running_loop())
        attempt.finish(error=TransportError("peer gave up"))
        attempt.finish(attempt.loss)  # the embedding backward completes after the abort settled it
        with pytest.raises(TransportError, match="gave up"):
            await attempt.done

    asyncio.run(main())

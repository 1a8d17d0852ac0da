"""Stage 0's attempts in flight: one microbatch's targets, stage order, deadline future and token.

Every attempt carries a random token chosen by its origin; only peers on the attempt's path see it,
so only a message naming both the id and the token (`ticket_named_by`) can settle the attempt early.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from node.p2p.transport import TransportError
from protocol import MicrobatchHeader, MicrobatchPurpose, ProtocolError


@dataclass
class InFlight:
    """Stage-0 bookkeeping for one microbatch attempt."""

    microbatch_id: int
    targets: torch.Tensor
    order: list[int]
    started: float
    done: asyncio.Future
    token: str  # shared only with the peers on this attempt's path
    loss: float | None = None
    purpose: MicrobatchPurpose = MicrobatchPurpose.TRAIN

    @classmethod
    def start(cls, microbatch_id: int, targets: torch.Tensor, order: list[int], purpose: MicrobatchPurpose) -> InFlight:
        """A new attempt, started now, with a fresh random token (call it on the event loop)."""
        future = asyncio.get_running_loop().create_future()
        return cls(microbatch_id, targets, order, time.monotonic(), future, secrets.token_hex(8), purpose=purpose)

    def on_lost(self, reason: str) -> Callable[[], None]:
        """What a hop of this attempt does when it is lost (node/pipeline/hops.py): fail the attempt."""
        return lambda: self.finish(error=TransportError(reason))

    def finish(self, loss: float | None = None, error: BaseException | None = None) -> None:
        """Settle the attempt once: an abort can race a backward that just completed."""
        if self.done.done():
            return
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result(loss)


UNNAMED_ATTEMPT = "a microbatch reference needs an integer microbatch_id and a token"


def ticket_named_by(in_flight: dict[int, InFlight], microbatch_id: int, token: str | None) -> InFlight | None:
    """The origin's attempt a message refers to, if its id and token match one in flight; a message
    that names no token (None) is malformed."""
    if isinstance(microbatch_id, bool) or not isinstance(microbatch_id, int) or not isinstance(token, str):
        raise ProtocolError(UNNAMED_ATTEMPT)
    ticket = in_flight.get(microbatch_id)
    # compared as bytes: compare_digest refuses a str that is not ASCII (a TypeError, not a mismatch)
    if ticket is None or not secrets.compare_digest(ticket.token.encode(), token.encode()):
        return None
    return ticket


def ticket_for(in_flight: dict[int, InFlight], header: MicrobatchHeader) -> InFlight | None:
    """The attempt a hop coming back to its origin belongs to (`ticket_named_by`): an older peer's
    hop, without a token, is malformed here, where an empty token only names no attempt."""
    return ticket_named_by(in_flight, header.microbatch_id, header.token if header.carries_token else None)

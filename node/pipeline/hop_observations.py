"""What a checker saw of one microbatch passing through a replica it checks (pure bookkeeping, no
networking; docs/verification.md, "Who checks what").

A peer takes part in a block-stage hop in one of two places. As the hop's previous peer it sent the
replica its input and later receives its gradient with respect to that input; as its next peer it
received the replica's output and later sends back the gradient with respect to it. Each place
sees two of the four tensors a check compares with the replica's claims. A peer draws, for each hop
it takes part in, whether to check it: the previous peer when it sends the hop, and asks once the
replica's backward reached it; the next peer as soon as the output arrived. A pipeline with one
block stage has the origin in both places: a hop it drew as previous peer collects all four
tensors and is checked once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

HopKey = tuple[str, int, str]  # (origin, microbatch id, the replica checked)


@dataclass
class Observed:
    """One hop of `peer` at block stage `stage` as this checker saw it: host tensors, as sent or
    as received (None: not seen from here)."""

    stage: int
    peer: str
    origin: str
    microbatch_id: int
    token: str
    since: float
    sent_input: Tensor | None = None  # the hop's input, as this peer sent it (previous peer)
    received_grad_input: Tensor | None = None  # its gradient wrt that input, as received (previous peer)
    received_output: Tensor | None = None  # the hop's output, as received (next peer)
    sent_grad_output: Tensor | None = None  # the gradient wrt that output, as sent (next peer)
    token_ids: Tensor | None = None  # the hop's token ids, which a subspace codec anchors hidden states to

    @property
    def key(self) -> HopKey:
        return (self.origin, self.microbatch_id, self.peer)


class PendingChecks:
    """Hops drawn for a check whose observations are not complete yet (the previous peer waits for
    the replica's backward), at most `limit`, each forgotten `wait_seconds` after it was drawn (a
    microbatch lost on the way never completes)."""

    def __init__(self, limit: int, wait_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.wait_seconds, self._clock = limit, wait_seconds, clock
        self._pending: OrderedDict[HopKey, Observed] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, observed: Observed) -> None:
        self._forget_old()
        self._pending[observed.key] = observed
        while len(self._pending) > self.limit:
            self._pending.popitem(last=False)

    def get(self, key: HopKey) -> Observed | None:
        self._forget_old()
        return self._pending.get(key)

    def pop(self, key: HopKey) -> Observed | None:
        self._forget_old()
        return self._pending.pop(key, None)

    def _forget_old(self) -> None:
        oldest = self._clock() - self.wait_seconds
        while self._pending and next(iter(self._pending.values())).since < oldest:
            self._pending.popitem(last=False)

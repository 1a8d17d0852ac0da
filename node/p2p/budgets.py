"""Budgets for answers that cost this peer much to give: a stage's whole weights (state transfer,
node/recovery/state_transfer.py) and a gossip exchange (node/averaging). Admission
(node/p2p/peer_conduct.py) bounds how many streams a peer holds and how fast it sends requests;
neither bounds how often one request makes us capture and upload hundreds of megabytes. A budget
does: each identity gets `per_peer` answers per `window` seconds, and all identities together
`total`, so a stranger cannot make a peer upload its weights in a loop, and many fresh identities
cannot make it upload more than `total` times a window. Over budget, the service answers BUSY with
the budget's reason (the asker goes to another peer of the stage) and the refusal is counted; it is
never a strike or an exception: an honest peer that asked once too often did nothing wrong.

The window slides: an answer counts against its identity and the total for `window` seconds after
it was given. Memory stays bounded by `total` timestamps, whatever the number of identities.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from dht.records import short_peer_id

ANSWER_WINDOW = 60.0  # seconds an answer counts against the budgets


class AnswerBudget:
    """How many answers of one kind (`what`, for the refusal's reason) this peer gives each identity
    and all of them together per `window` seconds."""

    def __init__(
        self,
        what: str,
        per_peer: int,
        total: int,
        window: float = ANSWER_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= per_peer <= total:
            raise ValueError(f"budget of {what}: need 1 <= per_peer ({per_peer}) <= total ({total})")
        self.what, self.per_peer, self.total, self.window = what, per_peer, total, float(window)
        self._clock = clock
        self._given: dict[str, deque[float]] = {}  # identity -> when its answers in the window were given
        self._all: deque[float] = deque()  # every answer in the window, oldest first
        self.refused = 0  # requests refused for the budget (a metric)

    def spend(self, peer_id: str) -> str | None:
        """Charge one answer to `peer_id`: None when it is within both budgets (give the answer, or
        `refund` it when none was given), else why not; the refusal is counted."""
        now = self._clock()
        self._forget_before(now - self.window)
        mine = self._given.get(peer_id)
        if len(self._all) >= self.total:
            reason = f"this peer gives at most {self.total} {self.what} per {self.window:.0f} s: ask another peer"
        elif mine is not None and len(mine) >= self.per_peer:
            reason = f"at most {self.per_peer} {self.what} per {self.window:.0f} s to {short_peer_id(peer_id)}"
        else:
            self._given.setdefault(peer_id, deque()).append(now)
            self._all.append(now)
            return None
        self.refused += 1
        return reason

    def refund(self, peer_id: str) -> None:
        """Give back the last answer `spend` charged to `peer_id` when it was not given after all
        (nothing to serve): a refusal of ours must not use up an honest asker's budget."""
        mine = self._given.get(peer_id)
        if not mine:
            return
        when = mine.pop()
        self._all.remove(when)  # the same timestamp: whichever copy goes, the counts are right
        if not mine:
            del self._given[peer_id]

    def given(self, peer_id: str | None = None) -> int:
        """Answers in the current window, to `peer_id` or to everyone."""
        self._forget_before(self._clock() - self.window)
        return len(self._all) if peer_id is None else len(self._given.get(peer_id, ()))

    def _forget_before(self, start: float) -> None:
        while self._all and self._all[0] <= start:
            self._all.popleft()
        for peer_id in [p for p, times in self._given.items() if times[-1] <= start]:
            del self._given[peer_id]
        for times in self._given.values():
            while times[0] <= start:
                times.popleft()

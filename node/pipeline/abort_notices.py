"""Who a block stage tells that a microbatch is lost here, and only whom (docs/security.md).

An ABORT notice goes to a microbatch's origin so that it retries at once instead of at its deadline.
The origin is named by the request (its path), so a stage that believed every request would send a
notice to whatever peer a stranger named: reflection. A notice therefore goes to the origin only for
a microbatch this peer handled (it computed the microbatch's forward) or when the origin itself sent
the request. Otherwise it goes back to the peer that sent the request: if that peer handled the
microbatch (it knows the microbatch's id and token, which only peers on its path see), it passes
the notice on to the origin (`relay`); if not, nobody hears of it and a real origin retries at its
deadline.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from dht.records import short_peer_id
from protocol import BackwardHeader

logger = logging.getLogger(__name__)

HANDLED_MEMORY = 4096  # microbatches remembered as handled here (a few minutes of a busy stage)

Notify = Callable[[str, int, str, str], Awaitable[None]]  # (origin, microbatch id, token, reason)
Spawn = Callable[[Awaitable[None]], object]


class AbortNotices:
    """The microbatches this peer handled, and the notices it sends for them."""

    def __init__(self, notify: Notify, spawn: Spawn, memory: int = HANDLED_MEMORY) -> None:
        self._notify, self._spawn, self._memory = notify, spawn, memory
        self._handled: OrderedDict[tuple[str, int], None] = OrderedDict()  # (origin, microbatch id)
        self._tokens: OrderedDict[tuple[int, str], str] = OrderedDict()  # (microbatch id, token) -> origin
        self.withheld = 0  # notices not sent: the origin was only named by a request
        self.told = 0  # notices sent to origins
        self.relayed = 0  # notices from further on the path passed on to their origin

    def handled(self, origin: str, microbatch_id: int, token: str = "") -> None:
        """This peer computed the microbatch's forward: its origin may be told if it is lost here or
        further on (a notice naming its id and token is relayed)."""
        for memory, key, value in (
            (self._handled, (origin, microbatch_id), None),
            (self._tokens, (microbatch_id, token), origin),
        ):
            memory[key] = value
            memory.move_to_end(key)
            while len(memory) > self._memory:
                memory.popitem(last=False)

    def computed(self, backward: BackwardHeader) -> bool:
        """Did this peer compute the forward of the microbatch `backward` names (its id and token),
        for the origin its path names? Only then may its gradient come back here (a BACKWARD's path
        is the sender's word)."""
        return self._tokens.get((backward.microbatch_id, backward.token)) == backward.origin

    def tell_origin(self, origin: str, microbatch_id: int, token: str, reason: str, sender: str | None = None) -> bool:
        """Tell `origin` (best effort, in the background) that the microbatch named by its id and
        token is lost here, if this peer handled it or `sender`, who sent it, is the origin; else tell
        `sender`, who may relay it. Whether the origin was told."""
        if sender == origin or (origin, microbatch_id) in self._handled:
            self.told += 1
            self._spawn(self._notify(origin, microbatch_id, token, reason))
            return True
        self.withheld += 1
        logger.debug(f"no abort notice to {short_peer_id(origin)}: only a request named it ({reason})")
        if sender is not None:
            self._spawn(self._notify(sender, microbatch_id, token, reason))
        return False

    def relay(self, meta: dict, reason: str) -> bool:
        """A notice from further on the path (an ERROR's meta, node/pipeline/contracts.py's
        ABORT_CONTRACT), naming a microbatch this peer handled by its id and token: passed on to that
        microbatch's origin. Whether it named one."""
        microbatch_id, token = meta["microbatch_id"], meta["token"]
        origin = self._tokens.get((microbatch_id, token))
        if origin is None:
            return False
        self.relayed += 1
        return self.tell_origin(origin, microbatch_id, token, reason)

"""The activations a stage keeps between a microbatch's forward and its backward.

Bounded (the oldest is evicted past `max_stored`), expiring (a microbatch whose backward never
comes is forgotten), and safe from any thread: a small lock guards the dict, never held during
compute. Keys come from the wire (origin, microbatch id): a malformed key is just unknown.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field

from torch import Tensor

from node.stage.weight_stash import StashedWeights

logger = logging.getLogger(__name__)


class UnknownMicrobatch(KeyError):
    """The key names no stored microbatch here (never seen, already finished, dropped or expired)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "unknown microbatch"


@dataclass
class StoredMicrobatch:
    """One microbatch between its forward and its backward on this stage."""

    kind: str  # "block" (forward/backward) or "edge" (embed/head_loss_backward/embed_backward)
    inputs: Tensor  # block: detached input hidden; edge: the tokens
    leaf: Tensor | None  # block: the input leaf the graph starts from (requires_grad)
    output: Tensor  # output with its autograd graph
    versions: tuple[int, ...]  # parameter version counters when the graph was built
    created: float  # time.monotonic() when stored
    seconds: float  # compute time spent on this microbatch so far
    head_grads: list[Tensor | None] | None = field(default=None)  # edge: norm/head grads, applied at embed_backward
    stash: StashedWeights | None = field(default=None)  # block: the weights the graph was built on, if stashed


class ActivationStore:
    """Stored microbatches of one stage, oldest first."""

    def __init__(self, stage: int, max_stored: int):
        if max_stored < 1:
            raise ValueError("max_stored must be >= 1")
        self.stage = stage
        self.max_stored = max_stored
        self.evicted = 0  # stored activations dropped because max_stored was exceeded
        self._stored: OrderedDict[Hashable, StoredMicrobatch] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._stored)

    def clear(self) -> None:
        with self._lock:
            self._stored.clear()

    def drop(self, key: Hashable) -> None:
        """Forget a failed microbatch (no error if it is unknown)."""
        with self._lock:
            self._stored.pop(key, None)

    def expire(self, older_than: float) -> int:
        """Forget activations stored more than `older_than` seconds ago; returns how many."""
        limit = time.monotonic() - older_than
        with self._lock:
            old = [k for k, s in self._stored.items() if s.created <= limit]
            for k in old:
                del self._stored[k]
        if old:
            logger.debug("stage %d: expired %d stored microbatches", self.stage, len(old))
        return len(old)

    def put(self, key: Hashable, item: StoredMicrobatch) -> None:
        with self._lock:
            if self._stored.pop(key, None) is not None:
                logger.debug("stage %d: microbatch %r arrived again, replacing the stored one", self.stage, key)
            self._stored[key] = item
            while len(self._stored) > self.max_stored:
                old_key, _ = self._stored.popitem(last=False)
                self.evicted += 1
                logger.debug(
                    "stage %d: over %d stored activations, dropped the oldest %r", self.stage, self.max_stored, old_key
                )

    def newest_input(self) -> Tensor | None:
        """The input of the most recently stored microbatch (what replicas audit each other on)."""
        with self._lock:
            return next(reversed(self._stored.values())).inputs if self._stored else None

    def unknown(self, key: Hashable) -> UnknownMicrobatch:
        return UnknownMicrobatch(f"stage {self.stage}: microbatch {key!r} is unknown, finished, dropped or expired")

    def get(self, key: Hashable, kind: str) -> StoredMicrobatch:
        try:
            with self._lock:
                item = self._stored[key]
        except (KeyError, TypeError):  # TypeError: unhashable key from a confused caller
            raise self.unknown(key) from None
        if item.kind != kind:  # cannot happen through the worker's API, kept as a guard
            raise UnknownMicrobatch(f"stage {self.stage}: microbatch {key!r} is a {item.kind} microbatch, not {kind}")
        return item

    def take(self, key: Hashable, item: StoredMicrobatch) -> None:
        """Remove `item` (validated, about to be consumed); it may have been dropped meanwhile."""
        with self._lock:
            if self._stored.get(key) is not item:
                raise self.unknown(key)
            del self._stored[key]

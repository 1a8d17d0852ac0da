"""What a block-stage replica keeps of each microbatch it computed, so that it can answer a check of
it after the fact (docs/verification.md).

A check names a real microbatch once it has passed: the replica cannot know, while it computes,
which of its microbatches will be checked, so it keeps a receipt of every one for
`verification.receipt_seconds`: the input it received and the output it sent (host tensors, as on
the wire), the gradient it received and the one it sent once its backward ran, and a reference to
the exact weights its forward ran on. Those weights are the forward's stash
(node/stage/weight_stash.py), an immutable copy shared by every microbatch of that weight
version; a receipt holds the copy's tensors, not the stash, so receipts never count against the
stash limit and never push a forward onto the live weights. A forward that ran on the live weights
(past the stash limit) keeps no weights: its checks go unanswered.

The digests of a version's layers are computed the first time a check asks for them, then kept
with the version: hashing every version would cost a full pass over the weights per optimizer step.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from torch import Tensor

from node.config import Precision
from node.pipeline.spot_check import digest
from node.runtime.device import DeviceTransfers
from node.stage.layers import LayerLayout
from node.stage.stage_worker import StageWorker
from node.stage.weight_stash import StashedWeights


class WeightsVersion:
    """One immutable copy of a block stage's weights (by name, on the stage's device) and the
    digests of its layers, made when a check first asks."""

    def __init__(self, named: dict[str, Tensor]) -> None:
        self.named = named
        self.digests: list[str] | None = None

    def layer(self, layout: LayerLayout, index: int) -> Tensor:
        """Layer `index`'s weights, flat, on the device. Compute thread."""
        return layout.flatten(layout.of_stage(self.named, index))

    def layers_on_host(self, layout: LayerLayout, layers: int, transfers: DeviceTransfers) -> list[Tensor]:
        """Every layer's weights, flat, on the host (to hash them). Compute thread."""
        return transfers.to_host([self.layer(layout, index) for index in range(layers)], copy=True)

    def hash_layers(self, flat_layers: list[Tensor]) -> list[str]:
        """The layers' digests, kept for every later check of this version (host work, any thread)."""
        if self.digests is None:
            self.digests = [digest(layer) for layer in flat_layers]
        return self.digests


@dataclass
class Receipt:
    """One microbatch as this replica computed it: host tensors as they crossed the wire."""

    token: str  # the microbatch's token: only peers on its path know it, so only they can ask
    received: Tensor  # h_0, the input
    sent: Tensor  # h_L, the output
    weights: WeightsVersion | None  # None: the forward ran on live weights that have changed since
    precision: Precision
    created: float  # time.monotonic() of the forward
    grad_received: Tensor | None = None  # g_L, once the backward ran
    grad_sent: Tensor | None = None  # g_0


class ReceiptBook:
    """Receipts by microbatch key, the oldest dropped past `limit` or `keep_seconds` after their
    forward. Written on the compute thread, read from the event loop: a small lock guards the dict."""

    def __init__(self, limit: int, keep_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.keep_seconds, self._clock = limit, keep_seconds, clock
        self._receipts: OrderedDict[Hashable, Receipt] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._receipts)

    def put(self, key: Hashable, receipt: Receipt) -> None:
        with self._lock:
            self._receipts.pop(key, None)
            self._receipts[key] = receipt
            self._forget_old()

    def complete(self, key: Hashable, grad_received: Tensor, grad_sent: Tensor) -> None:
        with self._lock:
            receipt = self._receipts.get(key)
            if receipt is not None:
                receipt.grad_received, receipt.grad_sent = grad_received, grad_sent

    def get(self, key: Hashable) -> Receipt | None:
        with self._lock:
            self._forget_old()
            try:
                return self._receipts.get(key)
            except TypeError:  # an unhashable key from the wire names nothing
                return None

    def _forget_old(self) -> None:
        oldest = self._clock() - self.keep_seconds
        while self._receipts and (
            len(self._receipts) > self.limit or next(iter(self._receipts.values())).created < oldest
        ):
            self._receipts.popitem(last=False)


class ReceiptKeeper:
    """A block stage's forward and backward, each leaving a receipt. `forward` and `backward` run
    on the worker's compute thread in place of the worker's own methods (node/pipeline/block_relay.py)."""

    def __init__(self, worker: StageWorker, book: ReceiptBook) -> None:
        self.worker, self.book = worker, book
        # the version of each live stash, while it lives: later forwards on it share its digests
        self._versions: weakref.WeakKeyDictionary[StashedWeights, WeightsVersion] = weakref.WeakKeyDictionary()

    def forward(self, key: Hashable, token: str, hidden: Tensor) -> Tensor:
        output = self.worker.forward(key, hidden)
        # as the worker used it: a float tensor of another dtype is cast to fp32 on the way in
        self.book.put(key, self.receipt(key, token, hidden.detach().float(), output))
        return output

    def receipt(self, key: Hashable, token: str, received: Tensor, sent: Tensor) -> Receipt:
        """The receipt of the forward just stored under `key`, with the weights it ran on."""
        stash = self.worker.store.get(key, "block").stash
        weights = None
        if stash is not None:
            weights = self._versions.get(stash)
            if weights is None:
                weights = self._versions[stash] = WeightsVersion(stash.named)
        return Receipt(token, received, sent, weights, self.worker.precision.precision, time.monotonic())

    def backward(self, key: Hashable, grad: Tensor) -> Tensor:
        grad_input = self.worker.backward(key, grad)
        self.book.complete(key, grad.detach().float(), grad_input)
        return grad_input

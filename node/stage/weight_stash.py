"""Weight stashing: the weights a block stage's forward ran with, kept until that microbatch's backward.

A stage with several microbatches in flight steps its optimizer between a microbatch's forward and
its backward (docs/reliability.md, "Staleness"). The optimizer updates the parameters in place,
which invalidates the autograd graph the forward saved, so without a copy the backward must run
the forward again on the stored input with the new weights (what hivemind's expert backends do,
since their servers keep no activations). PipeDream (Narayanan et al., "PipeDream: Generalized
Pipeline Parallelism for DNN Training", SOSP 2019, section 3.3) keeps instead the weight version a
forward used for its backward: the gradient is then that of the loss the forward really produced,
delayed by the same number of steps, and the stage skips the second forward (about a quarter of a
block stage's compute here, docs/changes.md).

A stash is made at most once per weight version (the first forward after a step or a gossip
update copies the parameters; later forwards share it) and lives as long as a stored microbatch
refers to it. `limit` bounds the copies alive at once: past it a forward runs on the live weights
and its backward recomputes when they changed, so memory never grows with the window.

Pure torch, no networking; called only from the stage's compute thread (node/stage/stage_worker.py).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from torch import Tensor, nn
from torch.func import functional_call


@dataclass(eq=False)  # identity semantics: a stash is one copy, held in a WeakSet
class StashedWeights:
    """One copy of a stage's parameters, as leaves the backward differentiates against."""

    versions: tuple[int, ...]  # the live parameters' version counters when copied
    named: dict[str, Tensor]  # parameter name -> copy (requires_grad), in module.parameters() order

    @property
    def params(self) -> list[Tensor]:
        """The copies in module.parameters() order: what the backward differentiates against."""
        return list(self.named.values())


class WeightStashes:
    """The stashes of one stage's module: made lazily per weight version, at most `limit` alive."""

    def __init__(self, module: nn.Module, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"the stash limit must be >= 0, got {limit}")
        self.module = module
        self.limit = limit
        self._live: weakref.WeakSet[StashedWeights] = weakref.WeakSet()
        self._current: StashedWeights | None = None
        self.made = 0  # stashes made so far

    def __len__(self) -> int:
        """Stashes alive: the current one and those stored microbatches still refer to."""
        return len(self._live)

    def for_forward(self, versions: tuple[int, ...]) -> StashedWeights | None:
        """The stash a forward at these parameter versions should run on; None: run on the live
        weights (stashing off, or `limit` copies already alive)."""
        if self.limit == 0:
            return None
        current = self._current
        if current is not None and current.versions == versions:
            return current
        self._current = None  # this worker's own hold on the old version goes first
        if len(self._live) >= self.limit:
            return None
        named = {name: p.detach().clone().requires_grad_(True) for name, p in self.module.named_parameters()}
        stash = StashedWeights(versions, named)
        self._live.add(stash)
        self._current = stash
        self.made += 1
        return stash

    def forward(self, stash: StashedWeights | None, *inputs: Tensor) -> Tensor:
        """The module's forward on the stash's weights, or on the live ones when `stash` is None."""
        if stash is None:
            return self.module(*inputs)
        return functional_call(self.module, stash.named, inputs)

    def clear(self) -> None:
        """Drop this worker's hold on the current stash (stored microbatches keep theirs)."""
        self._current = None

"""The simulator's training data: a second-order Markov chain, where the block stages matter.

Moved here from tests/unit/test_checkfree_experiment.py, which imports it from this module. The
project's synthetic source (node/model/data.py) is first order: any function of the current token is
already representable by the embedding alone, so losing or rebuilding a block stage changes the
loss by less than the batch noise (docs/recovery.md). With a second-order chain the blocks must
carry the previous token (attention) and combine it (MLP): skipping a block stage costs ~0.35-0.4
nats, so recovery strategies can be told apart.
"""

from __future__ import annotations

import numpy as np
import torch


class SecondOrderMarkov:
    """x_t ~ P[x_{t-2}, x_{t-1}, :]: `branching` successors per pair of tokens, Dirichlet(1) weights.

    The chain is a function of `seed`; `stream` picks an independent sample path (one per stage-0
    replica, and one for held-out batches)."""

    def __init__(self, vocab: int, branching: int, seed: int, stream: int) -> None:
        chain = np.random.default_rng(seed)
        self.vocab, self.branching = vocab, branching
        self.successors = chain.integers(0, vocab, size=(vocab, vocab, branching))
        self.cumulative = np.cumsum(chain.dirichlet(np.ones(branching), size=(vocab, vocab)), axis=-1)
        self.rng = np.random.default_rng(10_000 + stream)

    def next_batch(self, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = np.empty((batch, seq + 1), dtype=np.int64)
        x[:, :2] = self.rng.integers(0, self.vocab, size=(batch, 2))
        for t in range(2, seq + 1):
            k = (self.cumulative[x[:, t - 2], x[:, t - 1]] <= self.rng.random((batch, 1))).sum(axis=1)
            x[:, t] = self.successors[x[:, t - 2], x[:, t - 1], np.minimum(k, self.branching - 1)]
        tokens = torch.from_numpy(x)  # host: data, moved by StageWorker.tokens_from_wire
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

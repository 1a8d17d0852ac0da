"""The simulator's training data: a second-order Markov chain, where the block stages matter, or
real text prepared by `node prepare-data` (SimSettings.data), read as a stage-0 peer reads it.

Moved here from tests/unit/test_checkfree_experiment.py, which imports it from this module. The
project's synthetic source (node/model/data.py) is first order: any function of the current token is
already representable by the embedding alone, so losing or rebuilding a block stage changes the
loss by less than the batch noise (docs/recovery.md). With a second-order chain the blocks must
carry the previous token (attention) and combine it (MLP): skipping a block stage costs ~0.35-0.4
nats, so recovery strategies can be told apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from node.config import DataConfig, SwarmConfig
from node.model.data import open_heldout, open_source

MARKOV_BRANCHING = 2  # successors per token pair: a chain the small model learns well below ln V
HELD_OUT_STREAM = 999


class BatchSource(Protocol):
    def next_batch(self, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def uses_prepared_data(data: DataConfig) -> bool:
    """Whether the run trains on a `node prepare-data` directory (SimSettings.data) instead of the chain."""
    return bool(data.tokenizer_hash) and Path(data.source).is_dir()


def training_source(config: SwarmConfig, replica: int) -> BatchSource:
    """Stage-0 replica `replica`'s data: its own stream of the chain, or of train.bin through
    node/model/data.py's open_source (what a stage-0 peer with --data reads)."""
    if uses_prepared_data(config.data):
        return open_source(config, None, stream_id=1 + replica)
    return SecondOrderMarkov(config.model.vocab_size, MARKOV_BRANCHING, config.seed, stream=1 + replica)


def held_out_source(config: SwarmConfig) -> BatchSource:
    """The held-out batches every variant of a run is measured on: val.bin (open_heldout, which no
    replica trains on) or another stream of the chain."""
    if uses_prepared_data(config.data):
        return open_heldout(config, None)
    return SecondOrderMarkov(config.model.vocab_size, MARKOV_BRANCHING, config.seed, HELD_OUT_STREAM)


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

"""One microbatch through a whole pipeline of StageWorkers in one process, as the swarm would run it.

The reference the pipeline tests and the single-process benchmark (tests/benchmarks/bench_swarm.py)
compare a swarm with: stage 0 embeds, the block stages run forward, stage 0 takes the loss and its
gradient, the block stages run backward in reverse, stage 0 finishes with the embedding's backward.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from node.stage.stage_worker import StageWorker


def chain_microbatch(
    workers: Sequence[StageWorker], key: Hashable, tokens: torch.Tensor, targets: torch.Tensor
) -> float:
    """Train on one microbatch through `workers` (stage 0 first); returns its loss."""
    hidden = workers[0].embed(key, tokens)
    for worker in workers[1:]:
        hidden = worker.forward(key, hidden)
    loss, grad = workers[0].head_loss_backward(key, hidden, targets)
    for worker in reversed(workers[1:]):
        grad = worker.backward(key, grad)
    workers[0].embed_backward(key, grad)
    return loss

"""Forward-only passes through a stage's module: nothing stored, no gradient, no optimizer,
throughput or gradient-gate state changed.

An evaluation microbatch (protocol/microbatch_header.py: `purpose = eval`) runs its stage through
`eval_embed`, `eval_forward` and `eval_loss`, on the stage worker's compute thread
(`worker.compute(eval_forward, worker, hidden)`), like every other use of its module. They check
their inputs with the worker's own wire-input checks: an evaluation microbatch from a stranger is
no more trusted than a training one.

`chain_loss` is the simulation's measure (node/simulate/swarm.py): the workers of every stage in one
process, their own tensors passed from one to the next, nothing from the wire.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from node.stage.admission import RejectedInput
from node.stage.stage_worker import StageWorker


def _stage_kind(worker: StageWorker, block: bool) -> None:
    if (worker.stage != 0) != block:
        raise ValueError(f"stage {worker.stage} cannot run this part of an evaluation microbatch")


def eval_embed(worker: StageWorker, tokens: Tensor) -> Tensor:
    """Stage 0: tokens [B, T] -> hidden [B, T, H] (host, fp32), nothing remembered."""
    _stage_kind(worker, block=False)
    ids = worker.tokens_from_wire("eval tokens", tokens)
    with torch.no_grad(), worker.precision.autocast():
        return worker.transfers.to_host([worker.module.embed(ids).to(worker.dtype)])[0]


def eval_forward(worker: StageWorker, hidden: Tensor) -> Tensor:
    """A block stage: hidden [B, T, H] -> [B, T, H] (host, fp32), nothing remembered."""
    _stage_kind(worker, block=True)
    x = worker.hidden_from_wire("eval input", hidden)
    with torch.no_grad(), worker.precision.autocast():
        return worker.transfers.to_host([worker.module(x).to(worker.dtype)])[0]


def eval_loss(worker: StageWorker, hidden: Tensor, targets: Tensor) -> float:
    """Stage 0: mean cross-entropy of the last block stage's output against `targets` (the origin's
    own copy). RejectedInput when the returned hidden states are misshapen or give no finite loss."""
    _stage_kind(worker, block=False)
    tgt = worker.tokens_from_wire("eval targets", targets)
    h = worker.hidden_from_wire(
        "eval head input", hidden, shape=torch.Size((*tgt.shape, worker.config.model.hidden_size))
    )
    with torch.no_grad(), worker.precision.autocast():
        loss = float(worker.module.loss(h, tgt))
    if not math.isfinite(loss):
        raise RejectedInput(f"evaluation loss is not finite ({loss}): the returned hidden states are unusable")
    return loss


@torch.no_grad()
def chain_loss(chain: Sequence[StageWorker], tokens: Tensor, targets: Tensor) -> float:
    """Mean cross-entropy of `tokens` against `targets` through `chain` (stage 0's worker, then one
    worker of each block stage in order), in the weights' own dtype, on tensors of this process: no
    wire checks, no autocast, no copies between devices."""
    edge, *blocks = chain
    hidden = edge.module.embed(tokens)
    for worker in blocks:
        hidden = worker.module(hidden)
    return float(edge.module.loss(hidden, targets))

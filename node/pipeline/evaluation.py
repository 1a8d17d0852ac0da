"""Forward-only microbatches: held-out loss measured through the same routed path as training.

A stage-0 peer marks an evaluation microbatch with `purpose = eval` in its FORWARD meta. It then
takes the normal stage order (CheckFree+'s swaps are a training device), and every peer on its path
runs its stage under `torch.no_grad()`: nothing is stored, no gradient flows back, no optimizer,
throughput or gradient-gate state changes. The origin computes the loss on the returned hidden
states and the microbatch ends there (no BACKWARD).

The functions below run on the stage worker's compute thread (`worker.compute(eval_forward, worker,
hidden)`), like every other use of its module, and check their inputs with the worker's own
wire-input checks: an evaluation microbatch from a stranger is no more trusted than a training one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import torch
from torch import Tensor

from node.stage.admission import RejectedInput
from node.stage.stage_worker import StageWorker
from protocol import ProtocolError

PURPOSE_KEY = "purpose"  # FORWARD meta key; absent means training (what every older peer sends)


class MicrobatchPurpose(StrEnum):
    """Why a microbatch travels: to train (forward, then backward) or to evaluate (forward only)."""

    TRAIN = "train"
    EVAL = "eval"


def purpose_of(meta: Mapping[str, Any]) -> MicrobatchPurpose:
    """The purpose a FORWARD message states; ProtocolError for anything but a known value."""
    raw = meta.get(PURPOSE_KEY, MicrobatchPurpose.TRAIN.value)
    try:
        return MicrobatchPurpose(raw)
    except ValueError:
        raise ProtocolError(f"unknown microbatch purpose {str(raw)[:32]!r}") from None


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

"""Forward-only microbatches: held-out loss measured through the same routed path as training.

A stage-0 peer marks an evaluation microbatch with `purpose = eval` in its FORWARD meta. It then
takes the normal stage order (CheckFree+'s swaps are a training device), and every peer on its path
runs its stage under `torch.no_grad()`: nothing is stored, no gradient flows back, no optimizer,
throughput or gradient-gate state changes. The origin computes the loss on the returned hidden
states and the microbatch ends there (no BACKWARD).

This module is what the wire says (the purpose in the meta); the passes themselves are the stage
floor's (node/stage/forward_only.py: eval_embed, eval_forward, eval_loss), run on the stage
worker's compute thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

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

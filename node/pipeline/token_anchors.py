"""The token ids a FORWARD carries beside its hidden states while the swarm's hops travel in a
subspace codec, which anchors the hidden states to them (protocol/subspace.py, docs/wire.md): from
stage 0, where the microbatch's tokens are, through every block stage to the last hop."""

from __future__ import annotations

import torch

from node.config import TrainingConfig
from protocol import ANCHOR_IDS, Message
from protocol.tensors import SUBSPACE_BITS


def hop_token_ids(tokens: torch.Tensor, training: TrainingConfig) -> dict[str, torch.Tensor]:
    """What a FORWARD carries beside the hidden states from stage 0 on: the microbatch's token ids
    while the hops travel in a subspace codec, which anchors the hidden states to them
    (protocol/subspace.py), in int16 while they fit (2 bytes a token); nothing otherwise."""
    if training.wire_compression not in SUBSPACE_BITS:
        return {}
    narrow = tokens.numel() == 0 or int(tokens.max()) < (1 << 15)
    return {ANCHOR_IDS: tokens.to(torch.int16 if narrow else torch.int32)}


def carried_token_ids(msg: Message, training: TrainingConfig) -> dict[str, torch.Tensor]:
    """The token ids a block stage passes on with its output: those that came in, while the hops
    travel in a subspace codec (the decoder already checked they name the hidden states' rows)."""
    ids = msg.tensors.get(ANCHOR_IDS)
    return {ANCHOR_IDS: ids} if ids is not None and training.wire_compression in SUBSPACE_BITS else {}

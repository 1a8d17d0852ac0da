"""The token ids a FORWARD carries beside its hidden states while the swarm's hops travel in a
subspace codec, which anchors the hidden states to them (protocol/subspace.py, docs/wire.md): from
stage 0, where the microbatch's tokens are, through every block stage to the last hop."""

from __future__ import annotations

import torch

from node.config import ModelConfig, TrainingConfig
from protocol import ANCHOR_IDS, Message, wire_nbytes
from protocol.tensors import SUBSPACE_BITS


def token_id_dtype(model: ModelConfig) -> torch.dtype:
    """int16 while the vocabulary fits (2 bytes a token: every preset's 32000), else int32."""
    return torch.int16 if model.vocab_size <= 1 << 15 else torch.int32


def hop_token_ids(tokens: torch.Tensor, training: TrainingConfig, model: ModelConfig) -> dict[str, torch.Tensor]:
    """What a FORWARD carries beside the hidden states from stage 0 on: the microbatch's token ids
    while the hops travel in a subspace codec, which anchors the hidden states to them
    (protocol/subspace.py); nothing otherwise."""
    if training.wire_compression not in SUBSPACE_BITS:
        return {}
    return {ANCHOR_IDS: tokens.to(token_id_dtype(model))}


def forward_hop_nbytes(t: TrainingConfig, m: ModelConfig) -> int:
    """The tensor bytes of one training FORWARD in the usual codec: the hidden states, and the token
    ids with them in a subspace codec (what the simulator's links carry, what the benchmarks count)."""
    hidden = torch.empty((t.microbatch_size, t.sequence_length, m.hidden_size), device="meta")
    ids = torch.empty(hidden.shape[:-1], dtype=token_id_dtype(m), device="meta")
    return sum(wire_nbytes(x, t.wire_compression) for x in (hidden, *hop_token_ids(ids, t, m).values()))


def carried_token_ids(msg: Message, training: TrainingConfig) -> dict[str, torch.Tensor]:
    """The token ids a block stage passes on with its output: those that came in, while the hops
    travel in a subspace codec (the decoder already checked they name the hidden states' rows)."""
    ids = msg.tensors.get(ANCHOR_IDS)
    return {ANCHOR_IDS: ids} if ids is not None and training.wire_compression in SUBSPACE_BITS else {}

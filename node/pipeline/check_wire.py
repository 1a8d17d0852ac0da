"""The messages of a spot-check (protocol/messages.py holds their schemas; docs/verification.md the
exchange):

    checker -> replica   CHECK (a microbatch it saw: origin, id, token) or AUDIT (an input and a probe)
    replica -> checker   COMMITMENT: its precision, a digest per layer of its weights, per forward
                         boundary h_0..h_L and per backward boundary g_0..g_L
    checker -> replica   OPEN: the layer it picked at random, and the boundaries it wants
    replica -> checker   OPENING: that layer's weights and those boundaries, bit-exact

Tensors that must arrive bit-exact travel as the int32 view of their fp32 bytes: the transport
compresses float tensors (training.wire_compression) and leaves integer ones alone. They are
checked after decoding like every wire tensor: dtype, shape, size, finiteness.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from node.config import Precision
from node.pipeline.spot_check import is_digest, parse_precision
from protocol import Message

CHECK_SERVICE = "check"
WEIGHTS = "weights"


def forward_name(index: int) -> str:
    return f"forward.{index}"


def backward_name(index: int) -> str:
    return f"backward.{index}"


def exact(tensor: Tensor) -> Tensor:
    """A host fp32 tensor as its bits (int32), which no wire codec alters."""
    return tensor.detach().float().contiguous().view(torch.int32)


def from_exact(tensor: Tensor, shape: tuple[int, ...], what: str) -> Tensor:
    """The fp32 tensor whose bits `tensor` carries; ValueError unless it has `shape` and is finite."""
    if tensor.dtype != torch.int32 or tuple(tensor.shape) != shape:
        raise ValueError(f"{what}: expected int32 bits of shape {shape}, got {tensor.dtype} {tuple(tensor.shape)}")
    values = tensor.contiguous().view(torch.float32)
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{what} is not finite")
    return values


@dataclass(frozen=True)
class CommitmentReply:
    """A replica's commitment, checked for shape: `layers` weight digests, `layers + 1` digests of
    forward boundaries, and as many backward ones or none (its backward has not run yet)."""

    commitment: int
    precision: Precision
    weights: list[str]
    forward: list[str]
    backward: list[str]

    @classmethod
    def parse(cls, message: Message, layers: int) -> CommitmentReply:
        meta = message.meta
        precision = parse_precision(meta["precision"])
        if precision is None:
            raise ValueError(f"commitment in an unknown precision {meta['precision']!r:.40}")
        weights, forward, backward = meta["weights"], meta["forward"], meta["backward"]
        if len(weights) != layers or len(forward) != layers + 1 or len(backward) not in (0, layers + 1):
            raise ValueError(
                f"commitment of {len(weights)} layers, {len(forward)} forward and {len(backward)} backward "
                f"boundaries for a stage of {layers} layers"
            )
        if not all(is_digest(text) for text in (*weights, *forward, *backward)):
            raise ValueError("commitment holds something other than digests")
        return cls(meta["commitment"], precision, list(weights), list(forward), list(backward))

    @property
    def has_backward(self) -> bool:
        return bool(self.backward)

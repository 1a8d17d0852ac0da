"""What a stage worker accepts from the wire: tensors from other peers are checked before any
compute touches them, and a microbatch's own gradients are checked before they join the step.

Everything here raises `RejectedInput` (a ValueError) and changes nothing: a rejected microbatch is
dropped alone, the honest gradients already accumulated for the step survive, and the pipeline
counts the rejection against the peer that sent it (node/pipeline/origin.py, block_relay.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from node.config import ModelConfig
from node.runtime.device import DeviceTransfers
from node.runtime.finite import all_finite, is_finite

INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

# An incoming gradient whose norm exceeds this many times the running norm of the gradients this
# stage accepted is absurd: honest gradient norms drift by a few x over training (warmup, loss
# plateaus), not by three orders of magnitude from one microbatch to the next.
ABSURD_NORM_FACTOR = 1e3
# The yardstick is never taken below this: a model whose gradients collapsed (a diverging swarm saw a
# typical 7e-11) would otherwise refuse an honest 2000x recovery toward normal sizes and ban honest
# peers for it. A ceiling of at least 1e-3 lets a hostile peer push nothing larger than what this
# model's honest hidden-state gradients already are (1e-3 to 1 for the default model).
TYPICAL_NORM_FLOOR = 1e-6
# The running norm needs a few honest samples before it can judge anything.
GATE_WARMUP_SAMPLES = 8
GATE_EMA = 0.1


class RejectedInput(ValueError):
    """A tensor from another peer (or what it produced here) is unusable; nothing was changed."""


def check_batch_shape(what: str, batch: int, seq: int, max_batch: int, max_positions: int) -> None:
    if not 1 <= batch <= max_batch:
        raise RejectedInput(f"{what}: batch size {batch} outside 1..{max_batch}")
    if not 1 <= seq <= max_positions:
        raise RejectedInput(f"{what}: sequence length {seq} outside 1..{max_positions} (max_position_embeddings)")


def check_hidden(
    what: str,
    hidden: object,
    *,
    hidden_size: int,
    max_batch: int,
    max_positions: int,
    dtype: torch.dtype,
    shape: torch.Size | None = None,
) -> Tensor:
    """A [batch, seq, hidden] floating tensor, finite after the cast to the module's dtype, where it
    is: a tensor from the wire is checked on the host, before it costs the device anything
    (StageWorker.hidden_from_wire moves it after)."""
    if not isinstance(hidden, Tensor):
        raise RejectedInput(f"{what}: expected a tensor, got {type(hidden).__name__}")
    if not hidden.is_floating_point():
        raise RejectedInput(f"{what}: expected a floating-point tensor, got {hidden.dtype}")
    if shape is not None:
        if hidden.shape != shape:
            raise RejectedInput(f"{what}: shape {tuple(hidden.shape)} does not match the stored {tuple(shape)}")
    else:
        if hidden.dim() != 3:
            raise RejectedInput(f"{what}: expected [batch, seq, hidden], got shape {tuple(hidden.shape)}")
        check_batch_shape(what, hidden.shape[0], hidden.shape[1], max_batch, max_positions)
        if hidden.shape[2] != hidden_size:
            raise RejectedInput(f"{what}: hidden size {hidden.shape[2]} != {hidden_size}")
    hidden = hidden.detach().to(dtype=dtype)
    if not is_finite(hidden):  # checked after the cast: fp32 values may overflow fp16
        raise RejectedInput(f"{what}: contains NaN or infinite values")
    return hidden


def check_tokens(
    what: str,
    tokens: object,
    *,
    vocab_size: int,
    max_batch: int,
    max_positions: int,
    shape: torch.Size | None = None,
) -> Tensor:
    """A [batch, seq] integer tensor of ids in [0, vocab_size), as int64, where it is (the host, for
    a tensor from the wire: its range is read there without a device sync)."""
    if not isinstance(tokens, Tensor):
        raise RejectedInput(f"{what}: expected a tensor, got {type(tokens).__name__}")
    if tokens.dtype not in INT_DTYPES:
        raise RejectedInput(f"{what}: expected an integer tensor, got {tokens.dtype}")
    if tokens.dim() != 2:
        raise RejectedInput(f"{what}: expected [batch, seq], got shape {tuple(tokens.shape)}")
    if shape is not None and tokens.shape != shape:
        raise RejectedInput(f"{what}: shape {tuple(tokens.shape)} does not match {tuple(shape)}")
    check_batch_shape(what, tokens.shape[0], tokens.shape[1], max_batch, max_positions)
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        raise RejectedInput(f"{what}: token ids must be in [0, {vocab_size}), got range [{lo}, {hi}]")
    return tokens.detach().to(dtype=torch.long)


class WireInputs:
    """The wire-input checks bound to one stage's sizes: `check_*` run where the tensor is (the host,
    for one from the wire: no device sync), `*_from_wire` then copy it to the stage's device."""

    def __init__(self, model: ModelConfig, dtype: torch.dtype, max_batch: int, transfers: DeviceTransfers) -> None:
        self.hidden_size, self.vocab_size, self.dtype = model.hidden_size, model.vocab_size, dtype
        self.bounds = {"max_batch": max_batch, "max_positions": model.max_position_embeddings}
        self.transfers = transfers

    def check_hidden(self, what: str, hidden: object, shape: torch.Size | None = None) -> Tensor:
        return check_hidden(what, hidden, hidden_size=self.hidden_size, dtype=self.dtype, shape=shape, **self.bounds)

    def check_tokens(self, what: str, tokens: object, shape: torch.Size | None = None) -> Tensor:
        return check_tokens(what, tokens, vocab_size=self.vocab_size, shape=shape, **self.bounds)

    def hidden_from_wire(self, what: str, hidden: object, shape: torch.Size | None = None) -> Tensor:
        """A hidden-state tensor from another peer, checked on the host, then on the stage's device."""
        return self.transfers.to_device(self.check_hidden(what, hidden, shape))

    def tokens_from_wire(self, what: str, tokens: object, shape: torch.Size | None = None) -> Tensor:
        """Token ids from the wire (or the local data), checked on the host, then on the stage's device."""
        return self.transfers.to_device(self.check_tokens(what, tokens, shape))


def check_finite(what: str, tensors: Sequence[Tensor | None]) -> None:
    """Every tensor finite (None entries are unused parameters)."""
    if not all_finite(tensors):
        raise RejectedInput(f"{what}: not finite")


class GradientGate:
    """Refuses incoming gradients whose norm is absurd next to the ones this stage accepted.

    Keeps an EMA of accepted norms; until GATE_WARMUP_SAMPLES have been seen only finiteness is
    checked (a new stage has no yardstick yet). The ceiling is ABSURD_NORM_FACTOR x the EMA, never
    below ABSURD_NORM_FACTOR x TYPICAL_NORM_FLOOR."""

    def __init__(self, factor: float = ABSURD_NORM_FACTOR):
        self.factor = factor
        self.typical: float | None = None
        self.samples = 0

    def check(self, what: str, grad: Tensor) -> float:
        """The gradient's norm, if acceptable; RejectedInput otherwise. Does not learn from it. Give
        it the host tensor from the wire: on a device, reading the norm is a sync."""
        norm = float(torch.linalg.vector_norm(grad.float()))
        if not math.isfinite(norm):
            raise RejectedInput(f"{what}: norm is not finite")
        if self.samples >= GATE_WARMUP_SAMPLES and self.typical is not None:
            ceiling = self.factor * max(self.typical, TYPICAL_NORM_FLOOR)
            if norm > ceiling:
                raise RejectedInput(
                    f"{what}: norm {norm:.3g} is over {ceiling:.3g} ({self.factor:g}x the typical {self.typical:.3g})"
                )
        return norm

    def accept(self, norm: float) -> None:
        """Learn from a gradient whose microbatch went through."""
        self.samples += 1
        self.typical = norm if self.typical is None else (1 - GATE_EMA) * self.typical + GATE_EMA * norm


def check_state_dict(own: dict[str, Tensor], incoming: dict[str, Tensor]) -> None:
    """Weights from elsewhere (a donor, a partner, a checkpoint) fit this module exactly and are finite."""
    missing, extra = sorted(set(own) - set(incoming)), sorted(set(incoming) - set(own))
    if missing or extra:
        raise RejectedInput(f"state dict mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, value in incoming.items():
        if not isinstance(value, Tensor) or value.shape != own[name].shape:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise RejectedInput(f"{name}: expected shape {tuple(own[name].shape)}, got {shape}")
        if not value.is_floating_point() or not is_finite(value):
            raise RejectedInput(f"{name}: weights must be finite floating-point values")

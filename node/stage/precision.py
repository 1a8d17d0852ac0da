"""Mixed precision for one stage: which arithmetic its compute uses, and fp16's loss scaling.

What stays float32 whatever `training.precision` says: the module's parameters (the master
weights), their .grad accumulation, AdamW's moments and the NoLoCo outer state (phi, momentum;
node/averaging/noloco.py builds them in fp32 from fp32 parameters). Only the compute runs under
`torch.autocast`: matmuls in bf16/fp16, reductions, RMSNorm statistics and the cross-entropy in
fp32 (autocast's own op lists, plus node/model/llama.py's explicit casts). A block stage's output
is the residual stream, fp32 + low-precision branch = fp32, so what goes on the wire is fp32 and is
encoded by `training.wire_compression` alone.

`auto` is resolved per peer, not per swarm: the swarm config is shared (and hashed) while a swarm
mixes CPUs and GPUs. A CUDA device with native bf16 (compute capability >= 8.0) computes in bf16;
an older CUDA GPU in fp16 with the loss scaling below (its tensor cores, where it has them, and half
the activation memory); anything else (CPU, MPS) in fp32. Replicas of a stage at different precisions still
gossip: they exchange fp32 weights.

fp16 and its loss scale. fp16 has 5 exponent bits: gradients below ~6e-8 vanish, so the backward
runs on gradients multiplied by a scale S and the parameter gradients are divided by S (in fp32)
before they join the step. In a pipeline the usual single GradScaler at the loss does not fit:
stage 0 owns the loss, every stage owns its gradients, and a block stage mixes microbatches of
many stage-0 peers (SWARM), each of which would bring its own scale. So the scaling is local to
each stage's backward: a stage multiplies the (true) gradient it received by its own S, runs its
backward, and divides both its parameter gradients and the gradient it sends upstream by S. The
consequences:

- nothing about the scale travels on the wire; gradients between stages are true gradients, so
  `wire_compression` and the per-microbatch GradientGate (node/stage/admission.py) see the same
  magnitudes as in fp32 and a scale change never looks like an absurd gradient;
- clipping and the CheckFree gradient norm see unscaled fp32 gradients (they are unscaled before
  accumulation);
- an overflow (inf/NaN in the scaled gradients) is this stage's own business: the attempt is
  skipped, S is halved (GradScaler's backoff 0.5) and the backward is redone from the retained
  graph at the lower scale, at most MAX_BACKOFFS times. An overflow therefore never reaches
  check_finite as a "hostile" gradient, and never costs an honest neighbour a strike. S doubles
  after GROWTH_INTERVAL overflow-free backward passes (GradScaler's growth factor 2; its interval
  is counted here in microbatches, not optimizer steps).

This is per-microbatch skipping, not per-step: with the gradient accumulated over
microbatches_per_step microbatches, dropping a whole step for one overflow would discard the
honest microbatches already accumulated, which the pipeline otherwise never does.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from node.config import Precision
from node.runtime.finite import all_finite

__all__ = [
    "GROWTH_INTERVAL",
    "INIT_SCALE",
    "MAX_BACKOFFS",
    "LossScaler",
    "StagePrecision",
    "autocast_dtype",
    "resolve_precision",
]

INIT_SCALE = 2.0**16  # torch.amp.GradScaler's default
GROWTH_INTERVAL = 2000  # overflow-free backward passes before the scale doubles (GradScaler's default)
MIN_SCALE = 1.0  # below 1 the scale would shrink gradients: an overflow at 1 is not a scaling problem
MAX_BACKOFFS = 24  # 2**16 halves to 1 in 16 backoffs; 24 bounds the retries with room to spare


def resolve_precision(requested: Precision, device: torch.device | str) -> Precision:
    """The concrete precision (never AUTO) this peer computes in on `device`.

    AUTO: bf16 on a CUDA device with native bf16 support, fp16 (loss-scaled) on an older CUDA
    device, fp32 elsewhere (on CPU bf16 autocast runs, but is slower than fp32 for these shapes:
    docs/model.md "Precision"). Explicit values are honoured on any device (bf16 and fp16 autocast
    both run on CPU, which is what the tests use).
    """
    requested = Precision(requested)
    if requested is not Precision.AUTO:
        return requested
    device = torch.device(device)
    if device.type != "cuda":
        return Precision.FP32
    native_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)  # of the current CUDA device
    return Precision.BF16 if native_bf16 else Precision.FP16


def autocast_dtype(precision: Precision) -> torch.dtype | None:
    """The autocast dtype of a concrete precision; None for fp32 (no autocast)."""
    return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(Precision(precision))


class LossScaler:
    """A dynamic loss scale with torch.amp.GradScaler's rule (x0.5 on overflow, x2 after a run of
    GROWTH_INTERVAL clean passes). Disabled (scale 1, never changes) unless the precision is fp16."""

    def __init__(self, enabled: bool, init_scale: float = INIT_SCALE, growth_interval: int = GROWTH_INTERVAL):
        if not (math.isfinite(init_scale) and init_scale >= MIN_SCALE) or growth_interval < 1:
            raise ValueError("init_scale must be finite and >= 1, growth_interval >= 1")
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval = growth_interval
        self.clean = 0  # overflow-free passes since the last change of the scale
        self.skipped = 0  # scaled backward attempts discarded for inf/NaN gradients

    def update(self, found_inf: bool) -> None:
        """Record one scaled backward attempt: back off after an overflow, grow after a clean run."""
        if not self.enabled:
            return
        if found_inf:
            self.skipped += 1
            self.clean = 0
            self.scale = max(self.scale * 0.5, MIN_SCALE)
            return
        self.clean += 1
        if self.clean >= self.growth_interval:
            self.clean = 0
            self.scale *= 2.0


class StagePrecision:
    """One stage's precision: the autocast context of its forward passes and the scaled backward."""

    def __init__(self, requested: Precision, device: torch.device | str):
        self.device = torch.device(device)
        self.precision = resolve_precision(requested, self.device)
        self.dtype = autocast_dtype(self.precision)
        self.scaler = LossScaler(enabled=self.precision is Precision.FP16)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Wrap every forward computation (the training forward and its recomputations) in this."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def grad(self, output: Tensor, inputs: Sequence[Tensor], grad_output: Tensor | None = None) -> list[Tensor | None]:
        """torch.autograd.grad(output, inputs, grad_output) with this stage's loss scale.

        The backward ops run in the dtypes autocast chose for the forward (no autocast needed
        here). With fp16 the graph is retained while attempts overflow, each overflow halves the
        scale, and the returned gradients are unscaled in fp32. Non-finite gradients that survive
        MAX_BACKOFFS (or come without scaling) are returned as they are: the caller's check_finite
        decides what they mean.
        """
        if grad_output is None:
            grad_output = torch.ones_like(output)
        if not self.scaler.enabled:
            return list(torch.autograd.grad(output, list(inputs), grad_output, allow_unused=True))
        for attempt in range(MAX_BACKOFFS + 1):
            scale = self.scaler.scale
            last = attempt == MAX_BACKOFFS or scale <= MIN_SCALE
            grads = torch.autograd.grad(
                output, list(inputs), grad_output * scale, retain_graph=not last, allow_unused=True
            )
            found_inf = not all_finite(grads)
            self.scaler.update(found_inf)
            if not found_inf or last:
                break
        # unscale in fp32: these are what accumulate into the fp32 .grad and what goes on the wire
        return [None if g is None else g.float() / scale for g in grads]

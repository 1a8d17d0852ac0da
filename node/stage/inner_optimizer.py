"""The arithmetic of one stage's inner optimizer, apart from the worker that runs it.

Pure functions of tensors and the config, no state of their own: the learning-rate schedule, how
many backward passes make a step, adding a microbatch's gradients, the clipped AdamW step, the
throughput estimate and the forward+backward timing a peer announces. node/stage/stage_worker.py
calls them on the stage's compute thread. On a GPU none of them reads the device more than once per
call: the gradients are added and scaled with foreach kernels, the clip is applied on the device and
only the total norm is read back, and the timing synchronizes before each clock reading.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from node.config import ModelConfig, TrainingConfig
from node.runtime.device import DeviceTransfers
from node.runtime.finite import all_finite
from protocol.stage_state import MOMENT_KINDS

__all__ = [
    "ADAM_BETAS",
    "ADAM_EPS",
    "THROUGHPUT_EMA",
    "accumulate",
    "adam_moments",
    "clipped_step",
    "load_adam_moments",
    "lr_at",
    "new_adamw",
    "smoothed_throughput",
    "step_size",
    "time_forward_backward",
]

ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
THROUGHPUT_EMA = 0.1  # weight of the newest sample (SWARM's alpha)


def lr_at(t: TrainingConfig, step: int, lr_scale: float = 1.0) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, cosine decay, then flat.

    step < W:        lr * (step + 1) / W            (W = warmup_steps; the first step is not wasted)
    W <= step < T:   lr * (m + (1 - m) * (1 + cos(pi * (step - W) / (T - W))) / 2)
    step >= T:       lr * m                         (T = total_steps, m = min_lr_ratio)
    all times lr_scale.
    """
    if step < t.warmup_steps:
        factor = (step + 1) / t.warmup_steps
    elif step >= t.total_steps:
        factor = t.min_lr_ratio
    else:
        progress = (step - t.warmup_steps) / (t.total_steps - t.warmup_steps)
        factor = t.min_lr_ratio + (1.0 - t.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.learning_rate * factor * lr_scale


def new_adamw(params: Sequence[nn.Parameter], training: TrainingConfig, lr: float) -> torch.optim.AdamW:
    """A stage's inner optimizer; `lr` is set again before every step (the schedule is lr_at)."""
    return torch.optim.AdamW(params, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=training.weight_decay)


def time_forward_backward(
    module: nn.Module,
    m: ModelConfig,
    stage: int,
    transfers: DeviceTransfers,
    dtype: torch.dtype,
    batch: int,
    seq: int,
    repeats: int,
) -> float:
    """Best-of-`repeats` seconds of one forward+backward of a stage's module on random inputs,
    made on its device; the device is synchronized before each clock reading (on a GPU, kernels
    run after the call that queued them returns)."""
    device = transfers.device
    gen = torch.Generator(device=device).manual_seed(0)
    params = list(module.parameters())
    best = math.inf
    for i in range(repeats + 1):  # the first run warms up allocators and kernels
        transfers.synchronize()
        start = time.perf_counter()
        with torch.enable_grad():
            if stage == 0:
                tokens = torch.randint(0, m.vocab_size, (batch, seq), generator=gen, device=device)
                h = module.embed(tokens)
                loss = module.loss(h, tokens)
                torch.autograd.grad(loss, params, allow_unused=True)
            else:
                x = torch.randn(batch, seq, m.hidden_size, generator=gen, device=device, dtype=dtype)
                x.requires_grad_(True)
                out = module(x)
                torch.autograd.grad(out, [x, *params], torch.ones_like(out))
        transfers.synchronize()
        if i > 0:
            best = min(best, time.perf_counter() - start)
    return best


def smoothed_throughput(previous: float, sample: float) -> float:
    """SWARM's throughput estimate: an EMA of microbatches/s, the first sample taken as it is."""
    return sample if previous <= 0 else (1 - THROUGHPUT_EMA) * previous + THROUGHPUT_EMA * sample


def step_size(training: TrainingConfig, stored: int) -> int:
    """Backward passes per optimizer step for a stage holding `stored` other microbatches between
    their forward and backward: each of those waits about stored / step_size steps for its
    gradient, so larger windows take larger steps and staleness stays <= max_staleness_steps."""
    return max(training.microbatches_per_step, math.ceil(stored / training.max_staleness_steps))


def accumulate(params: Sequence[nn.Parameter], grads: Sequence[Tensor | None]) -> None:
    """Add one microbatch's (checked) parameter gradients to the step's accumulation (on the
    device, no host sync: foreach kernels for the gradients already started)."""
    with torch.no_grad():
        started, added = [], []
        for p, g in zip(params, grads):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g.clone()
            else:
                started.append(p.grad)
                added.append(g)
        if started:
            torch._foreach_add_(started, added)


def clipped_step(
    optimizer: torch.optim.Optimizer, params: Sequence[Tensor], clip: float, lr: float, grad_scale: float = 1.0
) -> float | None:
    """One optimizer step on the accumulated gradients times `grad_scale`, clipped to `clip`: the
    clipped norm; None (and the gradients dropped) when the norm is not finite; NaN when there was
    nothing to step. One host read per step: the total norm (clip_grad_norm_ computes and applies
    the clip on the device)."""
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return math.nan
    if grad_scale != 1.0:
        with torch.no_grad():
            torch._foreach_mul_([p.grad for p in with_grad], grad_scale)
    total = float(torch.nn.utils.clip_grad_norm_(with_grad, clip))
    if not math.isfinite(total):
        optimizer.zero_grad(set_to_none=True)
        return None
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # the norm of the clipped gradients: clip_grad_norm_ scales by clip / (total + 1e-6) above the clip
    return min(total, clip)


# ------------------------------------------------------------------------------------------------
# AdamW's moments, for a joiner (node/recovery/state_transfer.py)
#
# A joiner that started with fresh moments moved each weight by about lr per step (Adam's first steps
# divide a gradient by its own magnitude) where its stage mates, their moments settled, moved by
# 0.03-0.05 lr: on the 15m preset its first outer Delta came out 12-17x theirs and their gossip
# plausibility check banned it (docs/recovery.md, "State transfer"). So the donor's moments travel
# with its weights, as hivemind's load_state_from_peers sends its optimizer's statistics.


def adam_moments(
    optimizer: torch.optim.Optimizer, named_params: Iterable[tuple[str, Tensor]], dtype: torch.dtype
) -> tuple[dict[str, Tensor], int]:
    """AdamW's moments as `dtype` copies, {"exp_avg.<name>", "exp_avg_sq.<name>"} for each weight it
    has stepped, and its step count ({} and 0 before its first step). Run on the compute thread."""
    moments: dict[str, Tensor] = {}
    steps = 0
    for name, param in named_params:
        state = optimizer.state.get(param)
        if not state:
            continue
        steps = max(steps, int(state["step"]))  # a host tensor (AdamW keeps `step` there unless capturable)
        for kind in MOMENT_KINDS:
            moments[f"{kind}.{name}"] = state[kind].detach().to(dtype, copy=True)
    return moments, steps


def load_adam_moments(
    optimizer: torch.optim.Optimizer,
    named_params: Iterable[tuple[str, Tensor]],
    moments: Mapping[str, Tensor],
    steps: int,
    transfers: DeviceTransfers,
) -> None:
    """Give `optimizer` (fresh, not stepped) the moments `adam_moments` made, on the weights' device
    and dtype; it takes them over (AdamW updates them in place): pass copies, as adam_moments and a
    decoded download are. ValueError, and the optimizer untouched, if a name, shape or value is
    wrong: each weight has both moments or none, second moments are >= 0, everything finite,
    steps >= 1."""
    params = dict(named_params)
    pending: dict[str, dict[str, Tensor]] = {}
    for key, tensor in moments.items():
        kind, _, name = key.partition(".")
        param = params.get(name)
        if kind not in MOMENT_KINDS or param is None or tensor.shape != param.shape or not tensor.is_floating_point():
            raise ValueError(f"moment {key!r} names no weight of this stage, or has another shape")
        pending.setdefault(name, {})[kind] = tensor
    if any(len(found) != len(MOMENT_KINDS) for found in pending.values()):
        raise ValueError("a weight has one of its two moments only")
    if pending and steps < 1:
        raise ValueError(f"moments need a step count >= 1, got {steps}")
    if not all_finite(list(moments.values())):
        raise ValueError("the moments hold NaN or Inf")
    if any(bool((found["exp_avg_sq"] < 0).any()) for found in pending.values()):
        raise ValueError("a second moment is negative")
    for name, found in pending.items():
        param = params[name]
        optimizer.state[param] = {
            "step": torch.tensor(float(steps), device="cpu"),  # host: AdamW keeps a non-capturable step there
            **{kind: transfers.to_device(found[kind], param.dtype) for kind in MOMENT_KINDS},
        }

"""What one peer computes for its stage: forward, backward, gradient accumulation, inner optimizer.

No networking here. The network code receives activations from other peers and runs the
worker's plain synchronous methods off the asyncio event loop::

    out = await worker.compute(worker.forward, key, hidden)

``worker.executor`` is one thread (node/runtime/compute_thread.py), so all of one stage's compute is
serialized. Thread-safety contract: every method that touches the module or the optimizer
(forward, backward, embed, head_loss_backward, embed_backward, measure_throughput, state_dict,
load_state_dict, reset_optimizer) must be called through that executor, and takes no lock.
Bookkeeping of stored activations (``drop``, ``expire``, ``num_stored``) and reading the plain
counters (``inner_step``, ``last_grad_norm``, ``microbatches_done``, ``throughput``) are safe from
any thread, the event loop included: the store is guarded by a small lock, held only for dict
operations, never during compute.

Layout follows docs/algorithms.md: stage 0 (EdgeStage) embeds tokens, then at the end of the
pipeline computes norm + head + loss; block stages (1..S) map hidden -> hidden. Per microbatch:

    stage 0  embed(key, tokens)                     -> hidden           (remembers the graph)
    stage s  forward(key, hidden)                   -> hidden           (remembers input + graph)
    stage 0  head_loss_backward(key, hidden, tgt)   -> (loss, grad)     (grad of loss / mbs_per_step)
    stage s  backward(key, grad)                    -> grad wrt input   (counts; steps when due)
    stage 0  embed_backward(key, grad)                                  (counts; steps when due)

Each stage steps on its own after ``step_size`` completed backward passes: ``microbatches_per_step``,
or more while more microbatches are stored between forward and backward, so that none of them
gets its gradient more than ``max_staleness_steps`` steps late (in a swarm, microbatches of
different stage-0 peers mix at the block stages: SWARM's design).

Weight staleness: a microbatch forwarded before an optimizer step (or any other in-place change of
the weights, e.g. a gossip update through load_state_dict) is backpropagated after it. A block
stage's forward runs on a stashed copy of the weights (node/stage/weight_stash.py, PipeDream's
weight stashing), so its stored graph stays valid and the backward differentiates the loss the
forward really produced; the gradient is added to the live weights. When training.stashed_weights
copies are already alive (or it is 0), the forward runs on the live weights; if they changed
before the backward (the version counters tell), the backward recomputes the forward from the
stored input with the current weights, as hivemind's expert backends always do. Stage 0 always
takes that path: its embedding is one lookup, cheaper to redo than to copy.

Devices (node/runtime/device.py): the module, the stored activations and everything computed live
on the stage's device. Tensors from the wire arrive on the host: each is checked there (shape,
dtype, finiteness, the gradient gate's norm: no device sync) and then copied to the device through
pinned memory (`hidden_from_wire`, `tokens_from_wire`); results go back to the host for the wire in
one synchronizing copy (`_out`), after which a forward's time is read, so throughput is the
compute's, not the kernel launches'. Per microbatch the device is read once more, for the fused
finiteness check of its gradients (node/runtime/finite.py), and once per optimizer step, for the
clipped norm (node/stage/inner_optimizer.py).

Precision (node/stage/precision.py): every forward runs under the stage's autocast and every
backward through ``StagePrecision.grad``, which applies and removes fp16's loss scale within the
stage; weights, gradients, optimizer state and the tensors this worker returns stay fp32.

``module`` is node/stage/'s own: code elsewhere reads the stage through this class's methods and
node/stage/access.py (weights, shapes, moments, the parameters an outer replica steers), and
computes with it through node/stage/forward_only.py and node/stage/layers.py
(tests/unit/test_layout.py enforces it).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from node.config import SwarmConfig
from node.model.llama import BlockStage, EdgeStage, build_stage
from node.runtime.compute_thread import ComputeThread
from node.runtime.device import DeviceTransfers, canonical_device
from node.runtime.meter import Meter
from node.stage.activation_store import ActivationStore, StoredMicrobatch, UnknownMicrobatch
from node.stage.admission import (
    GradientGate,
    RejectedInput,
    WireInputs,
    check_finite,
    check_state_dict,
)
from node.stage.inner_optimizer import (
    ADAM_BETAS,
    ADAM_EPS,
    THROUGHPUT_EMA,
    accumulate,
    clipped_step,
    lr_at,
    new_adamw,
    smoothed_throughput,
    step_size,
    time_forward_backward,
)
from node.stage.precision import StagePrecision
from node.stage.weight_stash import WeightStashes

T = TypeVar("T")

__all__ = [
    "ADAM_BETAS",
    "ADAM_EPS",
    "THROUGHPUT_EMA",
    "StageWorker",
    "UnknownMicrobatch",
    "lr_at",
    "step_size",
]

logger = logging.getLogger(__name__)


class StageWorker:
    """The module, inner optimizer and in-flight activations of one stage on one peer."""

    def __init__(
        self,
        config: SwarmConfig,
        stage: int,
        device: str = "cpu",
        module: nn.Module | None = None,
        lr_scale: float = 1.0,
        max_stored: int | None = None,
        max_batch: int | None = None,
    ) -> None:
        if not 0 <= stage < config.num_stages:
            raise ValueError(f"stage {stage} out of range 0..{config.num_stages - 1}")
        if module is None:
            module = build_stage(config.model, stage, config.seed)
        expected = EdgeStage if stage == 0 else BlockStage
        if not isinstance(module, expected):
            raise TypeError(f"stage {stage} needs a {expected.__name__}, got {type(module).__name__}")
        t = config.training
        self.config = config
        self.stage = stage
        self.device = canonical_device(device)
        self.transfers = DeviceTransfers(self.device)  # the wire's host tensors in, results out
        self.module: nn.Module = module.to(self.device).train()
        self._params = [p for p in self.module.parameters()]
        named = list(self.module.named_parameters())  # stage 0: the embedding, and the norm + head after the blocks
        self._embed_params = [p for n, p in named if n.startswith("embed_tokens.")]
        self._head_params = [p for n, p in named if not n.startswith("embed_tokens.")]
        self.dtype = self._params[0].dtype  # of the master weights and the wire tensors: fp32
        self.precision = StagePrecision(t.precision, self.device)  # compute: autocast, fp16's loss scale
        # the window the memory estimate counts (node/model/memory.py); a service passes what its check admitted
        self.max_stored = max_stored if max_stored is not None else t.max_in_flight
        self.max_batch = max_batch if max_batch is not None else t.microbatch_size
        if self.max_stored < 1 or self.max_batch < 1:
            raise ValueError("max_stored and max_batch must be >= 1")
        self.lr_scale = 1.0
        self.set_lr_scale(lr_scale)
        self.inner_step = 0  # optimizer steps taken (drives the lr schedule; a joiner may set it)
        self.skipped_steps = 0  # steps skipped because the gradient was not finite
        self.last_grad_norm: float | None = None  # norm of the clipped gradient at the last step
        self.microbatches_done = 0  # completed backward passes on this stage
        self.accumulated = 0  # completed backward passes since the last step
        self.throughput = 0.0  # microbatches/s of compute, EMA; 0.0 = not measured yet
        self.meter = Meter()  # times forward/backward/head on the compute thread; a service hands its own
        self.store = ActivationStore(stage, self.max_stored)
        self.stashes = WeightStashes(self.module, t.stashed_weights if stage > 0 else 0)
        self.inputs = WireInputs(config.model, self.dtype, self.max_batch, self.transfers)  # wire checks, then device
        self.check_hidden, self.check_tokens = self.inputs.check_hidden, self.inputs.check_tokens
        self.hidden_from_wire, self.tokens_from_wire = self.inputs.hidden_from_wire, self.inputs.tokens_from_wire
        self._closed = False
        self.gradient_gate = GradientGate()  # refuses absurd gradients from other peers
        self.optimizer: torch.optim.AdamW = new_adamw(self._params, t, self.current_lr)
        self.executor = ComputeThread(f"stage{stage}-worker")

    async def compute(self, fn: Callable[..., T], *args: Any, first: bool = False) -> T:
        """Run `fn(*args)` on this stage's compute thread and wait for it from the event loop; with
        `first`, ahead of the calls queued without it (ComputeThread.run)."""
        return await self.executor.run(self.meter.timed(fn), *args, first=first)

    # ------------------------------------------------------------------------------------------
    # Optimizer, schedule, state

    @property
    def current_lr(self) -> float:
        """The learning rate the next optimizer step will use."""
        return lr_at(self.config.training, self.inner_step, self.lr_scale)

    def set_lr_scale(self, scale: float) -> None:
        """Multiply the schedule by `scale` from the next step on (CheckFree: 1.1 after a rebuild)."""
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"lr_scale must be a finite number > 0, got {scale!r}")
        self.lr_scale = float(scale)

    def reset_optimizer(self) -> None:
        """A fresh AdamW (moments dropped); accumulated gradients and the schedule position stay."""
        self.optimizer = new_adamw(self._params, self.config.training, self.current_lr)

    def adopt(self, weights: dict[str, Tensor], inner_step: int, grad_norm: float | None, lr_scale: float) -> None:
        """Continue from a state that is not this worker's own training (a donor's, a rebuild, a
        save): its weights under a fresh AdamW, its schedule position, last clipped norm and lr
        scale. Besides the worker's own steps, the one writer of its training position."""
        self.load_state_dict(weights, fresh_optimizer=True)
        self.inner_step, self.last_grad_norm = inner_step, grad_norm
        self.set_lr_scale(lr_scale)

    def state_dict(self) -> dict[str, Tensor]:
        """A detached host copy of the module's weights (safe to serialize while training goes on)."""
        return self.transfers.state_to_host(self.module.state_dict())

    def load_state_dict(self, sd: dict[str, Tensor], fresh_optimizer: bool = True) -> None:
        """Copy weights in (names and shapes must match exactly; ValueError otherwise).

        fresh_optimizer=True (rejoin, CheckFree rebuild): new AdamW and the gradients accumulated
        so far are discarded. False (a gossip/outer update): optimizer moments and the current
        accumulation are kept. Stored activations stay valid: their backward runs through the
        weights they were forwarded with (stashed) or recomputes the forward with the new ones.
        """
        own = self.module.state_dict()
        check_state_dict(own, sd)
        with torch.no_grad():
            for name, target in own.items():
                target.copy_(self.transfers.to_device(sd[name], target.dtype))
        if fresh_optimizer:
            self.reset_optimizer()
            self.optimizer.zero_grad(set_to_none=True)
            self.accumulated = 0

    def close(self) -> None:
        """Stop the executor (queued calls are cancelled, a running one finishes) and free activations."""
        if self._closed:
            return
        self._closed = True
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.store.clear()

    # ------------------------------------------------------------------------------------------
    # Stored activations (node/stage/activation_store.py)

    @property
    def num_stored(self) -> int:
        return len(self.store)

    @property
    def evicted(self) -> int:
        return self.store.evicted

    def drop(self, key: Hashable) -> None:
        """Forget a failed microbatch (no error if it is unknown). Safe from any thread."""
        self.store.drop(key)

    def expire(self, older_than: float) -> int:
        """Forget activations stored more than `older_than` seconds ago. Safe from any thread."""
        return self.store.expire(older_than)

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._params)

    # ------------------------------------------------------------------------------------------
    # Input validation (anything from the wire; raises ValueError, never leaves state half-changed)

    def _need(self, block: bool) -> None:
        if self._closed:
            raise RuntimeError(f"stage {self.stage} worker is closed")
        if block and self.stage == 0:
            raise ValueError("stage 0 is the edge stage: use embed / head_loss_backward / embed_backward")
        if not block and self.stage != 0:
            raise ValueError(f"stage {self.stage} is a block stage: use forward / backward")

    def _out(self, t: Tensor) -> Tensor:
        """A result for the wire: on the host (one device sync on a GPU)."""
        return self.transfers.to_host([t])[0]

    # ------------------------------------------------------------------------------------------
    # Block stage (stage >= 1)

    def forward(self, key: Hashable, hidden: Tensor) -> Tensor:
        """Training forward: hidden [B, T, H] -> [B, T, H] (CPU, module dtype); remembers the graph."""
        self._need(block=True)
        start = time.perf_counter()
        x = self.hidden_from_wire("forward input", hidden)
        leaf = x.requires_grad_(True)
        stash = self.stashes.for_forward(versions := self._versions())
        with torch.enable_grad(), self.precision.autocast():
            out = self.stashes.forward(stash, leaf)
        result = self._out(out)  # waits for the device: the time below is the compute's, not the launches'
        elapsed = time.perf_counter() - start
        stored = StoredMicrobatch("block", x.detach(), leaf, out, versions, time.monotonic(), elapsed, stash=stash)
        self.store.put(key, stored)
        return result

    def backward(self, key: Hashable, grad_output: Tensor) -> Tensor:
        """Gradient wrt the stored input; accumulates parameter grads, counts, steps when due."""
        self._need(block=True)
        start = time.perf_counter()
        item = self.store.get(key, "block")
        grad = self.check_hidden("backward gradient", grad_output, shape=item.output.shape)
        norm = self.gradient_gate.check("backward gradient", grad)  # on the host: no device sync
        grad = self.transfers.to_device(grad)
        self.store.take(key, item)
        leaf, out, weights = item.leaf, item.output, self._params
        if item.stash is not None:  # the graph holds the forward's own weights: valid whatever stepped since
            weights = item.stash.params
        elif item.versions != self._versions():  # live weights changed since the forward: recompute
            leaf = item.inputs.detach().requires_grad_(True)
            with torch.enable_grad(), self.precision.autocast():
                out = self.module(leaf)
        assert leaf is not None
        # this microbatch's gradients alone first: a hostile gradient must not poison the step's
        # accumulation (it is dropped here, the honest ones already added survive)
        grad_in, *param_grads = self.precision.grad(out, [leaf, *weights], grad)  # unscaled, fp32
        check_finite("gradients of this microbatch", [grad_in, *param_grads])
        accumulate(self._params, param_grads)
        self.gradient_gate.accept(norm)
        self._finish(item.seconds + time.perf_counter() - start)
        return self._out(grad_in)

    # ------------------------------------------------------------------------------------------
    # Edge stage (stage 0)

    def embed(self, key: Hashable, tokens: Tensor) -> Tensor:
        """tokens [B, T] -> hidden [B, T, H] (CPU, module dtype); remembers the embedding graph."""
        self._need(block=False)
        start = time.perf_counter()
        ids = self.tokens_from_wire("embed tokens", tokens)
        with torch.enable_grad(), self.precision.autocast():
            out = self.module.embed(ids)
        result = self._out(out)  # waits for the device, so the time is the compute's
        elapsed = time.perf_counter() - start
        self.store.put(key, StoredMicrobatch("edge", ids, None, out, self._versions(), time.monotonic(), elapsed))
        return result

    def head_loss_backward(self, key: Hashable, hidden: Tensor, targets: Tensor) -> tuple[float, Tensor]:
        """Mean cross-entropy of the last block stage's output, and its gradient wrt `hidden`.

        The gradient is that of loss / microbatches_per_step, so the grads every stage accumulates
        over a step are the mean over its microbatches. The norm/head grads are kept with the
        microbatch and added to .grad only when embed_backward finishes it, so all of stage 0's
        gradient for a microbatch lands in the same optimizer step (and none if it fails).
        """
        self._need(block=False)
        start = time.perf_counter()
        item = self.store.get(key, "edge")
        h = self.hidden_from_wire("head input", hidden, shape=item.output.shape)
        tgt = self.tokens_from_wire("targets", targets, shape=item.inputs.shape)
        h.requires_grad_(True)
        with torch.enable_grad(), self.precision.autocast():
            loss = self.module.loss(h, tgt)
        grads = self.precision.grad(loss / self.config.training.microbatches_per_step, [h, *self._head_params])
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise RejectedInput(f"loss is not finite ({loss_value}): the returned hidden states are unusable")
        check_finite("head gradients of this microbatch", grads)
        item.head_grads = list(grads[1:])
        grad_out = self._out(grads[0])
        item.seconds += time.perf_counter() - start
        return loss_value, grad_out

    def embed_backward(self, key: Hashable, grad: Tensor) -> None:
        """Finish the microbatch at stage 0: apply its head grads, backprop into the embedding,
        count it and step when microbatches_per_step are done."""
        self._need(block=False)
        start = time.perf_counter()
        item = self.store.get(key, "edge")
        if item.head_grads is None:
            raise ValueError(f"stage 0: embed_backward for {key!r} before its head_loss_backward")
        g = self.check_hidden("embedding gradient", grad, shape=item.output.shape)
        norm = self.gradient_gate.check("embedding gradient", g)  # on the host: no device sync
        g = self.transfers.to_device(g)
        self.store.take(key, item)
        out = item.output
        if item.versions != self._versions():
            with torch.enable_grad(), self.precision.autocast():
                out = self.module.embed(item.inputs)
        embed_grads = self.precision.grad(out, self._embed_params, g)
        check_finite("embedding gradients of this microbatch", embed_grads)
        accumulate(self._embed_params, embed_grads)
        accumulate(self._head_params, item.head_grads)
        self.gradient_gate.accept(norm)
        self._finish(item.seconds + time.perf_counter() - start)

    # ------------------------------------------------------------------------------------------
    # Accumulation, the optimizer step, throughput

    def _finish(self, seconds: float) -> None:
        self.microbatches_done += 1
        self.accumulated += 1
        if seconds > 0:
            self.throughput = smoothed_throughput(self.throughput, 1.0 / seconds)
        if self.accumulated >= step_size(self.config.training, len(self.store)):
            self._step()

    def _step(self) -> None:
        t = self.config.training  # losses came scaled by 1 / microbatches_per_step: a larger step takes the mean
        grad_scale, self.accumulated = t.microbatches_per_step / max(self.accumulated, t.microbatches_per_step), 0
        self.stashes.clear()  # the version it copied is over: free it with its last microbatch
        norm = clipped_step(self.optimizer, self._params, t.grad_clip, self.current_lr, grad_scale)
        if norm is None:
            self.skipped_steps += 1
            logger.warning("stage %d: gradient norm is not finite, step skipped", self.stage)
        elif math.isfinite(norm):
            self.inner_step += 1
            self.last_grad_norm = norm

    def measure_throughput(self, batch: int | None = None, seq: int | None = None, repeats: int = 3) -> float:
        """Time forward+backward on random inputs (no .grad touched, no stored state) and set
        `throughput` (microbatches/s). Run it through the executor before the first announcement."""
        t = self.config.training
        with self.precision.autocast():  # time the arithmetic this peer trains in (routing weighs it)
            seconds = time_forward_backward(
                self.module,
                self.config.model,
                self.stage,
                self.transfers,
                self.dtype,
                batch or t.microbatch_size,
                seq or t.sequence_length,
                repeats,
            )
        self.throughput = 1.0 / max(seconds, 1e-9)
        return self.throughput

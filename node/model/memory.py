"""How much memory one peer needs to serve a stage, and whether its device has it (docs/model.md).

The estimate counts what the code keeps at its peak, for the precision the stage computes in and
the kind of device (docs/model.md, "Memory per peer", has the table measured against it with
tests/benchmarks/bench_memory.py):

- weights: the stage's parameters (fp32 master weights, whatever the precision);
- gradients: the accumulated `.grad` plus one working copy, which is in turn a microbatch's fresh
  gradients before they are added (node/stage/stage_worker.py), the optimizer step's
  temporaries, or a gossip round's inner progress: all three run on the compute thread, never at
  once;
- optimizer: AdamW's exp_avg and exp_avg_sq;
- outer state: the OuterReplica's phi (an fp32 copy of the weights), momentum and the
  error-feedback residual of the Delta it sends (node/averaging/gossip_codec.py), kept whatever
  the gossip mode (node/averaging/outer_replica.py);
- gossip round: what a NoLoCo round holds beside that while it runs: theta and Delta captured at
  its start, Delta as sent and the next residual, the partner's decoded phi and Delta, the new phi
  and momentum = 8 model-sized copies (its inner progress is the working copy above); none with
  gossip off. DiLoCo holds one Delta per replica
  instead of the partner's: more with over 3 replicas;
- stashed weights (block stages): up to `training.stashed_weights` copies of the parameters that
  forwards ran on, kept for their backwards (node/stage/weight_stash.py);
- edge copies (CheckFree+): stage 1 keeps stage 0's embedding, stage S its final norm and LM
  head (node/recovery/edge_copies.py), on the stage's device like every tensor a peer keeps;
- activations in flight: F microbatches (`training.max_in_flight`, or fewer where a device fits
  fewer: `fitting_in_flight` sizes a peer's window by its free memory, and the stage's store of
  activations is bounded by that same F, node/server/stage_service.py) of microbatch_size x
  sequence_length tokens each. A block stage keeps per token its output (hidden, fp32) and what
  autograd saves in each layer, the layer's input included (`activation_bytes_per_layer`, measured
  with saved-tensor hooks: tests/unit/test_presets.py; scaled_dot_product_attention's fused kernels
  keep no T x T matrix); under autocast (bf16, fp16) the saved values are mostly half precision, and
  each stored forward also keeps the half-precision copies of the weights its matmuls used (2 bytes
  a parameter). Stage 0 keeps the embedding output and the token ids per microbatch, and the LM
  head's gradients of each microbatch between its loss and its embedding backward
  (StageWorker.head_loss_backward keeps them so a microbatch lands in one step);
- loss head (stage 0): one microbatch's logits, their log-softmax and their gradient
  (3 x tokens x vocab_size fp32 values), while the head runs;
- allocator slack (CPU only): glibc's malloc keeps the holes the forward's temporaries leave
  between stored activations (their tensors are below its mmap threshold, up to 32 MiB), so the
  resident set grows by about CPU_HEAP_SLACK of the activations kept per token beyond their bytes
  (measured: docs/model.md). torch.cuda's allocator has its own cache, which
  max_memory_allocated, the figure this estimate is checked against on CUDA, does not count.

Not counted: the CUDA context and the caching allocator's reserve, wire buffers, the Python
process itself with torch imported (some 400 MiB resident on CPU).

Pure except `available_memory`, which asks the device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from node.config import GossipMode, ModelConfig, Precision, RecoveryConfig, RecoveryStrategy, SwarmConfig
from node.model.parameters import count_stage_parameters
from node.runtime.byte_progress import format_bytes  # re-exported: the memory messages' unit

__all__ = [
    "CPU_HEAP_SLACK",
    "DeviceMemory",
    "StageMemory",
    "activation_bytes_per_layer",
    "available_memory",
    "estimate_stage_memory",
    "fitting_in_flight",
    "format_bytes",
    "holds_host_memory",
    "memory_refusal",
]

FP32 = 4  # bytes per value: weights, gradients, optimizer and outer state are all kept in fp32
HALF = 2  # bytes per bf16 / fp16 value, what autocast computes in
TOKEN_ID = 8  # bytes per token id (int64)
GRADIENT_COPIES = 2  # the accumulated .grad and one working copy (module docstring)
ADAMW_MOMENTS = 2  # exp_avg, exp_avg_sq
OUTER_STATE_COPIES = 3  # phi, momentum, the error-feedback residual of the Delta sent (gossip_codec.py)
# theta, Delta, Delta as sent, the next residual, the partner's decoded phi and Delta, new phi, new
# momentum (the wire's codes and residues, 1 / 8 of a copy each way: left out)
GOSSIP_ROUND_COPIES = 8
LOSS_HEAD_COPIES = 3  # logits, their log-softmax (saved by cross_entropy), their gradient
# resident bytes glibc's heap keeps beyond the activations a CPU stage stores, as a fraction of them:
# tests/benchmarks/bench_memory.py measured 0.31 (15m block stage) and 0.19 (125m) per stored forward
CPU_HEAP_SLACK = 0.25
# the recovery strategies that make stage 1 / stage S keep edge copies (node/recovery/edge_copies.py)
EDGE_COPY_STRATEGIES = (RecoveryStrategy.CHECKFREE, RecoveryStrategy.COPY)


def activation_bytes_per_layer(model: ModelConfig, precision: Precision = Precision.FP32) -> int:
    """Bytes autograd keeps per token for one decoder layer, the layer's input included.

    fp32: 10 x hidden + 4 x intermediate values (the input and the normalised input of both
    RMSNorms with their scaled outputs, q/k/v after rotary, the attention output and its flattened
    copy, the SwiGLU gate, its silu, up and their product). Under autocast the four residual-stream
    values stay fp32 and 9 x hidden + 4 x intermediate half-precision values (the matmuls' inputs
    and outputs) are saved instead: 4 x 4 H + 2 x (9 H + 4 I) bytes."""
    h, i = model.hidden_size, model.intermediate_size
    if _is_half(precision):
        return 4 * h * FP32 + (9 * h + 4 * i) * HALF
    return (10 * h + 4 * i) * FP32


def _is_half(precision: Precision) -> bool:
    if precision is Precision.AUTO:
        raise ValueError("resolve training.precision for the device first (node/stage/precision.py)")
    return precision in (Precision.BF16, Precision.FP16)


def holds_host_memory(device: str) -> bool:
    """Whether `device`'s memory is the host's (CPU, and whatever is not CUDA), where glibc's heap lives."""
    return not device.startswith("cuda")


@dataclass(frozen=True)
class StageMemory:
    """Bytes one peer of `stage` needs on its device, by what holds them."""

    stage: int
    parameters: int
    weights: int
    gradients: int
    optimizer: int
    outer_state: int
    gossip_round: int
    stashed_weights: int
    edge_copies: int
    activations: int
    loss_head: int
    allocator_slack: int

    @property
    def total(self) -> int:
        return sum(getattr(self, spec.name) for spec in fields(self) if spec.name not in ("stage", "parameters"))

    def to_dict(self) -> dict[str, int]:
        """Plain ints (bytes, parameters excepted), the total included: for `node status --json`."""
        return {**asdict(self), "total": self.total}


def _edge_copy_parameters(recovery: RecoveryConfig, m: ModelConfig, num_stages: int, stage: int) -> int:
    """Parameters of the stage-0 parts a peer of `stage` keeps copies of (CheckFree+)."""
    if stage == 0 or not recovery.checkfree_plus or recovery.strategy not in EDGE_COPY_STRATEGIES:
        return 0
    embedding = m.vocab_size * m.hidden_size
    head = m.vocab_size * m.hidden_size + m.hidden_size  # lm_head and the final norm
    last = num_stages - 1
    return (embedding if stage == 1 else 0) + (head if stage == last else 0)


def estimate_stage_memory(
    config: SwarmConfig,
    stage: int,
    in_flight: int | None = None,
    *,
    precision: Precision = Precision.FP32,
    device: str = "cpu",
) -> StageMemory:
    """The peak memory a peer serving `stage` on `device` ("cpu", "cuda", "cuda:N"), computing in
    `precision` (resolved: never auto), with `in_flight` microbatches stored (default
    training.max_in_flight) needs (module docstring: what is counted, and why)."""
    if not 0 <= stage < config.num_stages:
        raise ValueError(f"stage {stage} out of range 0..{config.num_stages - 1}")
    m, t = config.model, config.training
    half = _is_half(precision)
    in_flight = t.max_in_flight if in_flight is None else in_flight
    parameters = count_stage_parameters(m, stage)
    microbatch_tokens = t.microbatch_size * t.sequence_length
    if stage == 0:
        per_token = m.hidden_size * FP32 + 2 * TOKEN_ID  # embedding output (never autocast), ids, targets
        head_gradients = (m.vocab_size * m.hidden_size + m.hidden_size) * FP32
        activations = in_flight * (microbatch_tokens * per_token + head_gradients)
        loss_head = LOSS_HEAD_COPIES * microbatch_tokens * m.vocab_size * FP32
    else:
        per_token = m.layers_per_stage * activation_bytes_per_layer(m, precision) + m.hidden_size * FP32
        weight_casts = parameters * HALF if half else 0  # each stored forward's half-precision weights
        activations = in_flight * (microbatch_tokens * per_token + weight_casts)
        loss_head = 0
    host = holds_host_memory(device)
    gossiping = config.gossip.mode != GossipMode.NONE
    return StageMemory(
        stage=stage,
        parameters=parameters,
        weights=parameters * FP32,
        gradients=GRADIENT_COPIES * parameters * FP32,
        optimizer=ADAMW_MOMENTS * parameters * FP32,
        outer_state=OUTER_STATE_COPIES * parameters * FP32,
        gossip_round=GOSSIP_ROUND_COPIES * parameters * FP32 if gossiping else 0,
        stashed_weights=t.stashed_weights * parameters * FP32 if stage > 0 else 0,
        # kept in bfloat16 (EDGE_COPY_DTYPE)
        edge_copies=_edge_copy_parameters(config.recovery, m, config.num_stages, stage) * HALF,
        activations=activations,
        loss_head=loss_head,
        allocator_slack=round(CPU_HEAP_SLACK * in_flight * microbatch_tokens * per_token) if host else 0,
    )


@dataclass(frozen=True)
class DeviceMemory:
    """What a device can give a new stage now."""

    device: str
    free: int
    """Bytes: free CUDA memory (torch.cuda.mem_get_info), or available RAM (psutil) for the CPU."""


def available_memory(device: str) -> DeviceMemory:
    """Free memory of `device` ("cpu", "cuda", "cuda:N") now."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return DeviceMemory(device, int(free))
    import psutil

    return DeviceMemory(device, int(psutil.virtual_memory().available))


def fitting_in_flight(
    config: SwarmConfig, stage: int, free: int, *, precision: Precision = Precision.FP32, device: str = "cpu"
) -> tuple[int | None, StageMemory]:
    """The most microbatches in flight, from training.max_in_flight down to min_in_flight, whose
    estimate fits in `free` bytes, with that estimate: the window is bounded by memory, so a smaller
    device gets a narrower window instead of a refusal. (None, the estimate at min_in_flight) when
    not even that fits."""
    t = config.training
    for in_flight in range(t.max_in_flight, t.min_in_flight - 1, -1):
        estimate = estimate_stage_memory(config, stage, in_flight, precision=precision, device=device)
        if estimate.total <= free:
            return in_flight, estimate
    return None, estimate


def memory_refusal(swarm_id: str, estimate: StageMemory, available: DeviceMemory) -> str | None:
    """Why this device cannot serve the stage (one line), or None when the estimate fits."""
    if estimate.total <= available.free:
        return None
    largest = sorted(
        ((name, value) for name, value in estimate.to_dict().items() if name not in ("stage", "parameters", "total")),
        key=lambda item: -item[1],
    )[:3]
    breakdown = ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}" for name, value in largest)
    return (
        f"stage {estimate.stage} of swarm {swarm_id} needs about {format_bytes(estimate.total)} "
        f"({breakdown}, ...) but {available.device} has {format_bytes(available.free)} free: use a larger "
        f"device, or a swarm with more stages or a smaller training.min_in_flight"
    )

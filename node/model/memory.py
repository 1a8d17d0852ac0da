"""How much memory one peer needs to serve a stage, and whether its device has it (docs/model.md).

The estimate counts what the code keeps, in fp32 (4 bytes a value), at its peak:

- weights: the stage's parameters (fp32 master weights);
- gradients: the accumulated `.grad` plus one microbatch's fresh gradients, which
  `torch.autograd.grad` returns before they are added (node/pipeline/stage_worker.py);
- optimizer: AdamW's exp_avg and exp_avg_sq;
- outer state: the OuterReplica's phi (an fp32 copy of the weights) and momentum, kept whatever
  the gossip mode (node/averaging/outer_replica.py);
- gossip round: what a NoLoCo round holds beside that, at its peak (while the new outer state is
  applied): theta and Delta captured at the start, the partner's phi and Delta, the new phi and
  momentum, and the inner progress made meanwhile = 7 model-sized copies; none with gossip off.
  DiLoCo holds one Delta per replica instead of the partner's pair: more with over 3 replicas;
- stashed weights (block stages): up to `training.stashed_weights` copies of the parameters that
  forwards ran on, kept for their backwards (node/pipeline/weight_stash.py);
- edge copies (CheckFree+): stage 1 keeps stage 0's embedding, stage S its final norm and LM
  head (node/recovery/edge_copies.py);
- activations in flight: F microbatches (`training.max_in_flight`, or fewer where a device fits
  fewer: `fitting_in_flight` sizes a peer's window by its free memory) of microbatch_size x
  sequence_length tokens each (a block peer fed by several stage-0 peers may hold more: its store
  accepts up to 4 x max_in_flight). A block stage keeps, per token, its input and output (2 x
  hidden) plus what autograd saves in each layer: activation_values_per_layer, 9 x hidden + 4 x
  intermediate values (norm inputs and outputs, q/k/v after rotary, attention output, the SwiGLU
  gate, its silu, up and their product), measured with saved-tensor hooks
  (tests/unit/test_presets.py; scaled_dot_product_attention's fused kernels keep no T x T
  matrix). Stage 0 keeps the embedding output and the token ids per microbatch, and the LM head's
  gradients of each microbatch between its loss and its embedding backward
  (StageWorker.head_loss_backward keeps them so a microbatch lands in one step);
- loss head (stage 0): one microbatch's logits, their log-softmax and their gradient
  (3 x tokens x vocab_size), while the head runs.

Not counted: the CUDA context and allocator slack, wire buffers, the Python process itself.

Pure except `available_memory`, which asks the device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from node.config import GossipMode, RecoveryStrategy, SwarmConfig
from node.model.parameters import count_stage_parameters
from node.runtime.byte_progress import format_bytes  # re-exported: the memory messages' unit

__all__ = [
    "DeviceMemory",
    "StageMemory",
    "activation_values_per_layer",
    "available_memory",
    "estimate_stage_memory",
    "fitting_in_flight",
    "format_bytes",
    "memory_refusal",
]

FP32 = 4  # bytes per value: weights, gradients, optimizer and outer state are all kept in fp32
TOKEN_ID = 8  # bytes per token id (int64)
GRADIENT_COPIES = 2  # the accumulated .grad and one microbatch's gradients before they are added
ADAMW_MOMENTS = 2  # exp_avg, exp_avg_sq
OUTER_STATE_COPIES = 2  # phi, momentum
GOSSIP_ROUND_COPIES = 7  # theta, Delta, partner phi, partner Delta, new phi, new momentum, progress
LOSS_HEAD_COPIES = 3  # logits, their log-softmax (saved by cross_entropy), their gradient
# the recovery strategies that make stage 1 / stage S keep edge copies (node/recovery/edge_copies.py)
EDGE_COPY_STRATEGIES = (RecoveryStrategy.CHECKFREE, RecoveryStrategy.COPY)


def activation_values_per_layer(hidden_size: int, intermediate_size: int) -> int:
    """fp32 values autograd saves per token in one decoder layer (see the module docstring)."""
    return 9 * hidden_size + 4 * intermediate_size


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

    @property
    def total(self) -> int:
        return sum(getattr(self, spec.name) for spec in fields(self) if spec.name not in ("stage", "parameters"))

    def to_dict(self) -> dict[str, int]:
        """Plain ints (bytes, parameters excepted), the total included: for `node status --json`."""
        return {**asdict(self), "total": self.total}


def _edge_copy_parameters(config: SwarmConfig, stage: int) -> int:
    """Parameters of the stage-0 parts a peer of `stage` keeps copies of (CheckFree+)."""
    recovery = config.recovery
    if stage == 0 or not recovery.checkfree_plus or recovery.strategy not in EDGE_COPY_STRATEGIES:
        return 0
    m = config.model
    embedding = m.vocab_size * m.hidden_size
    head = m.vocab_size * m.hidden_size + m.hidden_size  # lm_head and the final norm
    last = config.num_stages - 1
    return (embedding if stage == 1 else 0) + (head if stage == last else 0)


def estimate_stage_memory(config: SwarmConfig, stage: int, in_flight: int | None = None) -> StageMemory:
    """The peak memory a peer serving `stage` with `in_flight` microbatches in flight (default
    training.max_in_flight) needs (module docstring: what is counted, and why)."""
    if not 0 <= stage < config.num_stages:
        raise ValueError(f"stage {stage} out of range 0..{config.num_stages - 1}")
    m, t = config.model, config.training
    in_flight = t.max_in_flight if in_flight is None else in_flight
    parameters = count_stage_parameters(config, stage)
    tokens_in_flight = in_flight * t.microbatch_size * t.sequence_length
    microbatch_tokens = t.microbatch_size * t.sequence_length
    if stage == 0:
        head_parameters = m.vocab_size * m.hidden_size + m.hidden_size
        activations = tokens_in_flight * (m.hidden_size * FP32 + 2 * TOKEN_ID)  # embedding output, ids, targets
        activations += in_flight * head_parameters * FP32
        loss_head = LOSS_HEAD_COPIES * microbatch_tokens * m.vocab_size * FP32
    else:
        per_token = 2 * m.hidden_size + m.layers_per_stage * activation_values_per_layer(
            m.hidden_size, m.intermediate_size
        )
        activations = tokens_in_flight * per_token * FP32
        loss_head = 0
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
        edge_copies=_edge_copy_parameters(config, stage) * FP32,
        activations=activations,
        loss_head=loss_head,
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


def fitting_in_flight(config: SwarmConfig, stage: int, free: int) -> tuple[int | None, StageMemory]:
    """The most microbatches in flight, from training.max_in_flight down to min_in_flight, whose
    estimate fits in `free` bytes, with that estimate: the window is bounded by memory, so a smaller
    device gets a narrower window instead of a refusal. (None, the estimate at min_in_flight) when
    not even that fits."""
    t = config.training
    for in_flight in range(t.max_in_flight, t.min_in_flight - 1, -1):
        estimate = estimate_stage_memory(config, stage, in_flight)
        if estimate.total <= free:
            return in_flight, estimate
    return None, estimate


def memory_refusal(config: SwarmConfig, estimate: StageMemory, available: DeviceMemory) -> str | None:
    """Why this device cannot serve the stage (one line), or None when the estimate fits."""
    if estimate.total <= available.free:
        return None
    largest = sorted(
        ((name, value) for name, value in estimate.to_dict().items() if name not in ("stage", "parameters", "total")),
        key=lambda item: -item[1],
    )[:3]
    breakdown = ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}" for name, value in largest)
    return (
        f"stage {estimate.stage} of swarm {config.swarm_id} needs about {format_bytes(estimate.total)} "
        f"({breakdown}, ...) but {available.device} has {format_bytes(available.free)} free: use a larger "
        f"device, or a swarm with more stages or a smaller training.min_in_flight"
    )

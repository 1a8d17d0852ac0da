"""The swarm configuration: one immutable description every peer of a swarm agrees on.

The bootstrapper builds it from defaults, a TOML file and flags, publishes it in the DHT with its
hash, and every joiner refuses to train if its own protocol version or the hash differ. Defaults
follow docs/algorithms.md (NoLoCo alpha 0.5, beta 0.7, gamma = beta, H = 50; CheckFree lr scale
1.1; clip 1.0). Every field carries a one-line attribute docstring (what it is, its unit, why the
default), which node/config/reference.py turns into docs/config.md (`python -m node.config`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from node.config.vocabulary import (
    MAX_MARKOV_CONTEXTS,
    SOURCE_ALIASES,
    ConfigError,
    GossipMode,
    Precision,
    RecoveryStrategy,
    RoutingMode,
    SyntheticSource,
    synthetic_source,
)
from protocol.plain import plain_dict
from protocol.tensors import Compression
from protocol.version import PROTOCOL_VERSION

__all__ = [
    "MAX_MARKOV_CONTEXTS",
    "SECTION_TYPES",
    "SOURCE_ALIASES",
    "ConfigError",
    "DataConfig",
    "GossipConfig",
    "GossipMode",
    "HeartbeatConfig",
    "ModelConfig",
    "Precision",
    "RecoveryConfig",
    "RecoveryStrategy",
    "RoutingMode",
    "SwarmConfig",
    "SyntheticSource",
    "TrainingConfig",
    "ValidationConfig",
    "VerificationConfig",
    "load_toml",
    "read_config",
    "synthetic_source",
]


@dataclass(frozen=True)
class ModelConfig:
    """A LLaMA-style decoder cut into stage 0 (embed + norm + head) and equal block stages."""

    vocab_size: int = 256
    """Tokens in the vocabulary (embedding and LM-head rows), >= 2; 256 = one per byte: any text trains without a tokenizer."""
    hidden_size: int = 64
    """Width of the residual stream; 64 keeps the default model near 133k parameters, small enough for a laptop CPU."""
    intermediate_size: int = 176
    """Width of the SwiGLU MLP; 176 = 8/3 x hidden_size rounded up to a multiple of 16, LLaMA's sizing."""
    num_attention_heads: int = 4
    """Query heads; must divide hidden_size into an even head dimension (rotary); 4 gives 16-wide heads."""
    num_key_value_heads: int = 4
    """Key/value heads (grouped-query attention), must divide num_attention_heads; 4 = plain multi-head attention."""
    layers_per_stage: int = 1
    """Decoder layers in each block stage (stage 0 holds none), >= 1; 1 keeps a stage's compute and a rebuild's download small."""
    max_position_embeddings: int = 256
    """Longest sequence a stage accepts, in tokens, >= training.sequence_length; 256 leaves room over the default 64."""
    rms_norm_eps: float = 1e-5
    """Epsilon added to the mean square in every RMSNorm; 1e-5 is LLaMA's."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies; 10000 is LLaMA's (and RoPE's)."""
    embedding_init_std: float = 0.02
    """Std of the token embedding's initial weights, in (0, 10]; 0.02 is HF Llama's initializer_range. 1.0 (nn.Embedding's own default) learns the token path far faster on short budgets: `make experiments` uses it (docs/results.md)."""


@dataclass(frozen=True)
class TrainingConfig:
    """The inner optimizer (AdamW with warmup and cosine decay) and the pipeline traffic of stage 0."""

    microbatch_size: int = 8
    """Sequences per microbatch, the unit that travels through the pipeline, >= 1; 8 keeps a hop small on CPU."""
    sequence_length: int = 64
    """Tokens per sequence, <= model.max_position_embeddings; 64 is cheap on a laptop and long enough for the synthetic chain."""
    microbatches_per_step: int = 2
    """Fewest microbatches whose gradients are accumulated into one optimizer (inner) step, >= 1; 2 averages out some gradient noise. A stage with more microbatches in flight takes larger steps (max_staleness_steps)."""
    min_in_flight: int = 4
    """Microbatches a stage-0 peer keeps in the pipeline at least, >= 1; 4 keeps 3 stages busy on one host, where a round trip is mostly compute."""
    max_in_flight: int = 32
    """Most microbatches a stage-0 peer keeps in the pipeline, >= min_in_flight; between the two the window follows delivery rate x minimum RTT (node/pipeline/in_flight_window.py). A bound on memory (stored activations, node/model/memory.py), not on staleness: over 100 ms links a default-model microbatch's round trip took 0.4-0.6 s (six crossings, queues, compute), so 32 keep ~55/s going where 16 kept ~40 (docs/benchmarks.md)."""
    max_staleness_steps: int = 2
    """Optimizer steps a microbatch's gradient may arrive after its forward, >= 1: a stage holding F microbatches between forward and backward steps every max(microbatches_per_step, ceil(F / this)) backwards, so a wide window makes larger steps instead of staler gradients. 2 is what the default model survived; 8 diverged (docs/reliability.md, "Staleness")."""
    stashed_weights: int = 4
    """Copies of a block stage's weights kept alive at once so a microbatch forwarded before a step backpropagates through the weights it used (PipeDream's weight stashing, node/stage/weight_stash.py), >= 0; one copy per step still in flight. 4 covers max_staleness_steps (2) plus the current weights plus one; past the limit, and with 0, the backward recomputes the forward at the current weights (hivemind's expert backends)."""
    learning_rate: float = 3e-3
    """Peak learning rate of the inner AdamW; 3e-3 suits a 64-wide model (small models take larger rates); a real preset sets its own, falling as 1 / width (docs/model.md, "Presets")."""
    warmup_steps: int = 20
    """Optimizer steps of linear warmup up to learning_rate; 20 is short, as the default runs are."""
    total_steps: int = 5000
    """Optimizer step where the cosine decay reaches min_lr_ratio x learning_rate (flat after); 5000 outlasts a demo run."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine schedule, as a fraction of learning_rate; 0.1 is the usual LLaMA-style floor."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay; 0 like the NoLoCo authors' code."""
    grad_clip: float = 1.0
    """Max global gradient norm of a stage before its optimizer step, > 0; 1.0 like the NoLoCo authors (CheckFree weighs by it)."""
    wire_compression: Compression = Compression.FP16
    """Encoding of activations and gradients between stages (receivers get the original dtype back); fp16 halves fp32 traffic. subspace8/subspace4 send a hop's coordinates in a fixed rank-(W/9 - 1) subspace (int8; int4 at twice the rank) beside its token ids, 16.4x under fp16 at the 15m width: part of the model, so slow_link_compression must be the same (docs/wire.md)."""
    slow_link_compression: Compression = Compression.INT8
    """Encoding of hops while wire_compression would keep this peer's uplink over half busy, link rates measured by TCP (node/pipeline/link_compression.py); int8 halves fp16, as SWARM compresses for slow networks. Equal to wire_compression: never switch."""
    hop_timeout: float = 20.0
    """Seconds to wait for one stage's reply before retrying another peer, > 0; 20 s tolerates a loaded CPU peer."""
    max_retries: int = 3
    """Extra attempts, on other peers, for a microbatch whose hop failed or timed out, >= 0; 3 rides out a dead peer."""
    routing: RoutingMode = RoutingMode.LOAD_AWARE
    """How the next stage's peer is chosen (members below); load_aware, SWARM's rule, keeps fast and slow peers equally busy."""
    precision: Precision = Precision.AUTO
    """Compute precision of every stage (members below), weights and optimizer stay fp32; auto resolves per peer (bf16 on a bf16 GPU, fp32 on CPU) since a swarm mixes devices."""


@dataclass(frozen=True)
class GossipConfig:
    """How the replicas of a stage average their weights: NoLoCo's outer step (docs/gossip.md)."""

    mode: GossipMode = GossipMode.NOLOCO
    """How replicas of a stage are kept together (members below); noloco, one random partner per round, is what pipeswarm is built on."""
    inner_steps: int = 50
    """H: optimizer steps between two outer rounds, >= 1; 50 (docs/algorithms.md) lets replicas meet often in a short run."""
    outer_momentum: float = 0.5
    """alpha: momentum of the outer step (velocity form); 0.5 is NoLoCo's."""
    outer_lr: float = 0.7
    """beta: learning rate of the outer step on the mean pseudo-gradient; 0.7 like NoLoCo and DiLoCo."""
    pull: float | None = None
    """gamma: pull toward the group's mean outer weights; unset (omit it in TOML) ties it to outer_lr, as NoLoCo's authors do."""
    round_timeout: float = 30.0
    """Seconds a gossip round may last beyond moving its tensors (and a due replica waits for a partner before a lone step), > 0; the transfer's own time is added from the payload and the link's rate (docs/gossip.md)."""
    phi_bits: int = 3
    """Bits a phi value in a NoLoCo round, 2, 3, 4 or 8: its grid index modulo 2**bits, decoded against the receiver's own phi (docs/gossip.md)."""
    phi_step: float = 16.0
    """phi's grid step in Delta scales (a block's absmax / 7), > 0; at 16 and 3 bits phi decodes to within 8 scales while two replicas differ by < 64 (docs/gossip.md has the measured loss)."""
    delta_block: int = 64
    """Delta travels at 4 bits a value with error feedback, one fp32 scale per this many values, even >= 2."""
    max_norm_factor: float = 10.0
    """A partner whose phi or Delta norm exceeds this x our own is rejected and banned, > 1; 10 passes honest drift, not poison."""

    @property
    def pull_coefficient(self) -> float:
        return self.outer_lr if self.pull is None else self.pull


@dataclass(frozen=True)
class RecoveryConfig:
    """Rebuilding a stage whose peers all vanished, and moving peers to fill it (docs/recovery.md)."""

    strategy: RecoveryStrategy = RecoveryStrategy.CHECKFREE
    """How a lost stage is rebuilt (members below); checkfree, the neighbours averaged by gradient norm, recovers best (docs/recovery.md)."""
    checkfree_plus: bool = True
    """CheckFree+: swap the outer block stages on odd microbatches and keep edge copies, so the edge stages can be rebuilt too."""
    lr_scale: float = 1.1
    """Factor on a rebuilt stage's learning rate from then on, > 0; 1.1 as the CheckFree authors use for small models."""
    lost_grace: float = 10.0
    """Seconds a stage must be without a live peer before it is declared lost, >= 0; 10 s rides out a quick restart."""
    rebalance_wait: float = 30.0
    """Seconds after a stage is declared lost before a serving peer moves there if nobody joined, >= 0; 30 s leaves joiners first."""
    edge_copy_interval: int = 50
    """Stage-0 optimizer steps between refreshes of the CheckFree+ edge copies; 50 = one gossip round's worth of steps."""
    checkpoint_every: int = 50
    """With strategy checkpoint: inner steps between two weight saves of a stage; 50 = one save per gossip round."""
    checkpoint_dir: str = "checkpoints"
    """With strategy checkpoint: directory of the saves (one subdirectory per swarm id), relative to the peer's working directory."""


@dataclass(frozen=True)
class HeartbeatConfig:
    """How often peers re-announce their DHT records, and how long a silent peer's record lives."""

    period: float = 5.0
    """Seconds between two announcements of a peer's record, 0 < period < ttl; 5 s keeps DHT traffic low and views fresh."""
    ttl: float = 15.0
    """Seconds a record lives without a new announcement (a killed peer vanishes within it); 15 s = three missed heartbeats."""


@dataclass(frozen=True)
class DataConfig:
    """What stage-0 peers train on (docs/model.md)."""

    source: str = SyntheticSource.MARKOV.value
    """markov (the embedded seeded chain below; "synthetic" is read as markov) or a path: a uint16 .bin token file, else UTF-8 text; a peer's --data overrides it."""
    markov_order: int = 2
    """Tokens of context the chain's next token depends on, >= 1; 2 makes attention necessary (stage 0 alone sees only the current token) and stays learnable by 2 layers."""
    markov_alphabet: int = 16
    """Tokens the chain uses (ids 0..A-1, clipped to vocab_size), with alphabet^order <= 1024; 16 gives 256 contexts, which the default model learns in a few hundred steps."""
    markov_branching: int = 3
    """Successors per context (clipped to 1..alphabet); 3 gives an exact floor of 0.860 nats at 64-token sequences, against 2.454 from the current token alone (stage 0 without blocks)."""

    tokenizer_hash: str = ""
    """Hash of the tokenizer of `node prepare-data` the swarm trains with (set by `node bootstrap --data DIR`); stage-0 peers refuse data prepared with another; empty: no prepared data."""
    manifest_hash: str = ""
    """sha256 (64 hex digits) of the shard manifest of the founder's prepared data (set by `node bootstrap --data DIR`): a stage-0 peer without --data downloads the shards from peers that serve them and checks each against it; empty: none offered."""

    def __post_init__(self) -> None:
        alias = SOURCE_ALIASES.get(self.source)
        if alias is not None:  # store the canonical name: same swarm, same hash
            object.__setattr__(self, "source", alias.value)


@dataclass(frozen=True)
class ValidationConfig:
    """Held-out loss measured by stage-0 peers through the swarm (docs/model.md, "Validation")."""

    interval: float = 60.0
    """Seconds between two validations of a stage-0 peer (the first as soon as the pipeline is served), >= 0; 0 turns validation off; 60 s costs the default model well under 1 % of its microbatches."""
    batches: int = 4
    """Held-out microbatches (training.microbatch_size x sequence_length tokens each) per validation, the same fixed ones every time so successive values compare, 1..256; 4 = 2,048 tokens at the defaults."""


@dataclass(frozen=True)
class VerificationConfig:
    """Spot-checks: a replica's answer for a real microbatch recomputed at the weights it committed to (docs/verification.md)."""

    rate: float = 0.02
    """Probability that a peer checks a block-stage hop it took part in, 0..1: the hop's previous peer after its backward, its next peer once its output arrived, each on its own draw; 2 % costs about 1 % of a block stage's compute."""
    raised_rate: float = 0.25
    """Check probability for a peer that left a check unanswered within raised_seconds, rate..1; unanswered is never a strike."""
    raised_seconds: float = 300.0
    """Seconds the raised rate lasts after an unanswered check, >= 0."""
    strikes_to_ban: int = 3
    """Checks that found evidence (after decay) that ban a peer, >= 1; every strike is evidence an honest peer cannot produce, 3 leave room for a mistake in the tolerances."""
    ban_seconds: float = 3600.0
    """Shortest ban after spot-checks, >= 0 (a live peer's record never expires, so its expiry alone would free it within a heartbeat ttl)."""
    strike_half_life: float = 600.0
    """Seconds in which a strike decays to half, > 0; a replica wrong on one microbatch in a thousand (a flipped bit) is forgiven, one wrong on every microbatch is not."""
    fp32_tolerance: float = 1e-3
    """Largest relative difference between a replayed layer and what a replica computing in fp32 says it computed, > 0; fp32 layers measured 1e-6 from an fp64 reference, every Linear output x1.01 is 2.4e-2 away (docs/verification.md)."""
    fp16_tolerance: float = 1e-2
    """The same for a replica computing in fp16 (autocast), > 0; measured 2e-3 from fp64, x1.01 on every Linear output 2.4e-2."""
    bf16_tolerance: float = 3e-2
    """The same for a replica computing in bf16 (autocast), > 0; measured 5.5e-3 from fp64, x1.05 on every Linear output 0.12."""
    receipt_seconds: float = 30.0
    """Seconds a block-stage peer keeps what it needs to answer a check of a microbatch (input, output, gradients, a reference to the weights it ran on) after that microbatch's backward, > 0."""
    max_receipts: int = 64
    """Most microbatches a peer keeps receipts of (the oldest go first), >= 1; with the weight versions they hold on to, they cost memory (docs/verification.md)."""
    max_concurrent: int = 4
    """Checks this peer commits to for others at once (more are answered BUSY; opening a layer of a commitment never is), >= 1."""
    audit_seconds: float = 30.0
    """Seconds between two audits of a random mate of this peer's own stage (an input of its own, recomputed at the mate's committed weights), > 0; how gossip partners that compute wrong get banned."""


@dataclass(frozen=True)
class SwarmConfig:
    """Everything peers of a swarm must agree on: a few top-level values and one section per component."""

    swarm_id: str = "pipeswarm-demo"
    """Name of the swarm, 1..64 letters, digits, - _ . (its DHT keys derive from it, so swarms can share a DHT)."""
    seed: int = 0
    """Seed of every stage's initial weights and of the synthetic data: a stage's replicas start identical; 0 is as good as any."""
    num_stages: int = 3
    """Pipeline stages counting stage 0 (embedding, final norm, LM head), 2..64; 3 = stage 0 plus two block stages, the smallest pipeline with a block-to-block hop."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The [model] section."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """The [training] section."""
    gossip: GossipConfig = field(default_factory=GossipConfig)
    """The [gossip] section."""
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """The [recovery] section."""
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    """The [heartbeat] section."""
    data: DataConfig = field(default_factory=DataConfig)
    """The [data] section."""
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    """The [validation] section."""
    verification: VerificationConfig = field(default_factory=VerificationConfig)
    """The [verification] section."""

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (enums as their strings): it is hashed, stored in the DHT and printed.
        An empty data.manifest_hash is left out: a swarm that offers no shards keeps the hash it
        had before the field existed, so older peers still agree with it."""
        raw = dataclasses.asdict(self, dict_factory=plain_dict)
        if not raw["data"]["manifest_hash"]:
            del raw["data"]["manifest_hash"]
        return raw

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SwarmConfig:
        return _build(cls, raw, "")

    def config_hash(self) -> str:
        """A short digest of everything that must agree across peers (protocol version included)."""
        canonical = json.dumps(
            {"protocol_version": PROTOCOL_VERSION, **self.to_dict()}, sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def replace(self, **sections: Mapping[str, Any]) -> SwarmConfig:
        """A copy with some top-level values or section fields overridden (used for CLI flags)."""
        raw = self.to_dict()
        for key, value in sections.items():
            if isinstance(value, Mapping):
                raw[key] = {**raw[key], **value}
            else:
                raw[key] = value
        return SwarmConfig.from_dict(raw)


# every [section] of a swarm config and its dataclass (the config reference and its tests walk it)
SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "training": TrainingConfig,
    "gossip": GossipConfig,
    "recovery": RecoveryConfig,
    "heartbeat": HeartbeatConfig,
    "data": DataConfig,
    "validation": ValidationConfig,
    "verification": VerificationConfig,
}
_SECTIONS = set(SECTION_TYPES)


def _build(cls: type, raw: Mapping[str, Any], where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a table, got {type(raw).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = set(raw) - set(known)
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown keys {sorted(unknown)}")
    values = {}
    for name, value in raw.items():
        spec = known[name]
        path = f"{where}.{name}" if where else name
        if cls is SwarmConfig and name in SECTION_TYPES:
            values[name] = _build(SECTION_TYPES[name], value, path)
        else:
            values[name] = _coerce(spec, value, path)
    return cls(**values)


_ENUMS = (Compression, GossipMode, Precision, RecoveryStrategy, RoutingMode)
_ENUM_TYPES: dict[str, type[StrEnum]] = {e.__name__: e for e in _ENUMS}  # by annotation name (strings here)


def _coerce(spec: dataclasses.Field, value: Any, path: str) -> Any:
    expected = spec.type if isinstance(spec.type, str) else getattr(spec.type, "__name__", str(spec.type))
    if expected == "float | None":
        if value is None:
            return None
        expected = "float"
    if expected == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    enum_type = _ENUM_TYPES.get(expected)
    if enum_type is not None:
        try:
            return enum_type(value)
        except ValueError:
            choices = ", ".join(member.value for member in enum_type)
            raise ConfigError(f"{path}: {value!r} is not one of {choices}") from None
    python_type = {"int": int, "float": float, "str": str, "bool": bool}.get(expected)
    if python_type is None:
        raise ConfigError(f"{path}: unsupported field type {expected}")
    if isinstance(value, bool) and python_type is not bool:
        raise ConfigError(f"{path}: expected {expected}, got bool")
    if not isinstance(value, python_type):
        raise ConfigError(f"{path}: expected {expected}, got {type(value).__name__}")
    return value


def validate(config: SwarmConfig) -> None:
    def need(condition: bool, message: str) -> None:
        if not condition:
            raise ConfigError(message)

    need(isinstance(config.swarm_id, str) and 0 < len(config.swarm_id) <= 64, "swarm_id must be 1..64 characters")
    need(all(c.isalnum() or c in "-_." for c in config.swarm_id), "swarm_id may hold letters, digits, - _ . only")
    need(2 <= config.num_stages <= 64, "num_stages counts stage 0 and must be in 2..64")
    m = config.model
    need(m.hidden_size % m.num_attention_heads == 0, "hidden_size must be divisible by num_attention_heads")
    need(m.num_attention_heads % m.num_key_value_heads == 0, "num_key_value_heads must divide num_attention_heads")
    need((m.hidden_size // m.num_attention_heads) % 2 == 0, "head dimension must be even (rotary embedding)")
    need(m.layers_per_stage >= 1 and m.vocab_size >= 2, "layers_per_stage >= 1 and vocab_size >= 2")
    need(0.0 < m.embedding_init_std <= 10.0, "embedding_init_std must be in (0, 10]")
    t = config.training
    need(t.sequence_length <= m.max_position_embeddings, "sequence_length exceeds max_position_embeddings")
    need(t.microbatch_size >= 1 and t.microbatches_per_step >= 1 and t.min_in_flight >= 1, "batch sizes must be >= 1")
    need(t.max_staleness_steps >= 1, "training.max_staleness_steps must be >= 1")
    subspace = {Compression.SUBSPACE8, Compression.SUBSPACE4}
    need(
        t.wire_compression == t.slow_link_compression or not {t.wire_compression, t.slow_link_compression} & subspace,
        "training: a subspace wire codec is part of the model (every hop must project the same way): "
        "set wire_compression and slow_link_compression to the same one",
    )
    need(t.min_in_flight <= t.max_in_flight, "training.max_in_flight must be >= training.min_in_flight")
    need(
        t.hop_timeout > 0 and t.grad_clip > 0 and min(t.max_retries, t.stashed_weights) >= 0,
        "hop_timeout, grad_clip > 0; max_retries, stashed_weights >= 0",
    )
    g = config.gossip
    need(
        g.inner_steps >= 1 and g.round_timeout > 0 and g.max_norm_factor > 1,
        "gossip: inner_steps >= 1, timeout > 0, norm factor > 1",
    )
    need(
        g.phi_bits in (2, 3, 4, 8) and g.phi_step > 0 and g.delta_block >= 2 and g.delta_block % 2 == 0,
        "gossip: phi_bits 2, 3, 4 or 8, phi_step > 0, delta_block even and >= 2",
    )
    r = config.recovery
    need(r.lr_scale > 0 and r.lost_grace >= 0 and r.rebalance_wait >= 0, "recovery: lr_scale > 0, waits >= 0")
    h = config.heartbeat
    need(0 < h.period < h.ttl, "heartbeat: 0 < period < ttl")
    d = config.data
    need(len(d.source) > 0, "data.source must be set")
    if synthetic_source(d.source) is SyntheticSource.MARKOV:
        need(d.markov_order >= 1 and d.markov_alphabet >= 1, "data: markov_order and markov_alphabet must be >= 1")
        contexts = min(d.markov_alphabet, m.vocab_size) ** d.markov_order
        need(
            contexts <= MAX_MARKOV_CONTEXTS,
            f"data: the markov chain has {contexts} contexts (min(markov_alphabet, vocab_size)^markov_order), "
            f"more than {MAX_MARKOV_CONTEXTS}",
        )
    held_out = config.validation
    need(
        held_out.interval >= 0 and 1 <= held_out.batches <= 256, "validation: interval >= 0 (0: off), batches in 1..256"
    )
    v = config.verification
    need(
        0 <= v.rate <= v.raised_rate <= 1 and v.raised_seconds >= 0 and v.ban_seconds >= 0,
        "verification: 0 <= rate <= raised_rate <= 1, raised_seconds >= 0, ban_seconds >= 0",
    )
    need(
        v.strikes_to_ban >= 1 and v.strike_half_life > 0 and v.max_concurrent >= 1 and v.audit_seconds > 0,
        "verification: strikes_to_ban >= 1, strike_half_life > 0, max_concurrent >= 1, audit_seconds > 0",
    )
    need(
        min(v.fp32_tolerance, v.fp16_tolerance, v.bf16_tolerance, v.receipt_seconds) > 0 and v.max_receipts >= 1,
        "verification: the tolerances and receipt_seconds > 0, max_receipts >= 1",
    )
    need(
        config.data.tokenizer_hash == "" or _is_short_hash(config.data.tokenizer_hash),
        "data.tokenizer_hash must be empty or 16 lowercase hex characters (as `node prepare-data` writes it)",
    )
    need(
        config.data.manifest_hash == "" or _is_hex(config.data.manifest_hash, 64),
        "data.manifest_hash must be empty or 64 lowercase hex characters (a sha256, as `node bootstrap --data` sets it)",
    )


def _is_short_hash(text: str) -> bool:
    return _is_hex(text, 16)


def _is_hex(text: str, length: int) -> bool:
    return len(text) == length and all(c in "0123456789abcdef" for c in text)


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from e
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from e


def read_config(path: str | Path | Mapping[str, Any] | None = None, **overrides: Any) -> SwarmConfig:
    """Defaults, then the TOML file (or its parsed table), then explicit overrides (flags); None
    overrides are ignored. A [model] preset is refused here: node.model.presets.load_config resolves it
    (and is what the CLI reads a config with)."""
    raw: dict[str, Any] = SwarmConfig().to_dict()
    if path is not None:
        for key, value in (path if isinstance(path, Mapping) else load_toml(path)).items():
            if key in _SECTIONS and isinstance(value, Mapping):
                raw[key] = {**raw[key], **value}
            else:
                raw[key] = value
    for key, value in overrides.items():
        if value is None:
            continue
        if "." in key:
            section, name = key.split(".", 1)
            raw[section] = {**raw[section], name: value}
        else:
            raw[key] = value
    return SwarmConfig.from_dict(raw)

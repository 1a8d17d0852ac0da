"""The swarm configuration: one immutable description every peer of a swarm agrees on.

The bootstrapper builds it from defaults, a TOML file and flags, publishes it in the DHT with its
hash, and every joiner refuses to train if its own protocol version or the hash differ. Defaults
follow docs/algorithms.md (NoLoCo alpha 0.5, beta 0.7, gamma = beta, H = 50; CheckFree lr
scale 1.1; grad clip 1.0) scaled down to a model that trains on a laptop CPU.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tomllib
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, Mapping

from protocol.plain import plain_dict
from protocol.tensors import Compression
from protocol.version import PROTOCOL_VERSION


class GossipMode(StrEnum):
    """How replicas of a stage are kept together (docs/gossip.md)."""

    NOLOCO = "noloco"  # every H steps, an outer step with ONE random partner
    DILOCO = "diloco"  # every H steps, an outer step with every live replica
    NONE = "none"  # replicas drift apart (a baseline)


class RecoveryStrategy(StrEnum):
    """How a stage whose peers all vanished is rebuilt (docs/recovery.md)."""

    CHECKFREE = "checkfree"  # gradient-norm-weighted average of the two neighbours
    COPY = "copy"  # copy one neighbour
    RANDOM = "random"  # a fresh initialisation that can relearn
    CHECKPOINT = "checkpoint"  # reload the stage's last local checkpoint


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


@dataclass(frozen=True)
class ModelConfig:
    """A LLaMA-style decoder cut into stage 0 (embed + norm + head) and equal block stages."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 176
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    layers_per_stage: int = 1
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class TrainingConfig:
    microbatch_size: int = 8
    sequence_length: int = 64
    microbatches_per_step: int = 2
    max_in_flight: int = 4
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    total_steps: int = 5000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    wire_compression: Compression = Compression.FP16
    hop_timeout: float = 20.0
    max_retries: int = 3


@dataclass(frozen=True)
class GossipConfig:
    mode: GossipMode = GossipMode.NOLOCO
    inner_steps: int = 50
    outer_momentum: float = 0.5
    outer_lr: float = 0.7
    pull: float | None = None  # None ties gamma to beta, as the NoLoCo authors do
    round_timeout: float = 30.0
    max_norm_factor: float = 10.0

    @property
    def pull_coefficient(self) -> float:
        return self.outer_lr if self.pull is None else self.pull


@dataclass(frozen=True)
class RecoveryConfig:
    strategy: RecoveryStrategy = RecoveryStrategy.CHECKFREE
    checkfree_plus: bool = True
    lr_scale: float = 1.1
    lost_grace: float = 10.0
    rebalance_wait: float = 30.0
    edge_copy_interval: int = 50
    checkpoint_every: int = 50
    checkpoint_dir: str = "checkpoints"


@dataclass(frozen=True)
class HeartbeatConfig:
    period: float = 5.0
    ttl: float = 15.0


@dataclass(frozen=True)
class DataConfig:
    source: str = "synthetic"
    markov_branching: int = 4


@dataclass(frozen=True)
class SwarmConfig:
    swarm_id: str = "pipeswarm-demo"
    seed: int = 0
    num_stages: int = 3
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (enums as their strings): it is hashed, stored in the DHT and printed."""
        return dataclasses.asdict(self, dict_factory=plain_dict)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "SwarmConfig":
        return _build(cls, raw, "")

    def config_hash(self) -> str:
        """A short digest of everything that must agree across peers (protocol version included)."""
        canonical = json.dumps(
            {"protocol_version": PROTOCOL_VERSION, **self.to_dict()}, sort_keys=True, separators=(",", ":")
        )
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def replace(self, **sections: Mapping[str, Any]) -> "SwarmConfig":
        """A copy with some top-level values or section fields overridden (used for CLI flags)."""
        raw = self.to_dict()
        for key, value in sections.items():
            if isinstance(value, Mapping):
                raw[key] = {**raw[key], **value}
            else:
                raw[key] = value
        return SwarmConfig.from_dict(raw)


_SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig,
    "training": TrainingConfig,
    "gossip": GossipConfig,
    "recovery": RecoveryConfig,
    "heartbeat": HeartbeatConfig,
    "data": DataConfig,
}
_SECTIONS = set(_SECTION_TYPES)


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
        if cls is SwarmConfig and name in _SECTION_TYPES:
            values[name] = _build(_SECTION_TYPES[name], value, path)
        else:
            values[name] = _coerce(spec, value, path)
    return cls(**values)


_ENUM_TYPES: dict[str, type[StrEnum]] = {
    "Compression": Compression,
    "GossipMode": GossipMode,
    "RecoveryStrategy": RecoveryStrategy,
}


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
    need(m.num_attention_heads % m.num_key_value_heads == 0, "num_attention_heads must be a multiple of num_key_value_heads")
    need((m.hidden_size // m.num_attention_heads) % 2 == 0, "head dimension must be even (rotary embedding)")
    need(m.layers_per_stage >= 1 and m.vocab_size >= 2, "layers_per_stage >= 1 and vocab_size >= 2")
    t = config.training
    need(t.sequence_length <= m.max_position_embeddings, "sequence_length exceeds max_position_embeddings")
    need(t.microbatch_size >= 1 and t.microbatches_per_step >= 1 and t.max_in_flight >= 1, "batch sizes must be >= 1")
    need(t.hop_timeout > 0 and t.max_retries >= 0 and t.grad_clip > 0, "hop_timeout, grad_clip > 0; max_retries >= 0")
    g = config.gossip
    need(g.inner_steps >= 1 and g.round_timeout > 0 and g.max_norm_factor > 1, "gossip: inner_steps >= 1, timeout > 0, norm factor > 1")
    r = config.recovery
    need(r.lr_scale > 0 and r.lost_grace >= 0 and r.rebalance_wait >= 0, "recovery: lr_scale > 0, waits >= 0")
    h = config.heartbeat
    need(0 < h.period < h.ttl, "heartbeat: 0 < period < ttl")
    need(config.data.source == "synthetic" or len(config.data.source) > 0, "data.source must be set")


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from e
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from e


def load_config(path: str | Path | None = None, **overrides: Any) -> SwarmConfig:
    """Defaults, then the TOML file, then explicit overrides (flags); None overrides are ignored."""
    raw: dict[str, Any] = SwarmConfig().to_dict()
    if path is not None:
        for key, value in load_toml(path).items():
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

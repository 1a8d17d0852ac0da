"""Named model shapes for `node bootstrap --preset NAME` and `[model] preset = "NAME"` (docs/model.md).

A preset fills the [model] section (vocabulary, widths, heads, context, and `layers_per_stage`
derived from the preset's total layer count and the swarm's block stages, S = num_stages - 1), the
[training] values its model needs (a sequence as long as its context, the microbatch size and the
in-flight window a 24 GB GPU holds, and a learning rate for its width: `TrainingShape`) and num_stages where neither the TOML nor a
flag sets it (a gossip round's time follows its payload at run time: node/averaging/gossip_wire.py,
`round_budget`). Keys
written explicitly (the TOML's tables, "model.*", "training.*", "gossip.*" overrides, a
num_stages) win over the preset's values, so a preset is a starting point ("125m with a
8192-token vocabulary"); an explicit `layers_per_stage` also wins, and then the total is
layers_per_stage x S, not the preset's. The --preset flag wins over the TOML's preset. The
preset's name is not kept in the swarm config: only the values it filled are, so it is not part of
the config hash and `tiny` gives exactly the default config (and its hash).

Each shape follows a published LLaMA-style model (RMSNorm, rotary positions, SwiGLU, grouped-query
attention, no biases), so the published parameter count checks the shape. Those models tie the
LM head to the embedding; pipeswarm does not (stage 0 holds both, docs/model.md), so a preset has
exactly vocab_size x hidden_size parameters more than the model it follows.

No torch here; only `load_config` reads a file. `node.config.read_config` alone refuses a [model]
preset: presets sit above the config module, which must not import them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

from node import config as node_config
from node.config import ConfigError, ModelConfig, SwarmConfig, TrainingConfig, load_toml
from protocol import Compression

__all__ = [
    "PRESETS",
    "ModelPreset",
    "PresetName",
    "TrainingShape",
    "load_config",
    "preset_named",
    "preset_of",
    "preset_values",
    "valid_block_stage_counts",
]


class PresetName(StrEnum):
    """The presets, named by the size of the published model each follows (ours adds an untied head)."""

    TINY = "tiny"  # today's defaults: 133k parameters at 3 stages, one layer per block stage
    STORIES_15M = "15m"  # llama2.c stories15M: 24.4M here, the smallest real shape
    MOBILELLM_125M = "125m"  # MobileLLM-125M: 143M here
    MOBILELLM_350M = "350m"  # MobileLLM-350M: 376M here
    MOBILELLM_1B = "1b"  # MobileLLM-1B: 1.05B here


@dataclass(frozen=True)
class TrainingShape:
    """The [training] values a preset's model needs (docs/model.md, "Presets", says why each)."""

    sequence_length: int
    microbatch_size: int
    min_in_flight: int
    max_in_flight: int
    learning_rate: float | None = None  # None: width_scaled_lr of the preset's hidden size
    wire_compression: Compression = TrainingConfig.wire_compression
    slow_link_compression: Compression = TrainingConfig.slow_link_compression

    def training_values(self) -> dict[str, Any]:
        return asdict(self)


_DEFAULT_TRAINING = TrainingConfig()
# every real preset's hops travel in the rank-(W/9 - 1) int8 subspace with token anchors (protocol/subspace.py), on every link:
# 16.4x under fp16 at the 15m width, where a 50 Mbit/s uplink otherwise sets the pace; its loss cost
# and the alternatives are measured in docs/wire.md
SUBSPACE_HOPS = {"wire_compression": Compression.SUBSPACE8, "slow_link_compression": Compression.SUBSPACE8}
# Adam moves every weight of a hidden matrix by about lr a step, so a unit's input changes by about
# lr x width: the usable rate falls as 1 / width (muP, Yang et al. 2022, arXiv:2203.03466). Measured
# at 125m's width (576) with live StageWorkers on the Markov source (2 block layers, 200 steps of
# 512 tokens; tests/benchmarks/bench_learning_rate.py, docs/model.md "Presets"): held-out 1.06 at
# 6e-4, 1.09 at 1e-3, 1.82 at 3e-3, the default; at 15m's width (288) 1.12 at 1.2e-3 (this rule)
# against 1.50 at 3e-3. On an H200 the 125m swarm at 3e-3 sat at loss 2.9-3.3 after its first 20 steps.
LR_REFERENCE_WIDTH, LR_AT_REFERENCE = 576, 6e-4


def width_scaled_lr(hidden_size: int) -> float:
    """A real preset's learning rate: LR_AT_REFERENCE at LR_REFERENCE_WIDTH, x 1 / width elsewhere."""
    return round(LR_AT_REFERENCE * LR_REFERENCE_WIDTH / hidden_size, 7)


TODAYS_TRAINING = TrainingShape(
    learning_rate=_DEFAULT_TRAINING.learning_rate,
    sequence_length=_DEFAULT_TRAINING.sequence_length,
    microbatch_size=_DEFAULT_TRAINING.microbatch_size,
    min_in_flight=_DEFAULT_TRAINING.min_in_flight,
    max_in_flight=_DEFAULT_TRAINING.max_in_flight,
)


@dataclass(frozen=True)
class ModelPreset:
    """One shape: the [model] and [training] values it fills and the published model it follows."""

    name: PresetName
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_layers: int | None
    """Decoder layers in the whole model, split evenly over the block stages; None: one per block stage."""
    max_position_embeddings: int
    follows: str
    """The published model whose shape this is, and where its parameter count is stated."""
    published_parameters: int | None
    """The parameter count the publication states (None: nothing published, tiny)."""
    published_ties_embeddings: bool
    """Whether the published model shares the embedding with the LM head (pipeswarm never does)."""
    training: TrainingShape
    """Sequence length, microbatch size and in-flight window of a swarm of this preset."""
    num_stages: int | None
    """Stages of a swarm of this preset when neither the TOML nor a flag says (None: the default's)."""

    def layers_per_stage(self, num_stages: int) -> int:
        """The preset's layers over S = num_stages - 1 block stages; ConfigError when S does not divide them."""
        block_stages = num_stages - 1
        if self.num_layers is None:
            return 1
        if block_stages < 1 or self.num_layers % block_stages:
            choices = ", ".join(str(s + 1) for s in valid_block_stage_counts(self.num_layers))
            raise ConfigError(
                f"preset {self.name} has {self.num_layers} layers, which {block_stages} block stages "
                f"(num_stages = {num_stages}) cannot split evenly: choose num_stages among {choices}"
            )
        return self.num_layers // block_stages

    def model_values(self, num_stages: int) -> dict[str, Any]:
        """The [model] section this preset gives a swarm of `num_stages` stages."""
        values = {
            spec.name: getattr(self, spec.name) for spec in fields(ModelConfig) if spec.name != "layers_per_stage"
        }
        return {**values, "layers_per_stage": self.layers_per_stage(num_stages)}

    def training_values(self) -> dict[str, Any]:
        """The [training] values this preset gives a swarm: its shape's, the learning rate scaled to
        its width where the shape names none."""
        values = self.training.training_values()
        if values["learning_rate"] is None:
            values["learning_rate"] = width_scaled_lr(self.hidden_size)
        return values

    def model_config(self, num_stages: int) -> ModelConfig:
        return ModelConfig(**self.model_values(num_stages))

    @property
    def rms_norm_eps(self) -> float:
        return ModelConfig.rms_norm_eps  # every published model below uses LLaMA's 1e-5

    @property
    def rope_theta(self) -> float:
        return ModelConfig.rope_theta  # and LLaMA's 10000

    @property
    def embedding_init_std(self) -> float:
        return ModelConfig.embedding_init_std  # HF Llama's; a larger std is not measured at these widths


_DEFAULT = ModelConfig()

PRESETS: dict[PresetName, ModelPreset] = {
    preset.name: preset
    for preset in (
        ModelPreset(
            name=PresetName.TINY,
            vocab_size=_DEFAULT.vocab_size,
            hidden_size=_DEFAULT.hidden_size,
            intermediate_size=_DEFAULT.intermediate_size,
            num_attention_heads=_DEFAULT.num_attention_heads,
            num_key_value_heads=_DEFAULT.num_key_value_heads,
            num_layers=None,  # so that any num_stages keeps today's defaults (and the demo and tests work)
            max_position_embeddings=_DEFAULT.max_position_embeddings,
            follows="pipeswarm's defaults (node/config/__init__.py), no published model",
            published_parameters=None,
            published_ties_embeddings=False,
            training=TODAYS_TRAINING,
            num_stages=None,
        ),
        ModelPreset(
            name=PresetName.STORIES_15M,
            vocab_size=32000,
            hidden_size=288,
            intermediate_size=768,
            num_attention_heads=6,
            num_key_value_heads=6,
            num_layers=6,
            max_position_embeddings=256,
            follows=(
                "Karpathy's llama2.c stories15M (TinyStories; dim 288, 6 layers, 6 heads, hidden_dim 768, "
                "LLaMA-2 vocabulary of 32000, context 256); its README rounds the count to 15M, the published "
                "checkpoint (karpathy/tinyllamas stories15M.pt, HF Xenova/llama2.c-stories15M) holds "
                "15,191,712 parameters with tied embeddings"
            ),
            published_parameters=15_191_712,
            published_ties_embeddings=True,
            # its whole context; 8 x 256 = 2048 tokens a microbatch, as the larger presets; a window of
            # 4..16 keeps a peer of any stage near 3 GiB in fp32 on a CPU (a laptop's RAM)
            training=TrainingShape(
                sequence_length=256,
                microbatch_size=8,
                min_in_flight=4,
                max_in_flight=16,
                **SUBSPACE_HOPS,
            ),
            num_stages=3,  # 2 block stages x 3 layers
        ),
        ModelPreset(
            name=PresetName.MOBILELLM_125M,
            vocab_size=32000,
            hidden_size=576,
            intermediate_size=1536,
            num_attention_heads=9,
            num_key_value_heads=3,
            num_layers=30,
            max_position_embeddings=2048,
            follows=(
                "MobileLLM-125M (Liu et al., ICML 2024, arXiv:2402.14905; HF facebook/MobileLLM-125M: "
                "30 layers, 9 heads, 3 KV heads, dim 576, FFN 1536, vocabulary 32000, context 2048), "
                "published as 124.6M parameters with shared embeddings"
            ),
            published_parameters=124_600_000,
            published_ties_embeddings=True,
            # the 2048-token context MobileLLM trained at (shorter would leave positions it advertises
            # untrained); one sequence a microbatch keeps the unit of memory and of wire traffic small
            # (a 137 KB subspace8 hop, 2.4 MB in fp16); a window up to 16 fits a 24 GB GPU in bf16 and in fp16
            training=TrainingShape(
                sequence_length=2048,
                microbatch_size=1,
                min_in_flight=4,
                max_in_flight=16,
                **SUBSPACE_HOPS,
            ),
            num_stages=4,  # 3 block stages x 10 layers
        ),
        ModelPreset(
            name=PresetName.MOBILELLM_350M,
            vocab_size=32000,
            hidden_size=960,
            intermediate_size=2560,
            num_attention_heads=15,
            num_key_value_heads=5,
            num_layers=32,
            max_position_embeddings=2048,
            follows=(
                "MobileLLM-350M (same paper; HF facebook/MobileLLM-350M: 32 layers, 15 heads, 5 KV heads, "
                "dim 960, FFN 2560, vocabulary 32000, context 2048), published as 345.3M parameters with "
                "shared embeddings"
            ),
            published_parameters=345_300_000,
            published_ties_embeddings=True,
            # as 125m; 12 in flight is what a 24 GB GPU holds on a block stage of 8 layers
            training=TrainingShape(
                sequence_length=2048,
                microbatch_size=1,
                min_in_flight=4,
                max_in_flight=12,
                **SUBSPACE_HOPS,
            ),
            num_stages=5,  # 4 block stages x 8 layers
        ),
        ModelPreset(
            name=PresetName.MOBILELLM_1B,
            vocab_size=32000,
            hidden_size=1280,
            intermediate_size=3584,
            num_attention_heads=20,
            num_key_value_heads=5,
            num_layers=54,
            max_position_embeddings=2048,
            follows=(
                "MobileLLM-1B (same paper, updated release; HF facebook/MobileLLM-1B: 54 layers, 20 heads, "
                "5 KV heads, dim 1280, FFN 3584, vocabulary 32000, context 2048), published as 1.01B "
                "parameters with shared embeddings"
            ),
            published_parameters=1_010_000_000,
            published_ties_embeddings=True,
            # as 125m; 10 in flight is what a 24 GB GPU holds on a block stage of 6 layers
            training=TrainingShape(
                sequence_length=2048,
                microbatch_size=1,
                min_in_flight=4,
                max_in_flight=10,
                **SUBSPACE_HOPS,
            ),
            num_stages=10,  # 9 block stages x 6 layers
        ),
    )
}


def valid_block_stage_counts(num_layers: int) -> list[int]:
    """The block-stage counts S that split `num_layers` evenly (num_stages = S + 1 must stay <= 64)."""
    return [s for s in range(1, min(num_layers, 63) + 1) if num_layers % s == 0]


def preset_named(name: Any) -> ModelPreset:
    """The preset called `name`; ConfigError naming the choices otherwise."""
    try:
        return PRESETS[PresetName(name)]
    except ValueError:
        choices = ", ".join(member.value for member in PresetName)
        raise ConfigError(f"model.preset: {name!r} is not one of {choices}") from None


def preset_values(name: Any, num_stages: Any, written: Mapping[str, Any]) -> dict[str, Any]:
    """The "model.*" and "training.*" values preset `name` gives a swarm of `num_stages` stages (its
    final count, after files and flags), but for the dotted keys in `written` (the values the user
    wrote, which win). A written context shorter than the preset's sequence shortens the sequence
    to it."""
    preset = preset_named(name)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int):
        raise ConfigError(f"num_stages: expected int, got {type(num_stages).__name__}")
    if "model.layers_per_stage" in written:
        # the user chose the split; the preset's total then does not apply, nor its divisibility
        model = {key: value for key, value in preset.model_values(2).items() if key != "layers_per_stage"}
    else:
        model = preset.model_values(num_stages)
    training = preset.training_values()
    if {"training.wire_compression", "training.slow_link_compression"} & written.keys():
        # the two go together (a subspace codec is part of the model): the user's choice takes both
        del training["wire_compression"], training["slow_link_compression"]
    context = written.get("model.max_position_embeddings")
    if isinstance(context, int) and not isinstance(context, bool) and context >= 1:
        training["sequence_length"] = min(training["sequence_length"], context)
    values = {f"model.{key}": value for key, value in model.items()}
    values |= {f"training.{key}": value for key, value in training.items()}
    return {key: value for key, value in values.items() if key not in written}


PRESET_SECTIONS = ("model", "training")  # the sections a preset fills keys of


def load_config(path: str | Path | None = None, **overrides: Any) -> SwarmConfig:
    """node.config.read_config with a model preset resolved: `overrides["model.preset"]` (the
    --preset flag), else the TOML's [model] preset, fills the [model] and [training] keys and the
    num_stages that neither the TOML nor the overrides set. The
    preset's name is dropped: it is no part of the config or its hash."""
    table = dict(load_toml(path)) if path is not None else {}
    toml_model = table.get("model")
    toml_preset = None
    if isinstance(toml_model, Mapping):
        table["model"] = {key: value for key, value in toml_model.items() if key != "preset"}
        toml_preset = toml_model.get("preset")
    flag_preset = overrides.pop("model.preset", None)
    name = toml_preset if flag_preset is None else flag_preset
    if name is None:
        return node_config.read_config(table, **overrides)
    preset = preset_named(name)
    written = {
        f"{section}.{key}": value
        for section in PRESET_SECTIONS
        if isinstance(table.get(section), Mapping)
        for key, value in table[section].items()
    }
    written |= {key: value for key, value in overrides.items() if value is not None}
    num_stages = overrides.get("num_stages")
    if num_stages is None:
        num_stages = table.get("num_stages", preset.num_stages or SwarmConfig.num_stages)
    filled = {"num_stages": num_stages, **preset_values(name, num_stages, written)}
    return node_config.read_config(table, **{**filled, **{k: v for k, v in overrides.items() if v is not None}})


def preset_of(model: ModelConfig, num_stages: int) -> PresetName | None:
    """The preset whose values `model` holds exactly at `num_stages`, or None (a custom shape)."""
    for preset in PRESETS.values():
        try:
            if preset.model_config(num_stages) == model:
                return preset.name
        except ConfigError:
            continue
    return None

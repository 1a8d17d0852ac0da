"""What every simulated run shares: the model and pipeline shape, the link, the clock's costs.

The model is the project's LLaMA stage model at a small width on a 32-token second-order chain
(sources.py) or on real text (`data`: a prepared directory), so a preset trains in minutes on a CPU; the clock can still be charged as a larger
model would be, through `compute_ms` (seconds per microbatch-stage) and the link flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from node.config import ModelConfig, RoutingMode, SwarmConfig, read_config
from node.model.corpus import load_prepared
from node.simulate.links import DEFAULT_BANDWIDTH_MBIT, DEFAULT_LATENCY_MS, LinkModel


@dataclass(frozen=True)
class SimSettings:
    steps: int = 300  # iterations (every stage-0 replica sends microbatches_per_step microbatches)
    stages: int = 5  # counting stage 0: 4 block stages, so stages 2 and 3 are middle stages
    replicas: int = 2
    seed: int = 0
    hidden: int = 64
    heads: int = 4  # attention heads (and key-value heads below): 4 of width 16 at the default size
    kv_heads: int = 4
    intermediate: int | None = None  # the MLP's width; None: 2 x hidden
    layers_per_stage: int = 1
    embedding_init_std: float = ModelConfig.embedding_init_std
    vocab: int = 32
    microbatch: int = 8
    sequence: int = 32
    microbatches_per_step: int = 1
    learning_rate: float = 3e-3
    inner_steps: int = 50  # H of the outer steps
    routing: RoutingMode = RoutingMode.LOAD_AWARE
    latency_ms: float = DEFAULT_LATENCY_MS
    bandwidth_mbit: float = DEFAULT_BANDWIDTH_MBIT
    compute_ms: float | None = None  # per microbatch-stage (forward + backward); None: measured once
    eval_every: int = 10
    eval_batches: int = 4
    data: str | None = None  # a `node prepare-data` directory: real text, its tokenizer's vocabulary (not `vocab`)
    device: str = "cpu"  # every stage worker's (cpu, cuda, cuda:N); the clock is simulated on any of them

    @property
    def link(self) -> LinkModel:
        return LinkModel.from_flags(self.latency_ms, self.bandwidth_mbit)

    @property
    def compute_seconds(self) -> float | None:
        return None if self.compute_ms is None else self.compute_ms / 1000.0

    def config(self, **overrides: object) -> SwarmConfig:
        """The SwarmConfig of this run; `overrides` are dotted config keys (e.g. recovery.checkfree_plus)."""
        if self.stages < 2 or self.replicas < 1 or self.steps < 1:
            raise ValueError("need stages >= 2, replicas >= 1, steps >= 1")
        values = {
            "model.vocab_size": self.vocab,
            "model.hidden_size": self.hidden,
            "model.intermediate_size": self.intermediate or 2 * self.hidden,
            "model.num_attention_heads": self.heads,
            "model.num_key_value_heads": self.kv_heads,
            "model.layers_per_stage": self.layers_per_stage,
            "model.embedding_init_std": self.embedding_init_std,
            "training.microbatch_size": self.microbatch,
            "training.sequence_length": self.sequence,
            "training.microbatches_per_step": self.microbatches_per_step,
            "training.learning_rate": self.learning_rate,
            "training.warmup_steps": 20,
            "training.total_steps": max(self.steps, 21),
            "training.routing": self.routing,
            "gossip.inner_steps": self.inner_steps,
            "recovery.checkfree_plus": False,
        }
        if self.data is not None:
            values.update(prepared_data_values(self.data))
        values.update(overrides)
        return read_config(None, swarm_id="simulate", seed=self.seed, num_stages=self.stages, **values)


def prepared_data_values(directory: str | Path) -> dict[str, object]:
    """The dotted config keys of a run on a `node prepare-data` directory: the model's vocabulary is
    its tokenizer's, and the run records that tokenizer, which open_source and open_heldout check the
    directory against (node/model/data.py). PreparedDataError: not a prepared directory."""
    prepared = load_prepared(directory)
    return {
        "model.vocab_size": prepared.vocab_size,
        "data.source": str(directory),
        "data.tokenizer_hash": prepared.tokenizer_hash,
    }

"""docs/model.md's generated tables: the presets, the memory each stage of each needs by part, and
the estimate against measured peaks (tests/benchmarks/bench_memory.py measures and writes them;
tests/unit/test_memory_tables.py fails when the page and the code disagree).

Pure: the estimate (node/model/memory.py) and the presets (node/model/presets.py) in, markdown out.
The generated parts of a page sit between `<!-- generated: NAME ... -->` and `<!-- end: NAME -->`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from node.config import Precision, SwarmConfig
from node.model.memory import StageMemory, estimate_stage_memory, format_bytes
from node.model.parameters import count_parameters, count_stage_parameters
from node.model.presets import PRESETS, ModelPreset, PresetName, load_config

__all__ = [
    "HOME_GPU_BUDGET",
    "GeneratedTable",
    "MeasuredCase",
    "generated_tables",
    "replace_generated",
]

# what a 24 GiB home GPU (RTX 3090/4090) leaves a stage: the card less ~1 GiB of CUDA context and
# ~3 GiB for the caching allocator's reserve beyond max_memory_allocated, which the estimate models
HOME_GPU_BUDGET = 20 * 2**30
REGENERATE = "python tests/benchmarks/bench_memory.py --estimate-only"


class GeneratedTable(StrEnum):
    """The generated parts of docs/model.md, by their marker name."""

    PRESETS = "presets"
    MEMORY = "memory"
    MEASURED = "measured"


@dataclass(frozen=True)
class MeasuredCase:
    """One measurement of tests/benchmarks/bench_memory.py: a stage of a preset at a window."""

    preset: str
    num_stages: int
    stage: int
    device: str
    precision: str
    in_flight: int
    microbatch_size: int
    sequence_length: int
    measured_bytes: int
    seconds: float

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> MeasuredCase:
        return cls(**{spec.name: record[spec.name] for spec in fields(cls)})

    def config(self) -> SwarmConfig:
        """The swarm it measured: the preset at the stage count and microbatch shape it ran."""
        return load_config(
            **{
                "model.preset": self.preset,
                "num_stages": self.num_stages,
                "training.microbatch_size": self.microbatch_size,
                "training.sequence_length": self.sequence_length,
            }
        )

    def estimate(self) -> StageMemory:
        precision = Precision(self.precision)
        return estimate_stage_memory(self.config(), self.stage, self.in_flight, precision=precision, device=self.device)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _preset_config(preset: ModelPreset) -> SwarmConfig:
    return load_config(**{"model.preset": preset.name.value})


def _gpu(config: SwarmConfig, stage: int, in_flight: int | None = None) -> StageMemory:
    return estimate_stage_memory(config, stage, in_flight, precision=Precision.BF16, device="cuda")


def _cpu(config: SwarmConfig, stage: int, in_flight: int | None = None) -> StageMemory:
    return estimate_stage_memory(config, stage, in_flight)


def _published(count: int | None) -> str:
    """A published parameter count as published: exact when it is, rounded (124.6M, 1.01B) when not."""
    if count is None:
        return "-"
    if count % 100_000:
        return f"{count:,}"
    return f"{count / 1e9:.2f}B" if count >= 10**9 else f"{count / 1e6:.1f}M"


def _gpu_and_cpu(config: SwarmConfig, stage: int) -> str:
    return f"{format_bytes(_gpu(config, stage).total)} / {format_bytes(_cpu(config, stage).total)}"


def presets_table() -> str:
    """One row per preset: its shape, parameters, training shape, gossip timeout and memory per peer."""
    rows = []
    for preset in PRESETS.values():
        config = _preset_config(preset)
        m, t, block_stages = config.model, config.training, config.num_stages - 1
        layers = "S (one per block stage)" if preset.num_layers is None else str(preset.num_layers)
        widths = (m.hidden_size, m.intermediate_size, m.num_attention_heads, m.num_key_value_heads)
        total = count_parameters(m, config.num_stages)
        rows.append(
            [
                f"`{preset.name.value}`",
                preset.follows.split(" (")[0],
                " / ".join(str(v) for v in (*widths, layers, m.vocab_size, m.max_position_embeddings)),
                _published(preset.published_parameters),
                f"{total:,}",
                f"{config.num_stages}: {block_stages} x {m.layers_per_stage}, {count_stage_parameters(m, 1):,}",
                f"{t.microbatch_size} x {t.sequence_length}, {t.min_in_flight}..{t.max_in_flight}",
                _gpu_and_cpu(config, 0),
                _gpu_and_cpu(config, 1),
            ]
        )
    header = [
        "preset",
        "follows",
        "H / I / heads / kv / layers / V / context",
        "published (tied)",
        "here (untied)",
        "num_stages: block stages x layers, params per block stage",
        "microbatch, in flight",
        "stage 0 per peer: bf16 GPU / fp32 CPU",
        "block stage per peer: bf16 GPU / fp32 CPU",
    ]
    return _table(header, rows)


MEMORY_PARTS = tuple(spec.name for spec in fields(StageMemory) if spec.name not in ("stage", "parameters"))


def memory_table() -> str:
    """Per preset (at its own stage count), stage 0 and stage 1 (a block stage, with its edge copy):
    every part in fp32 on a CPU at max_in_flight, then the totals elsewhere."""
    rows = []
    for name in PresetName:
        config = _preset_config(PRESETS[name])
        t = config.training
        for stage in (0, 1):
            cpu = _cpu(config, stage)
            parts = [format_bytes(getattr(cpu, part)) if getattr(cpu, part) else "-" for part in MEMORY_PARTS]
            rows.append(
                [
                    f"`{name.value}`",
                    str(stage),
                    f"{cpu.parameters:,}",
                    *parts,
                    f"**{format_bytes(cpu.total)}**",
                    format_bytes(_gpu(config, stage).total),
                    f"{format_bytes(_cpu(config, stage, t.min_in_flight).total)} / "
                    f"{format_bytes(_gpu(config, stage, t.min_in_flight).total)}",
                ]
            )
    header = [
        "preset",
        "stage",
        "parameters",
        *(part.replace("_", " ") for part in MEMORY_PARTS),
        "total, fp32 CPU",
        "total, bf16 GPU",
        "at min_in_flight: fp32 CPU / bf16 GPU",
    ]
    return _table(header, rows)


def measured_table(cases: Sequence[MeasuredCase]) -> str:
    """The recorded measurements beside the estimate the code gives for the same case now."""
    rows = []
    for case in cases:
        estimate = case.estimate().total
        rows.append(
            [
                f"`{case.preset}`",
                str(case.stage),
                f"{case.device}, {case.precision}",
                f"{case.microbatch_size} x {case.sequence_length}",
                str(case.in_flight),
                format_bytes(case.measured_bytes),
                format_bytes(estimate),
                f"{estimate / case.measured_bytes:.2f}",
                f"{case.seconds:.0f} s",
            ]
        )
    header = [
        "preset",
        "stage",
        "device, precision",
        "microbatch",
        "in flight",
        "measured peak",
        "estimate",
        "estimate / measured",
        "run",
    ]
    return _table(header, rows)


def generated_tables(cases: Sequence[MeasuredCase]) -> dict[GeneratedTable, str]:
    return {
        GeneratedTable.PRESETS: presets_table(),
        GeneratedTable.MEMORY: memory_table(),
        GeneratedTable.MEASURED: measured_table(cases),
    }


def _markers(name: GeneratedTable) -> tuple[str, str]:
    return f"<!-- generated: {name.value} ({REGENERATE}) -->", f"<!-- end: {name.value} -->"


def _span(text: str, name: GeneratedTable) -> tuple[int, int] | None:
    """Where the generated part of `name` lies in `text` (between its markers' lines), or None."""
    begin, end = _markers(name)
    start = text.find(begin + "\n")
    stop = text.find("\n" + end, start)
    if start < 0 or stop < 0:
        return None
    return start + len(begin) + 1, stop


def generated_part(text: str, name: GeneratedTable) -> str | None:
    """What the page holds between the markers of `name` (None: no such markers)."""
    span = _span(text, name)
    return None if span is None else text[span[0] : span[1]]


def replace_generated(text: str, tables: Mapping[GeneratedTable, str]) -> str:
    """`text` with each generated part replaced; ValueError naming a part whose markers are missing."""
    for name, table in tables.items():
        span = _span(text, name)
        if span is None:
            begin, end = _markers(name)
            raise ValueError(f"the page has no '{begin}' ... '{end}' markers")
        text = text[: span[0]] + table + text[span[1] :]
    return text

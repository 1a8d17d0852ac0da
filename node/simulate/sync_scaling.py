"""Experiment `sync-scaling`: one NoLoCo round vs a tree and a ring all-reduce, N = 2..max replicas.

Reads beside the NoLoCo paper's claim (docs/algorithms.md: about 10x faster synchronisation than a
tree all-reduce at ~1000 replicas). The payload is a whole model of a named preset
(node/model/presets.py, fp32), as in data-parallel training where every replica syncs all of it;
the prices are collectives.py's under the link model. No model runs: it takes a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.model.parameters import count_parameters
from node.model.presets import PresetName, load_config
from node.simulate.collectives import SyncMethod, sync_seconds
from node.simulate.links import LinkModel
from node.simulate.output import have_matplotlib, plot_lines, series_of, write_csv, write_json

FP32_BYTES = 4


@dataclass(frozen=True)
class SyncScalingSettings:
    model_preset: PresetName = PresetName.MOBILELLM_125M
    max_replicas: int = 1024


def replica_counts(max_replicas: int) -> list[int]:
    """2, 4, 8, ... up to max_replicas (powers of two, bounded by the argument)."""
    if max_replicas < 2:
        raise ValueError(f"need at least 2 replicas, got {max_replicas}")
    counts, n = [], 2
    while n <= max_replicas:
        counts.append(n)
        n *= 2
    return counts


def run_sync_scaling(settings: SyncScalingSettings, link: LinkModel, out: Path) -> dict[str, Any]:
    config = load_config(None, num_stages=2, **{"model.preset": settings.model_preset})
    parameters = count_parameters(config.model, config.num_stages)
    nbytes = FP32_BYTES * parameters
    rows = []
    for n in replica_counts(settings.max_replicas):
        row: dict[str, Any] = {"replicas": n}
        for method in SyncMethod:
            row[f"{method.value}_seconds"] = sync_seconds(method, n, nbytes, link)
        row["tree_over_noloco"] = row["tree_seconds"] / row["noloco_seconds"]
        row["ring_over_noloco"] = row["ring_seconds"] / row["noloco_seconds"]
        rows.append(row)
    summary = {
        "experiment": "sync-scaling",
        "model_preset": settings.model_preset.value,
        "parameters": parameters,
        "payload_bytes": nbytes,
        "link": link.describe(),
        "rows": rows,
        "largest": rows[-1],
    }
    write_csv(out / "sync_scaling.csv", rows)
    write_json(out / "sync_scaling.json", summary)
    plots = []
    if have_matplotlib():
        long_rows = [
            {"method": method.value, "replicas": row["replicas"], "seconds": row[f"{method.value}_seconds"]}
            for row in rows
            for method in SyncMethod
        ]
        path = plot_lines(
            out / "sync_scaling.png",
            series_of(long_rows, "method", "replicas", "seconds"),
            "replicas N",
            "seconds per synchronisation",
            f"{settings.model_preset.value} ({parameters / 1e6:.0f}M fp32), {link.describe()}",
            log_x=True,
            log_y=True,
        )
        plots.append(path.name)
    summary["plots"] = plots
    return summary

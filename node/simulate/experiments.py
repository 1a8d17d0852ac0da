"""The named experiments of `node simulate` and their presets; what the CLI calls.

Presets: `default` is what docs/results.md shows (minutes on 2 CPU cores); `tiny` is what the tests
run (seconds). Flags given on the command line override a preset's values.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from node.model.presets import PresetName
from node.simulate.gossip import GossipSettings, run_gossip
from node.simulate.names import ExperimentName, SimPreset
from node.simulate.output import have_matplotlib, progress_bar
from node.simulate.recovery import RecoverySettings, run_recovery
from node.simulate.settings import SimSettings
from node.simulate.sync_scaling import SyncScalingSettings, run_sync_scaling

# compute_ms 13000: the clock is charged as if a microbatch-stage took 13 s, which makes a failure-free
# iteration ~72 s as in the CheckFree authors' 500M setup (10 %/h -> 0.002 per iteration there and
# here); the model that learns stays small. Their 10k iterations are compressed into a few hundred,
# so the failure rate is raised to give a comparable number of failures per run (docs/results.md).
RECOVERY_PRESETS = {
    SimPreset.DEFAULT: (
        # seed 2: five failures spread over both middle stages (seed 0's schedule happens to hold none)
        SimSettings(steps=160, compute_ms=13000.0, eval_every=10, seed=2),
        RecoverySettings(failure_percent_per_hour=100.0, failures_from=40),
    ),
    SimPreset.TINY: (
        SimSettings(steps=10, stages=4, compute_ms=13000.0, eval_every=3, eval_batches=1, hidden=32),
        RecoverySettings(failure_percent_per_hour=2500.0, failures_from=3, checkpoint_every=4),
    ),
}
GOSSIP_PRESETS = {
    SimPreset.DEFAULT: SimSettings(steps=100, replicas=4, stages=3, inner_steps=10, eval_every=10, hidden=32),
    SimPreset.TINY: SimSettings(steps=8, replicas=2, stages=3, inner_steps=4, eval_every=4, eval_batches=1, hidden=32),
}
SYNC_PRESETS = {
    SimPreset.DEFAULT: SyncScalingSettings(PresetName.MOBILELLM_125M, 1024),
    SimPreset.TINY: SyncScalingSettings(PresetName.MOBILELLM_125M, 1024),
}


def _override(settings: Any, values: dict[str, Any]) -> Any:
    """`settings` with the fields in `values` that it has and that are not None."""
    names = {f.name for f in dataclasses.fields(settings)}
    return dataclasses.replace(settings, **{k: v for k, v in values.items() if k in names and v is not None})


def run_experiment(
    name: ExperimentName | str,
    out: Path,
    preset: SimPreset | str = SimPreset.DEFAULT,
    overrides: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run one experiment, write its files under `out`; returns its summary (also in <name>.json).

    `overrides` are SimSettings / RecoverySettings / SyncScalingSettings field names -> values."""
    name, preset, values = ExperimentName(name), SimPreset(preset), dict(overrides or {})
    torch.set_num_threads(1)  # the machine is shared; the models are tiny
    out = Path(out)
    if name == ExperimentName.SYNC_SCALING:
        sim = _override(SimSettings(), values)
        summary = run_sync_scaling(_override(SYNC_PRESETS[preset], values), sim.link, out)
    elif name == ExperimentName.RECOVERY:
        sim_preset, recovery_preset = RECOVERY_PRESETS[preset]
        sim, settings = _override(sim_preset, values), _override(recovery_preset, values)
        with progress_bar(sim.steps * len(settings.variants), progress) as advance:
            summary = run_recovery(sim, settings, out, advance)
    else:
        sim, settings = _override(GOSSIP_PRESETS[preset], values), _override(GossipSettings(), values)
        pipelines = len(settings.routings) + settings.fixed_pipelines
        with progress_bar(sim.steps * len(settings.modes) * pipelines, progress) as advance:
            summary = run_gossip(sim, settings, out, advance)
    if not have_matplotlib():
        print(f"plots skipped: matplotlib is not installed (pip install 'pipeswarm[plots]'); CSV and JSON are in {out}")
    return summary

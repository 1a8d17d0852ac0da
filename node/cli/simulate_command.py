"""`node simulate EXPERIMENT` (node/simulate/, docs/results.md)."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from node.model.presets import PresetName
from node.simulate.names import ExperimentName, FailingStages, SimPreset

logger = logging.getLogger(__name__)


def add_simulate_parser(commands: Any) -> None:
    """`node simulate EXPERIMENT`: flags left unset keep the preset's value (node/simulate/experiments.py)."""
    sim = commands.add_parser("simulate", help="S stages x R replicas in one process on a simulated clock")
    sim.add_argument("experiment", choices=[e.value for e in ExperimentName])
    sim.add_argument("--preset", choices=[p.value for p in SimPreset], default=SimPreset.DEFAULT.value)
    sim.add_argument("--out", default="simulate-out", help="directory for CSV, JSON and PNG files")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    numbers = {
        "--steps": (int, "iterations per run"),
        "--stages": (int, "pipeline stages counting stage 0"),
        "--replicas": (int, "replicas per stage"),
        "--seed": (int, "seed of the model, data and failure schedule"),
        "--hidden": (int, "model width"),
        "--sequence": (int, "tokens per sequence"),
        "--microbatch": (int, "sequences per microbatch"),
        "--embedding-init-std": (float, "std of the token embedding's initial weights (default 0.02)"),
        "--latency-ms": (float, "one-way link latency (default 50)"),
        "--bandwidth-mbit": (float, "link bandwidth (default 100)"),
        "--compute-ms": (float, "clock charge of one microbatch-stage (default: measured)"),
        "--inner-steps": (int, "H: inner steps between outer rounds"),
        "--failures-from": (int, "recovery: first iteration that may fail"),
        "--checkpoint-every": (int, "recovery: K iterations between saves"),
        "--checkpoint-save-s": (float, "recovery: fixed cost of a save"),
        "--restart-s": (float, "recovery: restart cost after a rollback"),
        "--target-loss": (float, "recovery: loss whose wall-clock is reported"),
        "--max-replicas": (int, "sync-scaling: largest N"),
    }
    for flag, (kind, text) in numbers.items():
        sim.add_argument(flag, type=kind, help=text)
    sim.add_argument(
        "--failure-rate-per-hour", dest="failure_percent_per_hour", type=float, help="recovery: per stage, in %%/h"
    )
    sim.add_argument(
        "--failing",
        choices=[f.value for f in FailingStages],
        help="recovery: which stages fail (middle: 2..S-1, the default; blocks: 1..S, edge stages too)",
    )
    sim.add_argument(
        "--data", metavar="DIR", help="train on a `node prepare-data` directory (its vocabulary) instead of the chain"
    )
    sim.add_argument("--model-preset", choices=[p.value for p in PresetName], help="sync-scaling: the payload model")
    sim.add_argument("--device", help="where every stage worker computes: cpu (the default), cuda, cuda:N")


def cmd_simulate(args: argparse.Namespace) -> int:
    from node.runtime.device import device_problem
    from node.simulate.experiments import run_experiment

    if args.device is not None and (problem := device_problem(args.device)):
        logger.error(f"cannot simulate: {problem}")
        return 2
    skip = {"command", "log_level", "experiment", "preset", "out", "no_progress"}
    overrides = {key: value for key, value in vars(args).items() if key not in skip and value is not None}
    if "model_preset" in overrides:
        overrides["model_preset"] = PresetName(overrides["model_preset"])
    if "failing" in overrides:
        overrides["failing"] = FailingStages(overrides["failing"])
    try:
        summary = run_experiment(args.experiment, args.out, args.preset, overrides, progress=not args.no_progress)
    except ValueError as e:  # a setting out of range (ConfigError is one): the user's flags, not a crash
        logger.error(f"cannot simulate: {e}")
        logger.debug("the refused settings' traceback", exc_info=True)
        return 2
    print(json.dumps(summary.get("variants") or summary.get("largest"), indent=1, default=str))
    print(f"results in {args.out}", flush=True)
    return 0

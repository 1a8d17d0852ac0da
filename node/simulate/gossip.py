"""Experiment `gossip`: NoLoCo vs DiLoCo vs averaging every step, random vs load-aware routing.

Reads beside the NoLoCo paper (docs/algorithms.md: up to 4 % faster convergence than DiLoCo; random
routing mixes gradients across replicas). Every run sees the same tokens (same iterations, same
replicas, same data streams); only how replicas meet (swarm.py SyncMode, the project's outer steps)
and how microbatches pick the next stage's replica (the project's Router) change. Measured: held-out
loss, replica divergence (mean relative distance from replica 0, noloco.relative_distance), and
simulated seconds with each method's synchronisation charged (collectives.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.config import RoutingMode
from node.simulate.output import have_matplotlib, plot_lines, series_of, write_csv, write_json
from node.simulate.settings import SimSettings
from node.simulate.swarm import SimulatedSwarm, SyncMode

COMPARED = (SyncMode.NOLOCO, SyncMode.DILOCO, SyncMode.ALLREDUCE)


@dataclass(frozen=True)
class GossipSettings:
    modes: tuple[SyncMode, ...] = COMPARED
    routings: tuple[RoutingMode, ...] = (RoutingMode.RANDOM, RoutingMode.SHUFFLED, RoutingMode.LOAD_AWARE)
    fixed_pipelines: bool = False  # also each mode without routing: replica r's pipeline is replica r of every stage


FIXED = "fixed"  # the variant name's routing part for fixed pipelines


def run_gossip(sim: SimSettings, settings: GossipSettings, out: Path, advance: Callable[[str], None]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    variants: dict[str, dict[str, Any]] = {}
    pipelines = [(routing.value, routing) for routing in settings.routings]
    pipelines += [(FIXED, None)] if settings.fixed_pipelines else []
    for mode in settings.modes:
        for label, routing in pipelines:
            name = f"{mode.value}/{label}"
            run_rows = run_one(
                dataclasses.replace(sim, routing=routing or sim.routing), mode, name, advance, routing is None
            )
            rows += run_rows
            last = run_rows[-1]
            variants[name] = {
                "final_loss": last["eval_loss"],
                "final_divergence": last["divergence"],
                "mean_divergence": sum(r["divergence"] for r in run_rows) / len(run_rows),
                "sim_seconds": last["sim_seconds"],
                "sync_seconds": last["sync_seconds"],
            }
    summary = {
        "experiment": "gossip",
        "settings": dataclasses.asdict(sim),
        "link": sim.link.describe(),
        "variants": variants,
    }
    write_csv(out / "gossip.csv", rows)
    write_json(out / "gossip.json", summary)
    plots = []
    if have_matplotlib():
        for y, label in (("eval_loss", "held-out loss (nats)"), ("divergence", "replica divergence")):
            path = plot_lines(
                out / f"gossip_{y}.png",
                series_of(rows, "variant", "iteration", y),
                "iterations",
                label,
                f"gossip: {label}",
            )
            plots.append(path.name)
        path = plot_lines(
            out / "gossip_loss_vs_sim_seconds.png",
            series_of(rows, "variant", "sim_seconds", "eval_loss"),
            "simulated seconds",
            "held-out loss (nats)",
            "gossip: loss vs simulated time",
        )
        plots.append(path.name)
    summary["plots"] = plots
    return summary


def run_one(
    sim: SimSettings, mode: SyncMode, name: str, advance: Callable[[str], None], fixed_pipelines: bool = False
) -> list[dict[str, Any]]:
    swarm = SimulatedSwarm(
        sim.config(),
        sim.replicas,
        sim.link,
        sim.compute_seconds,
        mode,
        sim.seed,
        fixed_pipelines=fixed_pipelines,
        device=sim.device,
    )
    held_out = swarm.held_out(sim.eval_batches)
    rows, synced = [], 0.0
    try:
        for iteration in range(sim.steps):
            result = swarm.train_iteration()
            synced += swarm.synchronise()
            if iteration % sim.eval_every == 0 or iteration == sim.steps - 1:
                rows.append(
                    {
                        "variant": name,
                        "iteration": iteration + 1,
                        "sim_seconds": round(swarm.clock.now(), 3),
                        "sync_seconds": round(synced, 3),
                        "train_loss": result.loss,
                        "eval_loss": swarm.eval_loss(held_out),
                        "divergence": swarm.divergence(),
                    }
                )
            advance(f"gossip {name}")
        return rows
    finally:
        swarm.close()

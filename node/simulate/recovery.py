"""Experiment `recovery`: one failure schedule replayed under every way of surviving it.

Reads beside the CheckFree paper (docs/algorithms.md, "What the authors report"): stages fail with a
per-iteration probability taken from a per-hour rate; each failure removes every replica of one
stage (at most one per iteration): a middle stage (2..S-1, the ones every strategy can rebuild), or
with `failing = blocks` any block stage 1..S, where plain CheckFree has no rebuild (one block
neighbour) and CheckFree+ copies the stage that played that role on odd microbatches; a variant
that cannot rebuild a failure of the schedule is not run and the summary says why. Variants:

- checkfree, checkfree+ (recovery.checkfree_plus: swapped edge stages on odd microbatches), copy,
  random, zero: node/recovery/checkfree.py's plan_rebuild + execute_rebuild with the project's
  rebuild inputs (a neighbour replica's weights and its last gradient norm, known_grad_norm), a
  fresh optimizer and recovered_lr_scale; every replica of the stage gets the rebuilt weights (the
  first rebuilt peer serves the others, as node/recovery/rebuild.py does). Charged: detection
  (recovery.lost_grace) + the sources' weights over the link + one more download for the replicas.
- checkpoint every K iterations: every stage saves its weights (charged: the stage's bytes over the
  link to storage + a fixed save overhead, all stages in parallel); on a failure every stage of
  every replica reloads its last save through plan_rebuild(CHECKPOINT) (the paper's baseline rolls
  the whole model back: a consistent model needs all stages from one iteration), so the iterations
  since the save are lost; charged: detection + restart overhead + one download.
- redundant (Bamboo-style): each peer also runs the forward of the next stage (extra compute on
  every block task, charged in the timeline) and holds its weights (2x parameter memory, reported);
  a failure is taken over with the exact weights and optimizer state: detection + one download to
  restore the redundancy.
- no failures.

Curves: held-out loss vs executed iterations and vs simulated seconds; time to a target loss
(default: the failure-free run's best loss by TARGET_FRACTION of its iterations).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from node.config import RecoveryStrategy
from node.model.llama import build_stage
from node.recovery.checkfree import (
    execute_rebuild,
    known_grad_norm,
    plan_rebuild,
    recovered_lr_scale,
    unrecoverable,
)
from node.simulate.failures import Failure, draw_failures, per_iteration_probability
from node.simulate.names import FailingStages
from node.simulate.output import have_matplotlib, plot_lines, series_of, write_csv, write_json
from node.simulate.settings import SimSettings
from node.simulate.swarm import SimulatedSwarm, SyncMode, estimate_iteration_seconds
from node.simulate.timeline import FORWARD_SHARE

# the target loss: the failure-free run's best held-out loss by this fraction of its iterations, so
# that the other variants can reach it within the run (their final loss is usually above the
# failure-free final loss, which would leave "time to target" empty)
TARGET_FRACTION = 0.75


class RecoveryVariant(StrEnum):
    NO_FAILURES = "no_failures"
    CHECKFREE = "checkfree"
    CHECKFREE_PLUS = "checkfree_plus"
    COPY = "copy"
    RANDOM = "random"
    ZERO = "zero"
    CHECKPOINT = "checkpoint"
    REDUNDANT = "redundant"


# the rebuild strategy each neighbour/fresh variant hands to plan_rebuild
REBUILD_STRATEGY = {
    RecoveryVariant.CHECKFREE: RecoveryStrategy.CHECKFREE,
    RecoveryVariant.CHECKFREE_PLUS: RecoveryStrategy.CHECKFREE,
    RecoveryVariant.COPY: RecoveryStrategy.COPY,
    RecoveryVariant.RANDOM: RecoveryStrategy.RANDOM,
    RecoveryVariant.ZERO: RecoveryStrategy.ZERO,
}


@dataclass(frozen=True)
class RecoverySettings:
    failure_percent_per_hour: float = 10.0  # per stage; turned into a per-iteration probability
    failures_from: int = 100  # iteration of the first possible failure (the model learns first)
    checkpoint_every: int = 25  # K, iterations between two saves
    checkpoint_save_s: float = 5.0  # fixed cost of one save (serialise, open the store) besides the bytes
    restart_s: float = 60.0  # relaunching every peer after a rollback (the bytes are charged apart)
    variants: tuple[RecoveryVariant, ...] = tuple(RecoveryVariant)
    failing: FailingStages = FailingStages.MIDDLE
    target_loss: float | None = None  # None: the failure-free run's best loss by TARGET_FRACTION of the run


@dataclass
class VariantRun:
    rows: list[dict[str, Any]] = field(default_factory=list)
    failures: int = 0
    lost_iterations: int = 0  # checkpoint rollbacks: iterations whose work was thrown away
    charged_recovery_s: float = 0.0
    charged_checkpoint_s: float = 0.0
    last_save: int = 0  # iteration of the last checkpoint


def run_recovery(
    sim: SimSettings, settings: RecoverySettings, out: Path, advance: Callable[[str], None]
) -> dict[str, Any]:
    """Run every variant on one failure schedule; writes recovery.csv, recovery.json and plots."""
    config = sim.config()
    probe = SimulatedSwarm(
        config, sim.replicas, sim.link, sim.compute_seconds, SyncMode.NOLOCO, sim.seed, device=sim.device
    )
    costs = probe.costs
    probe.close()
    base_seconds = estimate_iteration_seconds(sim.stages, sim.replicas, sim.microbatches_per_step, costs, sim.link)
    probability = per_iteration_probability(settings.failure_percent_per_hour, base_seconds)
    middle = tuple(range(2, sim.stages - 1))
    if not middle:
        raise ValueError("the recovery experiment needs a middle stage: --stages 4 or more (stage 0 + 3 blocks)")
    failing = middle if settings.failing == FailingStages.MIDDLE else tuple(range(1, sim.stages))
    schedule = draw_failures(sim.seed, sim.steps, probability, failing, start=settings.failures_from)
    runs: dict[RecoveryVariant, VariantRun] = {}
    skipped: dict[str, str] = {}
    for variant in settings.variants:
        why = cannot_rebuild(variant, schedule, sim.stages)
        if why is not None:
            skipped[variant.value] = why
            for _ in range(sim.steps):
                advance(f"recovery {variant.value} (skipped)")
            continue
        runs[variant] = run_variant(sim, settings, variant, schedule, costs.compute_seconds, advance)
    rows = [row for run in runs.values() for row in run.rows]
    target = settings.target_loss
    if target is None and RecoveryVariant.NO_FAILURES in runs:
        by = TARGET_FRACTION * sim.steps + 1
        target = min(row["eval_loss"] for row in runs[RecoveryVariant.NO_FAILURES].rows if row["iteration"] <= by)
    summary = {
        "experiment": "recovery",
        "settings": {**dataclasses.asdict(sim), **dataclasses.asdict(settings)},
        "link": sim.link.describe(),
        "compute_seconds_per_microbatch_stage": costs.compute_seconds,
        "failure_free_iteration_seconds": base_seconds,
        "failure_probability_per_iteration": probability,
        "schedule": [(f.iteration, f.stage) for f in schedule],
        "target_loss": target,
        "variants": {variant.value: summarise(run, target) for variant, run in runs.items()},
        "skipped": skipped,
    }
    write_csv(out / "recovery.csv", rows)
    write_json(out / "recovery.json", summary)
    summary["plots"] = plot_recovery(out, rows)
    return summary


def cannot_rebuild(variant: RecoveryVariant, schedule: list[Failure], num_stages: int) -> str | None:
    """Why `variant` cannot survive `schedule` (None: it can): the project's own plan for the first
    failure it has no rebuild for."""
    strategy = REBUILD_STRATEGY.get(variant)
    if strategy is None:  # checkpoint, redundant, no failures: every stage is covered
        return None
    for failure in schedule:
        reason = unrecoverable({failure.stage}, num_stages, strategy, variant == RecoveryVariant.CHECKFREE_PLUS)
        if reason is not None:
            return f"stage {failure.stage} fails at iteration {failure.iteration}: {reason}"
    return None


def summarise(run: VariantRun, target: float | None) -> dict[str, Any]:
    last = run.rows[-1]
    reached = next((row for row in run.rows if target is not None and row["eval_loss"] <= target), None)
    return {
        "final_loss": last["eval_loss"],
        "sim_seconds": last["sim_seconds"],
        "failures": run.failures,
        "lost_iterations": run.lost_iterations,
        "charged_recovery_s": run.charged_recovery_s,
        "charged_checkpoint_s": run.charged_checkpoint_s,
        "seconds_to_target": None if reached is None else reached["sim_seconds"],
        "iterations_to_target": None if reached is None else reached["iteration"],
    }


def plot_recovery(out: Path, rows: list[dict[str, Any]]) -> list[str]:
    if not have_matplotlib():
        return []
    made = []
    for x, label in (("iteration", "iterations executed"), ("sim_seconds", "simulated seconds")):
        path = plot_lines(
            out / f"recovery_loss_vs_{x}.png",
            series_of(rows, "variant", x, "eval_loss"),
            label,
            "held-out loss (nats)",
            f"recovery: loss vs {label}",
        )
        made.append(path.name)
    return made


def run_variant(
    sim: SimSettings,
    settings: RecoverySettings,
    variant: RecoveryVariant,
    schedule: list[Failure],
    compute_seconds: float,
    advance: Callable[[str], None],
) -> VariantRun:
    plus = variant == RecoveryVariant.CHECKFREE_PLUS
    config = sim.config(**{"recovery.checkfree_plus": plus})
    extra = FORWARD_SHARE if variant == RecoveryVariant.REDUNDANT else 0.0
    swarm = SimulatedSwarm(
        config, sim.replicas, sim.link, compute_seconds, SyncMode.NOLOCO, sim.seed, extra, device=sim.device
    )
    failures = {} if variant == RecoveryVariant.NO_FAILURES else {f.iteration: f.stage for f in schedule}
    run = VariantRun()
    held_out = swarm.held_out(sim.eval_batches)
    saved: list[list[dict]] = []
    saved_steps: list[list[int]] = []
    try:
        for iteration in range(sim.steps):
            lost = failures.get(iteration)
            if lost is not None:
                run.failures += 1
                if variant == RecoveryVariant.CHECKPOINT:
                    run.lost_iterations += iteration - run.last_save
                    run.charged_recovery_s += roll_back(swarm, settings, saved, saved_steps)
                elif variant == RecoveryVariant.REDUNDANT:
                    run.charged_recovery_s += take_over(swarm)
                else:
                    run.charged_recovery_s += rebuild(swarm, lost, REBUILD_STRATEGY[variant], sim.seed + run.failures)
            if variant == RecoveryVariant.CHECKPOINT and iteration % settings.checkpoint_every == 0:
                saved = [[w.state_dict() for w in row] for row in swarm.workers]
                saved_steps = [[w.inner_step for w in row] for row in swarm.workers]
                run.last_save = iteration
                run.charged_checkpoint_s += save_checkpoint(swarm, settings)
            result = swarm.train_iteration()
            swarm.synchronise()
            if iteration % sim.eval_every == 0 or iteration == sim.steps - 1 or lost is not None:
                run.rows.append(
                    {
                        "variant": variant.value,
                        "iteration": iteration + 1,
                        "sim_seconds": round(swarm.clock.now(), 3),
                        "train_loss": result.loss,
                        "eval_loss": swarm.eval_loss(held_out),
                    }
                )
            advance(f"recovery {variant.value}")
        return run
    finally:
        swarm.close()


def rebuild(swarm: SimulatedSwarm, lost: int, strategy: RecoveryStrategy, init_seed: int) -> float:
    """Every replica of `lost` rebuilt by the project's plan; returns the seconds charged."""
    config = swarm.config
    plan = plan_rebuild(lost, swarm.num_stages, strategy, config.recovery.checkfree_plus)
    fetched = {}
    for source in plan.sources:  # one live peer of each source stage serves the rebuilding peer
        donor = swarm.workers[source][swarm.rng.randrange(swarm.replicas)]
        fetched[source] = (donor.state_dict(), known_grad_norm(donor.last_grad_norm))
    state = execute_rebuild(plan, fetched, lambda: build_stage(config.model, lost, 1000 + init_seed).state_dict(), None)
    scale = recovered_lr_scale(config.recovery.lr_scale, plan)
    for replica in range(swarm.replicas):
        worker = swarm.workers[lost][replica]
        worker.adopt(state, worker.inner_step, None, scale)  # a new peer has not stepped yet
        swarm.outer[lost][replica].restart_from_weights()
    nbytes = swarm.stage_bytes[lost]
    seconds = config.recovery.lost_grace
    if plan.sources:
        seconds += swarm.link.transfer_seconds(nbytes)  # the sources serve in parallel
    if swarm.replicas > 1:
        seconds += swarm.link.transfer_seconds(nbytes)  # the other replicas download from the first
    swarm.clock.advance(seconds)
    return seconds


def save_checkpoint(swarm: SimulatedSwarm, settings: RecoverySettings) -> float:
    seconds = settings.checkpoint_save_s + swarm.link.transfer_seconds(max(swarm.stage_bytes))
    swarm.clock.advance(seconds)
    return seconds


def roll_back(
    swarm: SimulatedSwarm, settings: RecoverySettings, saved: list[list[dict]], saved_steps: list[list[int]]
) -> float:
    """Every stage of every replica reloads its last save (plan_rebuild CHECKPOINT); the charge."""
    for stage, row in enumerate(swarm.workers):
        plan = plan_rebuild(stage, swarm.num_stages, RecoveryStrategy.CHECKPOINT, False)
        for replica, worker in enumerate(row):
            state = execute_rebuild(plan, {}, None, copy.deepcopy(saved[stage][replica]))
            worker.adopt(state, saved_steps[stage][replica], None, worker.lr_scale)
            swarm.outer[stage][replica].restart_from_weights()
            swarm.last_round_step[stage][replica] = worker.inner_step
    seconds = (
        swarm.config.recovery.lost_grace + settings.restart_s + swarm.link.transfer_seconds(max(swarm.stage_bytes))
    )
    swarm.clock.advance(seconds)
    return seconds


def take_over(swarm: SimulatedSwarm) -> float:
    """Bamboo: the predecessor already holds the stage's exact weights; only the redundancy is re-made."""
    seconds = swarm.config.recovery.lost_grace + swarm.link.transfer_seconds(max(swarm.stage_bytes))
    swarm.clock.advance(seconds)
    return seconds

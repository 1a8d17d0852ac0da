"""Rebuilding a lost stage into this peer's worker: fetch, compute, load, announce.

Reads beside docs/recovery.md ("Rebuilding lost stages", "How") and docs/algorithms.md ("Rebuild
plans"). The rules themselves (which neighbours, which formula) are the pure functions of
node/recovery/checkfree.py, and deciding that a stage is lost is node/recovery/lost_stages.py; this
module is the networked half. A peer that serves a stage nobody else holds, in a swarm that has
trained, cannot download the stage (there is no donor): `rebuild_stage` fetches what `plan_rebuild`
names from live peers of the source stages (part "stage" for weights + last gradient norm,
"edge_copy" for stage 0), applies `execute_rebuild` on the worker's compute thread, loads the result
with a fresh inner optimizer and lr x lr_scale, and `rebuild_into_service` says so in a "rebuild"
event.

Debugging aid: with the environment variable PIPESWARM_DEBUG_DIR set, a rebuild also writes what it
fetched and what it loaded as plain tensors (`torch.save`, loadable with weights_only=True), so a
test can recompute the formula on the exact inputs. Off unless the variable is set.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from dht.records import EventKind, PeerRecord, PeerState, SwarmEvent
from dht.registry import SwarmRegistry
from dht.swarm_view import SwarmView
from node.config import SwarmConfig
from node.model.llama import build_stage
from node.p2p.transport import Transport, TransportError
from node.recovery.checkfree import (
    RebuildAction,
    RebuildPlan,
    SourceFetch,
    execute_rebuild,
    known_grad_norm,
    plan_rebuild,
    recovered_lr_scale,
)
from node.recovery.checkpoints import checkpoint_root, load_latest
from node.recovery.lost_stages import live_peers
from node.recovery.state_transfer import StageParts, download_from_any
from node.runtime.events import EventPublisher
from node.runtime.meter import Tally
from node.runtime.tasks import BackgroundTasks
from node.stage.access import weight_views
from node.stage.stage_worker import StageWorker
from protocol.stage_state import StageState, StatePart

logger = logging.getLogger(__name__)

__all__ = [
    "DEBUG_DIR_ENV",
    "RebuildFailed",
    "RebuildImpossible",
    "RebuildResult",
    "rebuild_detail",
    "rebuild_into_service",
    "rebuild_stage",
    "refresh_until_seen",
]

DEBUG_DIR_ENV = "PIPESWARM_DEBUG_DIR"
FETCH_ATTEMPTS = 3  # donors tried per source stage, each time the rebuild is attempted
# the state-transfer part that serves what a plan fetches (docs/recovery.md, "State transfer")
FETCH_PART = {SourceFetch.WEIGHTS: StatePart.WEIGHTS, SourceFetch.EDGE_COPY: StatePart.EDGE_COPY}


class RebuildFailed(RuntimeError):
    """The lost stage could not be rebuilt now (no live source, downloads failed): worth another try."""


class RebuildImpossible(RebuildFailed):
    """The lost stage can never be rebuilt by this peer: the strategy has no plan for it, or (strategy
    checkpoint) this machine holds no save of it. Trying again changes nothing."""


@dataclass
class FetchedSource:
    """What one peer of a source stage served for the rebuild."""

    stage: int
    peer_id: str
    state: StageState


@dataclass
class RebuildResult:
    plan: RebuildPlan
    sources: dict[int, FetchedSource]
    inner_step: int
    lr_scale: float
    detail: str
    seconds: float


LoadCheckpoint = Callable[[Path, int], "tuple[dict[str, Tensor], int] | None"]


def rebuild_detail(plan: RebuildPlan, sources: Mapping[int, FetchedSource]) -> str:
    """The event text, e.g. "stage 2 by checkfree from stages 1 (|g|=0.41) and 3 (|g|=0.37)"."""

    def norm(stage: int) -> str:
        g = sources[stage].state.grad_norm
        return f"{stage} (|g|={'?' if g is None else f'{g:.3g}'})"

    head = f"stage {plan.lost_stage} by {plan.strategy}"
    if plan.action == RebuildAction.AVERAGE:
        return f"{head} from stages {norm(plan.sources[0])} and {norm(plan.sources[1])}"
    if plan.action == RebuildAction.COPY:
        return f"{head} (copy) from stage {norm(plan.sources[0])}"
    if plan.action == RebuildAction.EDGE_COPIES:
        parts = " and ".join(f"{s} (stage-0 step {sources[s].state.inner_step})" for s in plan.sources)
        return f"{head} from the edge copies of stages {parts}"
    if plan.action == RebuildAction.CHECKPOINT:
        return f"{head}: rolled back to the last save"
    if plan.action == RebuildAction.ZERO:
        return f"{head}: every parameter zero (the stage passes its input through)"
    return f"{head}: fresh weights from a new seed"


async def fetch_sources(
    plan: RebuildPlan,
    transport: Transport,
    peers_by_stage: Mapping[int, Sequence[PeerRecord]],
    expect: Mapping[str, Sequence[int]],
    rng: random.Random,
) -> dict[int, FetchedSource]:
    """Download what the plan names from one live peer of each source stage (up to FETCH_ATTEMPTS
    donors per stage; the donor that answered is remembered for the event and the debug dump)."""
    part = FETCH_PART[plan.fetch]
    # block stages share one layout, so the neighbours' weights must match ours exactly; edge
    # copies hold a subset of stage 0's entries (execute_rebuild checks the merged result)
    shape_check = expect if part == StatePart.WEIGHTS else None
    sources: dict[int, FetchedSource] = {}
    for stage in plan.sources:
        try:
            state = await download_from_any(
                transport, peers_by_stage.get(stage, ()), stage, part, rng, attempts=FETCH_ATTEMPTS, expect=shape_check
            )
        except TransportError as e:
            raise RebuildFailed(f"stage {plan.lost_stage} is rebuilt from stage {stage}'s {part}: {e}") from e
        sources[stage] = FetchedSource(stage, state.donor, state)
    return sources


async def rebuild_stage(
    *,
    config: SwarmConfig,
    stage: int,
    worker: StageWorker,
    transport: Transport,
    peers_by_stage: Mapping[int, Sequence[PeerRecord]],
    rng: random.Random,
    load_checkpoint: LoadCheckpoint | None = None,
) -> RebuildResult:
    """Rebuild `stage` into `worker` by the swarm's strategy (one code path for all of them).

    Fetch the plan's sources over the network (or read the local checkpoint), compute the new
    weights and load them on the worker's compute thread with a fresh inner optimizer, lr x
    lr_scale when the plan says so, and the schedule position of the sources (the lr schedule
    continues where the swarm is). Raises RebuildFailed when it cannot be done now.
    """
    started = time.monotonic()
    recovery = config.recovery
    plan = plan_rebuild(stage, config.num_stages, recovery.strategy, recovery.checkfree_plus)
    if not plan.recoverable:
        raise RebuildImpossible(f"stage {stage} cannot be rebuilt: {plan.reason}")
    # the live module's own tensors, on its device: the template the result must match (zero: the entries to zero)
    template = await worker.compute(weight_views, worker)
    expect = {name: tuple(t.shape) for name, t in template.items()}

    sources: dict[int, FetchedSource] = {}
    checkpoint: StageState | None = None
    if plan.fetch != SourceFetch.NONE:
        sources = await fetch_sources(plan, transport, peers_by_stage, expect, rng)
    if plan.action == RebuildAction.CHECKPOINT:
        root = checkpoint_root(recovery.checkpoint_dir, config.swarm_id)
        saved = await worker.compute(load_checkpoint or load_latest, root, stage)
        if saved is None:
            raise RebuildImpossible(f"strategy checkpoint: no readable save of stage {stage} under {root}")
        weights, step = saved
        checkpoint = StageState(stage=stage, weights=weights, inner_step=step)

    if checkpoint is not None:
        inner_step = checkpoint.inner_step
    elif sources:
        inner_step = max(source.state.inner_step for source in sources.values())
    else:  # a fresh or zeroed stage keeps the swarm's place in the lr schedule
        inner_step = max((p.inner_step for peers in peers_by_stage.values() for p in live_peers(peers)), default=0)
    lr_scale = recovered_lr_scale(recovery.lr_scale, plan)
    new_seed = rng.randrange(1 << 31)

    def fresh_state() -> dict[str, Tensor]:
        if plan.action == RebuildAction.FRESH:  # strategy random: a seed that does not reproduce the original init
            # built on the host like every stage (a CPU generator: the same init on any device), then moved
            return worker.transfers.state_to_device(build_stage(config.model, stage, new_seed).state_dict())
        return template

    def apply() -> dict[str, Tensor]:
        # the sources arrived on the host: the rebuild (average, copy) is computed on this stage's device.
        # A source that has not stepped since it joined weighs as 1.0, the authors' start value
        to_device = worker.transfers.state_to_device
        fetched = {
            s: (to_device(src.state.weights), known_grad_norm(src.state.grad_norm)) for s, src in sources.items()
        }
        saved = None if checkpoint is None else to_device(checkpoint.weights)
        weights = execute_rebuild(plan, fetched, fresh_state, saved)
        worker.adopt(weights, inner_step, None, lr_scale)
        return worker.state_dict()

    loaded = await worker.compute(apply)
    result = RebuildResult(
        plan, sources, inner_step, lr_scale, rebuild_detail(plan, sources), time.monotonic() - started
    )
    debug_dir = os.environ.get(DEBUG_DIR_ENV)
    if debug_dir:
        await worker.compute(dump_rebuild, Path(debug_dir), result, loaded, checkpoint)
    return result


def dump_rebuild(
    directory: Path, result: RebuildResult, loaded: Mapping[str, Tensor], checkpoint: StageState | None
) -> Path:
    """Write the rebuild's inputs and the weights actually loaded, as plain tensors and numbers
    (no classes: the file opens with torch.load(weights_only=True))."""
    directory.mkdir(parents=True, exist_ok=True)
    plan = result.plan
    record = {
        "lost_stage": plan.lost_stage,
        # plain strings: torch.load(weights_only=True) refuses enum objects
        "strategy": plan.strategy.value,
        "action": plan.action.value,
        "sources": list(plan.sources),
        "lr_scale": result.lr_scale,
        "inner_step": result.inner_step,
        "time": time.time(),
        "fetched": {
            s: {
                "peer_id": src.peer_id,
                "weights": src.state.weights,
                "grad_norm": src.state.grad_norm,
                "inner_step": src.state.inner_step,
            }
            for s, src in result.sources.items()
        },
        "checkpoint": None
        if checkpoint is None
        else {"weights": checkpoint.weights, "inner_step": checkpoint.inner_step},
        "loaded": dict(loaded),
    }
    path = directory / f"rebuild-stage{plan.lost_stage}-{time.time_ns()}.pt"
    torch.save(record, path)
    return path


async def rebuild_into_service(service: StageParts, registry: SwarmRegistry) -> RebuildResult:
    """The rebuild step of a stage service whose stage nobody else holds: state `rebuilding` while
    it runs (the pipeline refuses traffic until `online`), then a "rebuild" event for the dashboard.
    Raises RebuildFailed (node/recovery/stage_entry.py tries again on a fresh picture) or
    RebuildImpossible."""
    me, config = service.me, service.config
    me.set_state(PeerState.REBUILDING)
    result = await rebuild_stage(
        config=config,
        stage=me.stage,
        worker=service.worker,
        transport=service.transport,
        peers_by_stage=service.view.peers_by_stage,
        rng=random.Random(),
    )
    gossip = service.gossip
    if gossip is not None:  # NoLoCo's outer weights restart from the rebuilt ones, momentum zero
        await gossip.reset_outer()
        # the round count continues from the sources', so later partners see a plausible round
        gossip.outer_state.round = max(
            (src.state.outer_round for src in result.sources.values()), default=gossip.outer_state.round
        )
    logger.info(
        f"rebuilt {result.detail} in {result.seconds:.2f} s; inner step {result.inner_step}, lr x {result.lr_scale:g}"
    )
    service.transport.meter.count(Tally.REBUILDS)
    _first_microbatch_watchers.spawn(log_first_microbatch(service.worker, me.stage), name="first-microbatch")
    # awaited, not in the background: the event is out before this peer goes online
    event = SwarmEvent(
        time=time.time(), kind=EventKind.REBUILD, peer_id=me.peer_id, stage=me.stage, detail=result.detail
    )
    await EventPublisher(registry, me.peer_id).publish_now(event)
    return result


# fire and forget: each watcher ends by itself (first microbatch seen, or give_up seconds)
_first_microbatch_watchers = BackgroundTasks()


async def log_first_microbatch(worker: StageWorker, stage: int, poll: float = 0.05, give_up: float = 300.0) -> None:
    """Log the wall-clock time the first microbatch finishes its backward on the rebuilt stage:
    the end of "recovery time" (tests/benchmarks/bench_recovery.py reads this line)."""
    done_at_rebuild = worker.microbatches_done
    started = time.monotonic()
    while time.monotonic() - started < give_up:
        if worker.microbatches_done > done_at_rebuild:
            logger.info(
                f"RECOVERED stage {stage}: first microbatch through the rebuilt stage at {time.time():.3f} "
                f"({time.monotonic() - started:.2f} s after the rebuild)"
            )
            return
        await asyncio.sleep(poll)


async def refresh_until_seen(view: SwarmView, me: str, timeout: float = 8.0, interval: float = 0.5) -> None:
    """Refresh `view` until it shows any peer record at all (this peer announced its own before the
    stage service started), for at most `timeout` seconds. A freshly started DHT node can read
    nothing for a few seconds; that blind picture would make a lost stage look like a brand-new
    swarm, and the stage would start from the seed instead of being rebuilt. (Only the very first
    peer of a new swarm waits the whole timeout: its own first write may not be readable yet.)"""
    deadline = time.monotonic() + timeout
    await view.refresh()
    while not any(view.peers_by_stage.values()) and view.record_of(me) is None:
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(interval)
        await view.refresh()

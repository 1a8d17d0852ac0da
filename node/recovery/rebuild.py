"""Lost stages: noticing them from the DHT, rebuilding one, and knowing when the swarm cannot be saved.

Reads beside Blagoev et al., "All is Not Lost: LLM Recovery without Checkpoints" (2025) and
docs/recovery.md ("Rebuilding lost stages"). The rules themselves (which neighbours, which
formula) are the pure functions of node/recovery/checkfree.py; this module is the networked half:

- Detection. A stage is *lost* when no peer of it is live (`online` or `rebuilding`) for longer
  than `recovery.lost_grace`, after the swarm has trained (some live peer has taken an optimizer
  step). Before any step a missing stage is merely *empty*: a fresh init from the swarm seed is as
  good as the weights that died. Every peer runs a `LostStageTracker` over its SwarmView, so all
  of them reach the same verdict from the same DHT records; the lowest live peer id (`reporter`)
  publishes it as a SwarmEvent so one-shot observers (`node status`, the dashboard) see it too.
- Rebuilding. A peer that serves a stage nobody else holds, in a swarm that has trained, cannot
  download the stage (there is no donor): `rebuild_stage` fetches what `plan_rebuild` names from
  live peers of the source stages (part "stage" for weights + last gradient norm, "edge_copy" for
  stage 0), applies `execute_rebuild` on the worker's compute thread, loads the result with a fresh
  inner optimizer and lr x lr_scale, and says so in a "rebuild" event.
- Unrecoverable. `checkfree.unrecoverable` over the currently lost stages; stage-0 peers stop
  driving microbatches while it holds (training garbage would be worse than waiting).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from dht.announcer import PeerAnnouncer
from dht.records import PeerRecord, PeerState, SwarmEvent
from dht.registry import SwarmRegistry
from node.recovery.checkpoints import checkpoint_root, load_latest
from node.recovery.checkfree import RebuildPlan, execute_rebuild, plan_rebuild, recovered_lr_scale, unrecoverable
from node.config import SwarmConfig
from node.model.llama import build_stage
from node.recovery.state_transfer import StageState, download_from_any
from node.pipeline.stage_worker import StageWorker
from node.p2p.transport import Transport, TransportError

logger = logging.getLogger(__name__)

__all__ = [
    "LIVE_STATES",
    "DEBUG_DIR_ENV",
    "RebuildFailed",
    "live_peers",
    "swarm_has_trained",
    "must_rebuild",
    "LostStageTracker",
    "LossWatch",
    "RebuildResult",
    "rebuild_stage",
    "rebuild_detail",
    "lost_stages_from_events",
]

LIVE_STATES = (PeerState.ONLINE, PeerState.REBUILDING)
DEBUG_DIR_ENV = "PIPESWARM_DEBUG_DIR"
LOST_EVENT_REFRESH = 100.0  # re-announce a stage still lost before its event (TTL 300 s) expires
FETCH_ATTEMPTS = 3  # donors tried per source stage, each time the rebuild is attempted


class RebuildFailed(RuntimeError):
    """The lost stage could not be rebuilt now (unrecoverable plan, no live source, downloads failed)."""


def live_peers(peers: Sequence[PeerRecord], exclude: str | None = None) -> list[PeerRecord]:
    """Peers that hold the stage's weights now: `online`, or `rebuilding` them."""
    return [peer for peer in peers if peer.state in LIVE_STATES and peer.peer_id != exclude]


def swarm_has_trained(peers_by_stage: Mapping[int, Sequence[PeerRecord]], exclude: str | None = None) -> bool:
    """Whether some live peer has taken an optimizer step: from then on weights are worth keeping."""
    return any(peer.inner_step > 0 for peers in peers_by_stage.values() for peer in live_peers(peers, exclude))


def must_rebuild(peers_by_stage: Mapping[int, Sequence[PeerRecord]], stage: int, me: str) -> bool:
    """Whether a peer taking `stage` has to rebuild it: nobody else is online there to download the
    stage from, and the swarm has trained (an untrained swarm's empty stage starts from the seed)."""
    donors = [peer for peer in peers_by_stage.get(stage, ()) if peer.state == PeerState.ONLINE and peer.peer_id != me]
    if donors:
        return False
    trained = swarm_has_trained(peers_by_stage, exclude=me)
    seen = {s: [(p.state, p.inner_step) for p in peers] for s, peers in peers_by_stage.items()}
    logger.info(f"stage {stage} has no online peer to download from; the swarm has "
                f"{'trained: rebuilding it' if trained else 'not trained: starting from the seed'} (seen: {seen})")
    return trained


# ------------------------------------------------------------------------------------------------
# Detection


@dataclass
class LostStageTracker:
    """Since when each stage has had no live peer (in a trained swarm); pure bookkeeping.

    Feed it every fresh DHT picture with `observe`; `lost_stages(now)` are those empty for longer
    than `lost_grace`. Peers' records vanish TTL after their last heartbeat, so a stage is declared
    lost about TTL + lost_grace after its last peer died.
    """

    num_stages: int
    lost_grace: float
    empty_since: dict[int, float] = field(default_factory=dict)

    def observe(self, peers_by_stage: Mapping[int, Sequence[PeerRecord]], now: float) -> None:
        trained = swarm_has_trained(peers_by_stage)
        for stage in range(self.num_stages):
            if live_peers(peers_by_stage.get(stage, ())):
                self.empty_since.pop(stage, None)
            elif trained:
                self.empty_since.setdefault(stage, now)

    def lost_for(self, stage: int, now: float) -> float:
        """Seconds stage has been lost (0.0 if it is not lost)."""
        since = self.empty_since.get(stage)
        if since is None or now - since < self.lost_grace:
            return 0.0
        return now - since - self.lost_grace

    def lost_stages(self, now: float) -> set[int]:
        return {stage for stage, since in self.empty_since.items() if now - since >= self.lost_grace}


def reporter(peers_by_stage: Mapping[int, Sequence[PeerRecord]]) -> str | None:
    """The one live peer that publishes swarm-wide verdicts (lowest peer id): one event, not N."""
    ids = [peer.peer_id for peers in peers_by_stage.values() for peer in live_peers(peers)]
    return min(ids) if ids else None


class LossWatch:
    """One peer's running verdict on lost stages, updated on every SwarmView refresh.

    `lost` and `unrecoverable_reason` are read by the stage-0 driver (pause) and the rebalancer;
    transitions are logged here, and published as events when this peer is the reporter.
    """

    def __init__(self, config: SwarmConfig, registry: SwarmRegistry, me: PeerAnnouncer,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.registry = registry
        self.me = me
        self.clock = clock
        self.tracker = LostStageTracker(config.num_stages, config.recovery.lost_grace)
        self.lost: set[int] = set()
        self.unrecoverable_reason: str | None = None
        self._reported: dict[tuple[str, int | None], float] = {}  # (kind, stage) -> when last published
        self._publishing: set[asyncio.Task] = set()

    def lost_for(self, stage: int) -> float:
        return self.tracker.lost_for(stage, self.clock())

    def on_refresh(self, peers_by_stage: Mapping[int, Sequence[PeerRecord]]) -> None:
        """SwarmView listener (synchronous: it runs inside the view's refresh)."""
        now = self.clock()
        self.tracker.observe(peers_by_stage, now)
        lost = self.tracker.lost_stages(now)
        recovery = self.config.recovery
        reason = unrecoverable(lost, self.config.num_stages, recovery.strategy, recovery.checkfree_plus) if lost else None
        for stage in sorted(lost - self.lost):
            logger.warning(f"stage {stage} is lost: no live peer for over {recovery.lost_grace:.0f} s")
        for stage in sorted(self.lost - lost):
            logger.info(f"stage {stage} is served again")
            self._reported.pop(("lost", stage), None)
        if reason is not None and reason != self.unrecoverable_reason:
            logger.error(f"the swarm cannot recover from losing stages {sorted(lost)}: {reason}; "
                         f"stage 0 stops training until those stages are served again (e.g. from checkpoints)")
        if reason is None and self.unrecoverable_reason is not None:
            logger.info("the swarm is recoverable again")
            self._reported.pop(("unrecoverable", None), None)
        self.lost, self.unrecoverable_reason = lost, reason
        if reporter(peers_by_stage) == self.me.peer_id:
            for stage in sorted(lost):
                self._publish_due("lost", stage, f"stage {stage} has had no live peer for over "
                                                 f"{recovery.lost_grace:.0f} s", now)
            if reason is not None:
                self._publish_due("unrecoverable", None, reason, now)

    def _publish_due(self, kind: str, stage: int | None, detail: str, now: float) -> None:
        last = self._reported.get((kind, stage))
        if last is not None and now - last < LOST_EVENT_REFRESH:
            return
        self._reported[(kind, stage)] = now
        event = SwarmEvent(time=time.time(), kind=kind, peer_id=self.me.peer_id, stage=stage, detail=detail)
        task = asyncio.get_running_loop().create_task(self._publish(event))
        self._publishing.add(task)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, event: SwarmEvent) -> None:
        try:
            await self.registry.publish_event(event)
        except Exception as e:  # best effort: the next refresh period retries
            logger.warning(f"could not publish the {event.kind} event: {e!r}")
            self._reported.pop((event.kind, event.stage), None)

    def close(self) -> None:
        for task in self._publishing:
            task.cancel()


def lost_stages_from_events(
    peers_by_stage: Mapping[int, Sequence[PeerRecord]], events: Sequence[SwarmEvent], num_stages: int
) -> set[int]:
    """What a one-shot observer can tell: stages with no live peer whose latest lost/rebuild event
    says "lost" (the peers only publish it after lost_grace, so the grace is honoured)."""
    latest: dict[int, SwarmEvent] = {}
    for event in events:
        if event.kind in ("lost", "rebuild") and event.stage is not None:
            if event.stage not in latest or event.time >= latest[event.stage].time:
                latest[event.stage] = event
    return {
        stage for stage in range(num_stages)
        if not live_peers(peers_by_stage.get(stage, ())) and stage in latest and latest[stage].kind == "lost"
    }


# ------------------------------------------------------------------------------------------------
# Rebuilding


@dataclass
class SourceState:
    """What one peer of a source stage served for the rebuild."""

    stage: int
    peer_id: str
    state: StageState


@dataclass
class RebuildResult:
    plan: RebuildPlan
    sources: dict[int, SourceState]
    inner_step: int
    lr_scale: float
    detail: str
    seconds: float


LoadCheckpoint = Callable[[Path, int], "tuple[dict[str, Tensor], int] | None"]


def rebuild_detail(plan: RebuildPlan, sources: Mapping[int, SourceState]) -> str:
    """The event text, e.g. "stage 2 by checkfree from stages 1 (|g|=0.41) and 3 (|g|=0.37)"."""
    def norm(stage: int) -> str:
        g = sources[stage].state.grad_norm
        return f"{stage} (|g|={'?' if g is None else f'{g:.3g}'})"

    head = f"stage {plan.lost_stage} by {plan.strategy}"
    if plan.action == "average":
        return f"{head} from stages {norm(plan.sources[0])} and {norm(plan.sources[1])}"
    if plan.action == "copy":
        return f"{head} (copy) from stage {norm(plan.sources[0])}"
    if plan.action == "edge_copies":
        parts = " and ".join(f"{s} (stage-0 step {sources[s].state.inner_step})" for s in plan.sources)
        return f"{head} from the edge copies of stages {parts}"
    if plan.action == "checkpoint":
        return f"{head}: rolled back to the last save"
    return f"{head}: fresh weights from a new seed"


async def fetch_sources(
    plan: RebuildPlan, transport: Transport, peers_by_stage: Mapping[int, Sequence[PeerRecord]],
    expect: Mapping[str, Sequence[int]], rng: random.Random,
) -> dict[int, SourceState]:
    """Download what the plan names from one live peer of each source stage (up to FETCH_ATTEMPTS
    donors per stage; the donor that answered is remembered for the event and the debug dump)."""
    part = {"weights": "stage", "edge_copy": "edge_copy"}[plan.fetch]
    # block stages share one layout, so the neighbours' weights must match ours exactly; edge
    # copies hold a subset of stage 0's entries (execute_rebuild checks the merged result)
    shape_check = expect if part == "stage" else None
    sources: dict[int, SourceState] = {}
    for stage in plan.sources:
        try:
            state = await download_from_any(transport, peers_by_stage.get(stage, ()), stage, part, rng,
                                            attempts=FETCH_ATTEMPTS, expect=shape_check)
        except TransportError as e:
            raise RebuildFailed(f"stage {plan.lost_stage} is rebuilt from stage {stage}'s {part}: {e}") from e
        sources[stage] = SourceState(stage, state.donor, state)
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
        raise RebuildFailed(f"stage {stage} cannot be rebuilt: {plan.reason}")
    loop = asyncio.get_running_loop()
    template = await loop.run_in_executor(worker.executor, worker.state_dict)
    expect = {name: tuple(t.shape) for name, t in template.items()}

    sources: dict[int, SourceState] = {}
    checkpoint: StageState | None = None
    if plan.fetch != "none":
        sources = await fetch_sources(plan, transport, peers_by_stage, expect, rng)
    if plan.action == "checkpoint":
        root = checkpoint_root(recovery.checkpoint_dir, config.swarm_id)
        saved = await loop.run_in_executor(worker.executor, load_checkpoint or load_latest, root, stage)
        if saved is None:
            raise RebuildFailed(f"strategy checkpoint: no readable save of stage {stage} under {os.path.abspath(root)}")
        weights, step = saved
        checkpoint = StageState(stage=stage, weights=weights, inner_step=step)

    if checkpoint is not None:
        inner_step = checkpoint.inner_step
    elif sources:
        inner_step = max(source.state.inner_step for source in sources.values())
    else:  # a fresh init keeps the swarm's place in the lr schedule
        inner_step = max((p.inner_step for peers in peers_by_stage.values() for p in live_peers(peers)), default=0)
    lr_scale = recovered_lr_scale(recovery.lr_scale, plan)
    new_seed = rng.randrange(1 << 31)

    def fresh_state() -> dict[str, Tensor]:
        if plan.action == "fresh":  # strategy random: a seed that does not reproduce the original init
            return build_stage(config, stage, init_seed=new_seed).state_dict()
        return template

    def apply() -> dict[str, Tensor]:
        fetched = {s: (src.state.weights, src.state.grad_norm or 0.0) for s, src in sources.items()}
        weights = execute_rebuild(plan, fetched, fresh_state, None if checkpoint is None else checkpoint.weights)
        worker.load_state_dict(weights, fresh_optimizer=True)
        worker.inner_step = inner_step
        worker.last_grad_norm = None
        worker.set_lr_scale(lr_scale)
        return worker.state_dict()

    loaded = await loop.run_in_executor(worker.executor, apply)
    result = RebuildResult(plan, sources, inner_step, lr_scale, rebuild_detail(plan, sources), time.monotonic() - started)
    debug_dir = os.environ.get(DEBUG_DIR_ENV)
    if debug_dir:
        await loop.run_in_executor(worker.executor, dump_rebuild, Path(debug_dir), result, loaded, checkpoint)
    return result


def dump_rebuild(directory: Path, result: RebuildResult, loaded: Mapping[str, Tensor], checkpoint: StageState | None) -> Path:
    """Write the rebuild's inputs and the weights actually loaded, as plain tensors and numbers
    (no classes: the file opens with torch.load(weights_only=True))."""
    directory.mkdir(parents=True, exist_ok=True)
    plan = result.plan
    record = {
        "lost_stage": plan.lost_stage,
        "strategy": str(plan.strategy),
        "action": plan.action,
        "sources": list(plan.sources),
        "lr_scale": result.lr_scale,
        "inner_step": result.inner_step,
        "time": time.time(),
        "fetched": {
            s: {"peer_id": src.peer_id, "weights": src.state.weights, "grad_norm": src.state.grad_norm,
                "inner_step": src.state.inner_step}
            for s, src in result.sources.items()
        },
        "checkpoint": None if checkpoint is None else {"weights": checkpoint.weights, "inner_step": checkpoint.inner_step},
        "loaded": dict(loaded),
    }
    path = directory / f"rebuild-stage{plan.lost_stage}-{time.time_ns()}.pt"
    torch.save(record, path)
    return path


async def rebuild_into_service(service, registry: SwarmRegistry, *, retry_every: float = 2.0,
                               attempts: int = 5) -> RebuildResult:
    """The rebuild step of a stage service whose stage nobody else holds: state `rebuilding` while
    it runs (the pipeline refuses traffic until `online`), a few attempts (a donor may die, a view
    may be stale), then a "rebuild" event for the dashboard. Raises RebuildFailed after the last."""
    me, config = service.me, service.config
    me.set_state(PeerState.REBUILDING)
    rng = random.Random()
    for attempt in range(1, attempts + 1):
        try:
            result = await rebuild_stage(
                config=config, stage=me.stage, worker=service.worker, transport=service.transport,
                peers_by_stage=service.view.peers_by_stage, rng=rng,
            )
            break
        except RebuildFailed as e:
            if attempt == attempts:
                raise
            logger.warning(f"rebuild of stage {me.stage} failed (attempt {attempt}/{attempts}): {e}")
            await asyncio.sleep(retry_every)
            await service.view.refresh()
    gossip = getattr(service, "gossip", None)
    if gossip is not None:  # NoLoCo's outer weights restart from the rebuilt ones, momentum zero
        await gossip.reset_outer()
        # the round count continues from the sources', so later partners see a plausible round
        gossip.outer_state.round = max((src.state.outer_round for src in result.sources.values()),
                                       default=gossip.outer_state.round)
    logger.info(f"rebuilt {result.detail} in {result.seconds:.2f} s; inner step {result.inner_step}, "
                f"lr x {result.lr_scale:g}")
    task = asyncio.get_running_loop().create_task(log_first_microbatch(service.worker, me.stage))
    _background.add(task)
    task.add_done_callback(_background.discard)
    event = SwarmEvent(time=time.time(), kind="rebuild", peer_id=me.peer_id, stage=me.stage, detail=result.detail)
    try:
        await registry.publish_event(event)
    except Exception as e:
        logger.warning(f"could not publish the rebuild event: {e!r}")
    return result


_background: set[asyncio.Task] = set()


async def log_first_microbatch(worker: StageWorker, stage: int, poll: float = 0.05, give_up: float = 300.0) -> None:
    """Log the wall-clock time the first microbatch finishes its backward on the rebuilt stage:
    the end of "recovery time" (tests/benchmarks/bench_recovery.py reads this line)."""
    done_at_rebuild = worker.microbatches_done
    started = time.monotonic()
    while time.monotonic() - started < give_up:
        if worker.microbatches_done > done_at_rebuild:
            logger.info(f"RECOVERED stage {stage}: first microbatch through the rebuilt stage at {time.time():.3f} "
                        f"({time.monotonic() - started:.2f} s after the rebuild)")
            return
        await asyncio.sleep(poll)


async def refresh_until_seen(view, me: str, timeout: float = 8.0, interval: float = 0.5) -> None:
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

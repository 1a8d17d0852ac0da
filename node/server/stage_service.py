"""Serving a stage: the pieces a joined peer runs, wired together with explicit state.

worker (compute + inner optimizer) <- pipeline (SWARM traffic) <- transport (libp2p streams)
router (load-aware choice) <- swarm view (DHT picture) ; the announcer publishes what they measure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import torch

from dht.announcer import PeerAnnouncer
from dht.records import PeerRecord, PeerState
from dht.registry import SwarmRegistry
from dht.swarm_view import SwarmView
from node.averaging.gossip import Gossip
from node.averaging.outer_replica import OuterReplica, RoundStatus
from node.config import SwarmConfig
from node.model.data import DataError, open_source, stream_id_from_peer
from node.model.memory import available_memory, format_bytes, memory_refusal
from node.p2p.dialer import keep_connected
from node.p2p.membership import Membership, serve_liveness
from node.p2p.network import Network
from node.p2p.rejoin import RejoinBook
from node.p2p.swarm_peers import ViewedPeers, swarm_transport
from node.p2p.transport import Transport
from node.p2p.traversal import serve_traversal
from node.pipeline.block_relay import BlockRelay
from node.pipeline.check_server import CheckServer
from node.pipeline.origin import Origin
from node.pipeline.receipts import ReceiptBook, ReceiptKeeper
from node.pipeline.routing import Router
from node.pipeline.traffic import Pipeline, PipelineParts
from node.pipeline.validation import Validator, open_validator
from node.pipeline.verifier import Verifier
from node.recovery.catch_up import run_catch_up
from node.recovery.checkpoints import checkpoint_root, run_checkpoints
from node.recovery.edge_copies import edge_copies_for, run_edge_copy_refresher
from node.recovery.lost_stages import LostStageWatch
from node.recovery.rebalance import Rebalancer, plan_move
from node.recovery.rebuild import RebuildImpossible, refresh_until_seen
from node.recovery.stage_entry import EntryGaveUp, enter_stage
from node.recovery.state_transfer import serve_state, state_provider
from node.runtime.byte_progress import ByteProgress
from node.runtime.events import EventPublisher
from node.runtime.meter import Meter
from node.server.daemon import JoinRefused
from node.server.data_fetch import stage0_data
from node.server.progress import ProgressDisplay
from node.server.reading import ServiceReading
from node.server.stage_fit import DeviceUnusable, measure_device, stage_fits
from node.stage.access import live_parameters
from node.stage.stage_worker import StageWorker
from protocol import MicrobatchPurpose

logger = logging.getLogger(__name__)


@dataclass
class ServiceOptions:
    device: str = "auto"
    data_path: str | None = None
    data_peers: tuple[str, ...] = ()  # asked first for the swarm's data by a stage-0 peer without it: the founder
    threads: int | None = None
    quiet: bool = False
    check_memory: bool = True  # refuse a stage whose estimated memory exceeds what the device has free
    # microbatches in flight this peer's memory allows (check_stage_fits); None: training.max_in_flight
    max_in_flight: int | None = None
    meter: Meter = field(default_factory=Meter)  # one per process: its totals outlive a move to another stage
    # told of each stage service as it starts (and None as it ends): `--metrics-port` reads it at scrape time
    on_service: Callable[[StageService | None], None] | None = None


def check_stage_fits(config: SwarmConfig, stage: int, device: str) -> int:
    """The most microbatches in flight `device`'s free memory allows a peer of `stage`, by
    node/model/memory.py's estimate in the precision the stage will compute in there; JoinRefused
    (exit code 3, one line) when not even training.min_in_flight fits."""
    try:
        memory = measure_device(device, available_memory)
    except DeviceUnusable as e:
        raise JoinRefused(str(e)) from None
    (fit,) = stage_fits(config, [stage], memory)
    if fit.in_flight is None:  # not even min_in_flight fits
        raise JoinRefused(memory_refusal(config.swarm_id, fit.estimate, memory))
    logger.info(
        f"stage {stage} needs about {format_bytes(fit.estimate.total)} ({fit.estimate.parameters:,} parameters, "
        f"{fit.in_flight} microbatches in flight); {memory.device} has {format_bytes(memory.free)} free"
    )
    return fit.in_flight


def pick_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


@dataclass
class StageService:
    """The running parts of a peer that serves one stage."""

    config: SwarmConfig
    me: PeerAnnouncer
    worker: StageWorker
    transport: Transport
    router: Router
    view: SwarmView
    peers: ViewedPeers  # the other peers, as the view and membership answer for them
    pipeline: Pipeline
    gossip: Gossip
    verifier: Verifier
    membership: Membership  # who may send us work: a record and an answer to our ping
    checks: CheckServer | None = None  # a block stage answering spot-checks of what it computed
    validator: Validator | None = None  # stage 0 with held-out data and validation on

    def read(self) -> ServiceReading:
        """What the worker, pipeline, gossip and swarm view measured, now (node/server/reading.py)."""
        worker, stats, gossip, training = self.worker, self.pipeline.stats, self.gossip, self.config.training
        validated = self.validator.latest if self.validator is not None else None
        outcomes = gossip.rounds.outcomes
        return ServiceReading(
            stage=self.me.stage,
            state=self.me.state,
            inner_step=worker.inner_step,
            microbatches_processed=worker.microbatches_done,
            tokens_processed=worker.microbatches_done * training.microbatch_size * training.sequence_length,
            throughput=worker.throughput,
            grad_norm=worker.last_grad_norm,
            stored_activations=worker.num_stored,
            activations_evicted=worker.evicted,
            peak_device_memory=worker.transfers.peak_allocated(),
            loss=stats.recent_loss,
            completion_rate=stats.rate(time.monotonic()),
            completed=stats.completed,
            retried=stats.retried,
            dropped=stats.dropped,
            forwarded=stats.forwarded,
            backwarded=stats.backwarded,
            rerouted=stats.rerouted,
            timeouts=stats.timeouts,
            busy_replies=stats.busy_replies,
            val_loss=validated.loss if validated is not None else None,
            val_step=validated.step if validated is not None else None,
            outer_round=gossip.outer_state.round,
            last_partner=gossip.last_partner,
            divergence=gossip.divergence,
            fingerprint=gossip.fingerprint,
            gossip_rounds={status: outcomes.get(status, 0) for status in RoundStatus},
            peers_seen=sum(len(peers) for peers in list(self.view.peers_by_stage.values())),
            bans=self.router.bans.total,
            banned_now=len(self.router.bans.active()),
            refused_streams=self.transport.conduct.refused,
        )

    def publish_progress(self) -> None:
        # the verifier's report is taken for the record alone: taking it prunes the bans it names
        self.me.report(self.read().announced(self.verifier.report()))


async def build_service(
    network: Network, config: SwarmConfig, me: PeerAnnouncer, options: ServiceOptions
) -> StageService:
    rng = random.Random()
    registry = SwarmRegistry(network.dht, config.swarm_id)
    view = SwarmView(registry, config.num_stages, period=max(0.5, config.heartbeat.period / 2))
    # the node's one ban store, the network's (a ban outlives a move to another stage): stream
    # admission, routing, gossip and the spot-checks all read and write it
    bans = network.bans
    router = Router(rng, config.num_stages, mode=config.training.routing, bans=bans)
    view.on_refresh(router.refresh)
    # every peer read here stays a way back into the DHT after its record expired (node/p2p/rejoin.py)
    view.on_refresh(lambda peers: remember_addresses(network.rejoin, peers))
    # the window's ceiling: this device's memory (check_stage_fits) and the swarm's config bound it, and
    # the store of activations with it: a block peer fed by several stage-0 peers evicts its oldest
    # microbatch (retried by its origin) rather than hold more than its device was checked for (docs/model.md)
    max_in_flight = options.max_in_flight or config.training.max_in_flight
    # built off the event loop: moving the module to a GPU (and the optimizer, the outer state) are CUDA calls
    worker = await asyncio.to_thread(
        StageWorker, config, me.stage, device=pick_device(options.device), max_stored=max_in_flight
    )
    # `auto` is resolved per peer (node/stage/precision.py): say what this peer computes in
    logger.info(f"stage {me.stage} computes in {worker.precision.precision} on {worker.device}")
    worker.meter = options.meter  # the process's meter: compute latencies survive a move to another stage

    transport, peers = swarm_transport(network, config, me, view, options.meter)
    membership = peers.membership
    checks, receipts = None, None
    if me.stage > 0:  # a block stage keeps receipts of what it computed and answers checks of them
        v = config.verification
        receipts = ReceiptKeeper(worker, ReceiptBook(v.max_receipts, v.receipt_seconds))
        checks = CheckServer(v, transport, receipts, membership)
    verifier = Verifier(
        config.verification,
        transport,
        worker,
        router.bans,
        EventPublisher(registry, me.peer_id),
        peer_id=me.peer_id,
        replicas=peers.reachable,
        hop_timeout=config.training.hop_timeout,
        served=(lambda: checks.served) if checks is not None else (lambda: 0),
        rng=rng,
    )
    parts = PipelineParts(transport, worker, router, me, peers, verifier)
    pipeline: Pipeline  # stage 0 is the origin of its microbatches, a block stage relays them
    if me.stage == 0:
        pipeline = Origin(config, parts, rng=rng, max_in_flight=max_in_flight)
    else:
        pipeline = BlockRelay(config.training, config.num_stages, parts, receipts=receipts, max_queue=max_in_flight)
    replica = await worker.compute(lambda: OuterReplica(live_parameters(worker), config.gossip))
    gossip = Gossip(
        config.gossip,
        config.seed,
        me,
        worker,
        transport,
        view=view,
        bans=router.bans,
        registry=registry,
        ban_until=peers.ban_until,
        rng=rng,
        replica=replica,
        membership=membership,
    )
    return StageService(
        config, me, worker, transport, router, view, peers, pipeline, gossip, verifier, membership, checks
    )


def remember_addresses(book: RejoinBook, peers_by_stage: dict[int, list[PeerRecord]]) -> None:
    now = time.monotonic()
    for records in peers_by_stage.values():
        for record in records:
            book.remember(record.peer_id, record.addrs, now)


def neighbours(service: StageService) -> list[str]:
    """Peers that send this one activations, gradients or gossip: its own stage and the stages next
    to it in either pipeline order (stage 0 talks to the first and the last block stage)."""
    stage, last = service.me.stage, service.config.num_stages - 1
    stages = {stage, (stage - 1) % (last + 1), (stage + 1) % (last + 1)}
    if stage in (1, last):
        stages |= {0, 1, last}  # CheckFree+ swaps the block order on odd microbatches
    if stage == 0:
        stages |= {1, last}
    return [peer_id for s in sorted(stages) for peer_id in service.peers.reachable(s)]


@contextlib.asynccontextmanager
async def running_service(
    network: Network, config: SwarmConfig, me: PeerAnnouncer, options: ServiceOptions
) -> AsyncIterator[StageService]:
    """A started stage service: handlers registered, swarm view running, this peer `online`."""
    service = await build_service(network, config, me, options)
    if options.on_service is not None:
        options.on_service(service)
    tasks = [asyncio.create_task(service.view.run(), name="swarm-view")]
    if service.transport.dialer is not None:  # a peer behind a NAT is reached over connections it made
        connections = keep_connected(service.transport.dialer, lambda: neighbours(service))
        tasks.append(asyncio.create_task(connections, name="connections"))
    if network.traversal is not None:  # direct links to peers behind NATs, and to us when we are one
        tasks.append(asyncio.create_task(serve_traversal(network.traversal, service.view, me), name="traversal"))
    try:
        await serve_liveness(service.transport)  # first: peers that saw our record are checking us now
        # announce a measured speed from the start: routers and stage choice compare these numbers
        await service.worker.executor.run(service.worker.measure_throughput)
        await service.pipeline.start()
        if service.checks is not None:
            await service.checks.start()
        await service.gossip.start()
        edge_copies = edge_copies_for(
            config.recovery, config.num_stages, me.stage
        )  # CheckFree+: stage 1 / stage S keep stage 0's edges
        await serve_state(service.transport, state_provider(service.worker, me, edge_copies, service.gossip))
        await refresh_until_seen(service.view, me.peer_id)  # a new DHT node may read nothing at first
        # live stage: download it (still `joining`); lost stage of a trained swarm: rebuild it from the
        # neighbours (`rebuilding`); both retried under churn (node/recovery/stage_entry.py). The join
        # panel starts later (serve_current_stage), so a byte bar may use the terminal now.
        with ByteProgress(bar=not options.quiet) as progress:
            try:
                entry = await enter_stage(service, SwarmRegistry(network.dht, config.swarm_id), progress)
            except (RebuildImpossible, EntryGaveUp) as e:  # e.g. the only block stage of a 2-stage swarm
                raise JoinRefused(f"cannot serve stage {me.stage}: {e}") from None
        logger.info(f"serving stage {me.stage} with weights from: {entry}")
        await service.gossip.refresh_fingerprint()
        service.publish_progress()
        me.set_state(PeerState.ONLINE)
        tasks.append(asyncio.create_task(publish_progress_loop(service), name="progress"))
        tasks.append(asyncio.create_task(service.gossip.run(), name="gossip"))
        tasks.append(asyncio.create_task(run_catch_up(service), name="catch-up"))
        tasks.append(asyncio.create_task(service.verifier.run_audits(), name="audits"))
        if edge_copies is not None:
            tasks.append(
                asyncio.create_task(
                    run_edge_copy_refresher(
                        edge_copies,
                        service.transport,
                        lambda: service.view.online(0),
                        config.recovery.edge_copy_interval,
                        me.period,
                        random.Random(),
                        service.worker,
                    ),
                    name="edge-copies",
                )
            )
        if config.recovery.strategy == "checkpoint":
            tasks.append(
                asyncio.create_task(
                    run_checkpoints(
                        service.worker,
                        checkpoint_root(config.recovery.checkpoint_dir, config.swarm_id),
                        config.recovery.checkpoint_every,
                        check_period=min(1.0, me.period),
                    ),
                    name="checkpoints",
                )
            )
        yield service
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await service.pipeline.close()
        await service.verifier.close()
        service.membership.liveness.close()
        await service.transport.close()  # this stage's handlers go: a move may serve another stage next
        service.worker.close()
        if options.on_service is not None:
            options.on_service(None)


async def serve_stage(
    network: Network,
    config: SwarmConfig,
    me: PeerAnnouncer,
    stop: asyncio.Event,
    options: ServiceOptions,
) -> None:
    """Run this peer's stage until `stop` is set. When the rebalancer moves this peer to a lost
    stage, the stage service is left and entered again for the new stage, in this process."""
    if options.threads:
        torch.set_num_threads(options.threads)
    while True:
        if options.check_memory:
            # off the loop: asking a GPU for its free memory starts its CUDA context (seconds)
            fits = await asyncio.to_thread(check_stage_fits, config, me.stage, pick_device(options.device))
            options = replace(options, max_in_flight=fits)
        target = await serve_current_stage(network, config, me, stop, options)
        if target is None:
            return
        await me.move_to(target)


async def serve_current_stage(
    network: Network,
    config: SwarmConfig,
    me: PeerAnnouncer,
    stop: asyncio.Event,
    options: ServiceOptions,
) -> int | None:
    """Serve `me.stage` until `stop` (returns None) or until this peer must move (the new stage)."""
    async with (
        running_service(network, config, me, options) as service,
        # stage 0: its --data, or the swarm's fetched now (node/server/data_fetch.py), served to others
        stage0_data(
            network,
            config.swarm_id,
            config.data,
            service.view,
            me,
            options.data_path,
            founders=options.data_peers,
            quiet=options.quiet,
            meter=options.meter,
        ) as data_path,
    ):
        watch = LostStageWatch(config.recovery, config.num_stages, SwarmRegistry(network.dht, config.swarm_id), me)
        service.view.on_refresh(watch.on_refresh)
        progress = ProgressDisplay(service.read, quiet=options.quiet)
        mover = asyncio.create_task(watch_for_move(service, watch), name="rebalance")
        tasks = [asyncio.create_task(progress.run(), name="display"), mover]
        if isinstance(origin := service.pipeline, Origin):  # stage 0's: it drives the microbatches
            try:
                source = await asyncio.to_thread(open_source, config, data_path, stream_id_from_peer(me.peer_id))
            except DataError as e:  # one line and exit code 3 (daemon.run), not a traceback
                raise JoinRefused(f"stage 0 cannot train on its data: {e}") from None
            ready = pipeline_ready(service, watch)
            tasks.append(asyncio.create_task(origin.drive(source, stop, ready), name="driver"))
            service.validator = await asyncio.to_thread(  # a synthetic source's setup is a linear solve
                open_validator,
                config,
                data_path,
                lambda tokens, targets: origin.run_microbatch(tokens, targets, MicrobatchPurpose.EVAL),
                lambda: service.worker.inner_step,
            )
            if service.validator is not None:
                tasks.append(asyncio.create_task(service.validator.run(stop, ready), name="validation"))
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([stopped, mover], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in [*tasks, stopped]:
                task.cancel()
            await asyncio.gather(*tasks, stopped, return_exceptions=True)
            watch.close()
            progress.close()
        if stop.is_set() or mover.cancelled() or mover.exception() is not None:
            return None
        return mover.result()


async def watch_for_move(service: StageService, watch: LostStageWatch) -> int:
    """The stage this peer should move to (node/recovery/rebalance.py), once confirmed twice."""
    config, me = service.config, service.me
    period = config.heartbeat.period
    rebalancer = Rebalancer(confirm_after=period)
    while True:
        await asyncio.sleep(period)
        if me.state != PeerState.ONLINE:
            continue
        lost_for = {stage: watch.lost_for(stage) for stage in watch.lost}
        move = plan_move(
            service.view.peers_by_stage,
            config.num_stages,
            lost_for,
            config.recovery.rebalance_wait,
            watch.unrecoverable_reason,
        )
        confirmed = rebalancer.check(move, time.monotonic())
        if confirmed is not None and confirmed.peer_id == me.peer_id and confirmed.donor == me.stage:
            logger.warning(
                f"stage {confirmed.target} has been lost for over {config.recovery.rebalance_wait:.0f} s "
                f"and nobody joined it: moving there from stage {me.stage}"
            )
            return confirmed.target


def pipeline_ready(service: StageService, watch: LostStageWatch) -> Callable[[], bool]:
    """Whether stage 0 may send microbatches now: every block stage has a peer to receive them, and
    the swarm is not unrecoverable (it would train the surviving stages on garbage)."""

    def every_stage_served() -> bool:
        return watch.unrecoverable_reason is None and all(
            service.view.online(stage) for stage in range(1, service.config.num_stages)
        )

    return every_stage_served


async def publish_progress_loop(service: StageService) -> None:
    while True:
        await asyncio.sleep(service.me.period)
        await service.gossip.refresh_fingerprint()
        service.publish_progress()
        horizon = 4 * service.config.training.hop_timeout * service.config.num_stages
        # the worker's state belongs to its compute thread: expire there, not on the event loop
        await service.worker.executor.run(service.worker.expire, horizon)

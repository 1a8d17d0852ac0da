"""Downloading a live stage's state from a peer that serves it, and serving it (docs/recovery.md,
"State transfer"; SWARM: a new peer joins a stage and downloads its parameters from a peer of it).

One libp2p stream ("state" session) per download; every frame is a `protocol` message:

    joiner -> donor   STATE_REQUEST {stage, part}
    donor  -> joiner  STATE_HEADER  (what encode_state builds and check_header checks)
                      or ERROR {reason} when it does not serve that stage/part, BUSY when it is
                      already streaming its state to MAX_CONCURRENT_UPLOADS others
    donor  -> joiner  STATE_CHUNK   {index, offset} + tensor "chunk" (uint8, chunk_bytes each, the
                                     last one shorter), repeated
    donor  -> joiner  STATE_END     {checksum}

The codec (header, payload layout, checksum, the parts) is protocol/stage_state.py and the chunking
node/p2p/tensor_stream.py; this module moves them over the network and connects them to a running
worker. Any mismatch raises ProtocolError, an unreachable or refusing donor TransportError; the
caller (download_from_any) then tries another donor. The request's `stage` is always the stage the
donor serves, and a donor refuses any other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor

from dht.announcer import PeerAnnouncer
from dht.records import PeerRecord, PeerState, short_peer_id
from dht.swarm_view import SwarmView
from node.averaging.gossip import Gossip
from node.config import SwarmConfig
from node.p2p.answer_budget import AnswerBudget
from node.p2p.tensor_stream import ChunkIndex, Session, TensorStream
from node.p2p.transport import Transport, TransportError
from node.runtime.byte_progress import ByteProgress, ByteTask, Outcome
from node.runtime.device import DeviceTransfers
from node.runtime.meter import Tally
from node.stage.access import load_optimizer_moments, optimizer_moments, weight_shapes, weight_views
from node.stage.stage_worker import StageWorker
from protocol import MessageKind, ProtocolError
from protocol.stage_state import (
    CHUNK_BYTES,
    EDGE_COPY_DTYPE,
    MAX_STATE_BYTES,
    MOMENTS_DTYPE,
    PART_KEYS,
    PARTS,
    StageState,
    StateLayout,
    StatePart,
    StateUnavailable,
    check_checksum,
    check_header,
    decode_payload,
    encode_state,
    payload_hasher,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DonorBusy",
    "StateProvider",
    "adopt_state",
    "capture_state",
    "choose_donor",
    "download_from_any",
    "download_state",
    "join_live_stage",
    "serve_state",
    "state_on_device",
    "state_on_host",
    "state_provider",
    "take_stage_state",
]

SERVICE = "state"
MAX_CONCURRENT_UPLOADS = 2  # each upload holds a full copy of the stage in memory
# the parts as large as a whole stage (a joiner's, a rebuild's, an export's): counted by the answer
# budget. The edge parts embed/head are not: stage 1 / stage S peers refresh them every
# edge_copy_interval stage-0 steps, a cadence set by the swarm's speed, not by the requester
BUDGETED_PARTS = frozenset({StatePart.STAGE, StatePart.WEIGHTS, StatePart.EDGE_COPY})

# What a donor serves for a requested part: copies taken consistently (training goes on while the
# chunks stream); raises StateUnavailable to refuse.
StateProvider = Callable[[StatePart], Awaitable[StageState]]


def state_chunks(chunk_bytes: int) -> TensorStream:
    """STATE_CHUNKs of one uint8 payload: `index` numbers the chunks, `offset` is in bytes."""
    return TensorStream(MessageKind.STATE_CHUNK, chunk_bytes, ChunkIndex.RUNNING)


# ------------------------------------------------------------------------------------------------
# Serving


async def serve_state(
    transport: Transport,
    provider: StateProvider,
    chunk_bytes: int = CHUNK_BYTES,
    timeout: float = 60.0,
    budget: AnswerBudget | None = None,
) -> None:
    """Register the "state" session handler: answer STATE_REQUESTs for the stage this peer serves
    (transport.stage, read per request: the peer may move) with provider(part), streamed in
    chunks. `timeout` bounds each message. Whole-stage parts count against `budget` (default:
    node/p2p/answer_budget.py's limits); a requester over it gets an ERROR before anything is copied."""
    uploads = asyncio.Semaphore(MAX_CONCURRENT_UPLOADS)
    budget = budget or AnswerBudget()

    async def handle(sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = Session(transport, reader, writer, timeout)
        request = await session.recv()
        rid = request.request_id
        if request.kind != MessageKind.STATE_REQUEST:
            await session.send(transport.error(f"expected a state request, got {request.kind.value}", rid))
            return
        stage, part = request.meta["stage"], request.meta.get("part", StatePart.STAGE)
        if stage != transport.stage or part not in PARTS:
            reason = f"this peer serves stage {transport.stage}; cannot serve stage {stage} part {str(part)!r:.40}"
            await session.send(transport.error(reason, rid))
            return
        part = StatePart(part)
        if uploads.locked():
            await session.send(transport.message(MessageKind.BUSY, request_id=rid))
            return
        refusal = budget.take(sender) if part in BUDGETED_PARTS else None
        if refusal is not None:
            logger.info(f"refused stage {stage} part {part} to {short_peer_id(sender)}: {refusal}")
            await session.send(transport.error(refusal, rid))
            return
        async with uploads:
            try:
                state = await provider(part)
                meta, payload = await asyncio.to_thread(encode_state, state, part, chunk_bytes)
            except StateUnavailable as e:
                await session.send(transport.error(str(e), rid))
                return
            await session.send(transport.message(MessageKind.STATE_HEADER, meta, request_id=rid))
            await state_chunks(chunk_bytes).send(session, [payload], request_id=rid)
            await session.send(transport.message(MessageKind.STATE_END, {"checksum": meta["checksum"]}, request_id=rid))
            logger.info(f"sent stage {stage} part {part} ({payload.numel()} bytes) to {short_peer_id(sender)}")

    await transport.serve_sessions(SERVICE, handle)


# ------------------------------------------------------------------------------------------------
# Downloading


class DonorBusy(TransportError):
    """The donor is already streaming its state to others: ask another one."""


async def download_state(
    transport: Transport,
    peer_id: str,
    stage: int,
    part: StatePart | str = StatePart.STAGE,
    timeout: float = 60.0,
    *,
    expect: Mapping[str, Sequence[int]] | None = None,
    max_bytes: int = MAX_STATE_BYTES,
    progress: ByteProgress | None = None,
) -> StageState:
    """Download `part` of `stage` from `peer_id`. `timeout` bounds each message (not the whole
    download, which grows with the stage's size); `expect` (name -> shape of our own weights)
    rejects a donor serving another architecture before anything is allocated; `progress` shows
    the payload's bytes as they arrive.

    Raises TransportError (unreachable, refused, busy, timed out) or ProtocolError (any mismatch).
    """
    if part not in PARTS:
        raise ValueError(f"unknown state part {part!r}; expected one of {[str(p) for p in PARTS]}")
    part = StatePart(part)
    who = short_peer_id(peer_id)
    try:
        async with transport.session(peer_id, SERVICE, timeout) as (reader, writer):
            session = Session(transport, reader, writer, timeout)
            try:
                payload, layout, header = await _receive_state(session, who, stage, part, max_bytes, expect, progress)
            except TimeoutError:  # before OSError: TimeoutError is one
                raise TransportError(f"state download from {who} stalled for {timeout:.0f} s") from None
            except EOFError:  # the donor closed the stream between two messages
                raise ProtocolError(f"state download from {who}: stream ended early") from None
            except (ConnectionError, OSError) as e:
                raise TransportError(f"state download from {who} broke: {e!r}") from e
            except ProtocolError as e:
                raise ProtocolError(f"state download from {who}: {e}") from None
        # host tensors only, but a copy per tensor of the whole stage: seconds at a real preset,
        # which the loop (heartbeats, other peers' requests) must not wait for
        decoded = await asyncio.to_thread(decode_payload, payload, layout, header)
        state = dataclasses.replace(decoded, donor=peer_id)
    except (TransportError, ProtocolError):
        transport.meter.count(Tally.STATE_DOWNLOAD_FAILURES)
        raise
    transport.meter.count(Tally.STATE_DOWNLOADS)
    return state


async def _receive_state(
    session: Session,
    who: str,
    stage: int,
    part: StatePart,
    max_bytes: int,
    expect: Mapping[str, Sequence[int]] | None,
    progress: ByteProgress | None,
) -> tuple[Tensor, StateLayout, dict]:
    """Request `part`, check the header, receive and checksum the payload: (payload, layout, header meta)."""
    transport = session.transport
    await session.send(transport.message(MessageKind.STATE_REQUEST, {"stage": stage, "part": str(part)}))
    header = await session.recv()
    if header.kind == MessageKind.ERROR:
        raise TransportError(f"{who} refused state of stage {stage} part {part}: {header.meta.get('reason')}")
    if header.kind == MessageKind.BUSY:
        raise DonorBusy(f"{who} is busy serving its state to others")
    if header.kind != MessageKind.STATE_HEADER:
        raise ProtocolError(f"expected a header, got {header.kind.value}")
    layout = check_header(header.meta, stage, part, max_bytes, expect)
    payload = torch.empty(layout.total_bytes, dtype=torch.uint8, device="cpu")  # the wire's bytes
    hasher = payload_hasher()
    # the header's size was checked above: the bar's total is what the donor promised and may send
    shown: ByteTask | None = None
    if progress is not None:
        what = f"stage {stage}" if part == StatePart.STAGE else f"stage {stage} {part}"
        shown = progress.task(f"{what} from {who}", layout.total_bytes)

    async def take_chunk(chunk: Tensor) -> None:
        # hashlib releases the GIL on large buffers: a 4 MiB chunk costs the loop nothing
        await asyncio.to_thread(hasher.update, chunk.numpy().data)
        if shown is not None:
            shown.advance(chunk.numel())  # uint8: one element per byte

    try:
        await state_chunks(layout.chunk_bytes).receive(session, [payload], on_chunk=take_chunk)
        end = await session.expect(MessageKind.STATE_END)
        check_checksum(hasher.hexdigest(), layout, end.meta["checksum"])
    except BaseException:
        if shown is not None:
            shown.finish(Outcome.FAILED)
        raise
    if shown is not None:
        shown.finish()
    return payload, layout, header.meta


def choose_donor(candidates: Sequence[PeerRecord], rng: random.Random) -> PeerRecord:
    """A random online candidate, weighted by its announced throughput.

    Peer records carry no queue length. SWARM routing sends each peer work in proportion to its
    throughput, so a stage's peers are about equally busy; a faster one spends a smaller share of
    its time on copying its state, and spreading the choice at random keeps several joiners from
    all landing on the single fastest donor.
    """
    if not candidates:
        raise ValueError("no donor candidates")
    weights = [max(peer.throughput, 1e-3) for peer in candidates]
    return rng.choices(list(candidates), weights=weights, k=1)[0]


async def download_from_any(
    transport: Transport,
    candidates: Sequence[PeerRecord],
    stage: int,
    part: StatePart | str,
    rng: random.Random,
    attempts: int = 3,
    *,
    timeout: float = 60.0,
    expect: Mapping[str, Sequence[int]] | None = None,
    progress: ByteProgress | None = None,
) -> StageState:
    """Download from a donor chosen by choose_donor among the online candidates (never this peer);
    a donor that fails (dies mid-download, refuses, is busy, sends garbage) is not asked again and
    another is tried, up to `attempts` donors. Raises TransportError when all of them fail.
    `progress` shows each attempt's bytes (a failed one ends as failed, the next starts anew)."""
    me = transport.p2p.peer_id.to_base58()
    left = [peer for peer in candidates if peer.state == PeerState.ONLINE and peer.peer_id != me]
    failures = []
    for _ in range(attempts):
        if not left:
            break
        donor = choose_donor(left, rng)
        left.remove(donor)
        try:
            return await download_state(
                transport, donor.peer_id, stage, part, timeout, expect=expect, progress=progress
            )
        except (TransportError, ProtocolError) as e:
            logger.warning(
                f"state download of stage {stage} part {part} from {short_peer_id(donor.peer_id)} failed: {e}"
            )
            failures.append(f"{short_peer_id(donor.peer_id)}: {e}")
    detail = "; ".join(failures) or "no online donor"
    raise TransportError(f"could not download stage {stage} part {part} ({detail})")


# ------------------------------------------------------------------------------------------------
# Between a StageState and a running worker


class PeerStatus(Protocol):
    """What a donor reads of its own record (a PeerAnnouncer; a PeerRecord also fits)."""

    @property
    def state(self) -> PeerState: ...

    @property
    def outer_round(self) -> int: ...


class EdgeCopyHolder(Protocol):
    """The CheckFree+ edge copies a stage 1 / stage S peer keeps (EdgeCopies, node/recovery/edge_copies.py)."""

    def merged_state(self) -> StageState: ...


def state_on_host(state: StageState, transfers: DeviceTransfers) -> StageState:
    """`state` with its tensors on the host, for the wire (run on the compute thread). Not copies on
    a CPU: give it tensors that are replaced, never modified in place (edge copies, outer states)."""
    return dataclasses.replace(
        state,
        weights=transfers.state_to_host(state.weights, copy=False),
        outer=transfers.state_to_host(state.outer, copy=False),
    )


def state_on_device(state: StageState, transfers: DeviceTransfers) -> StageState:
    """`state` (as downloaded, on the host) with its tensors on the stage's device (compute thread)."""
    return dataclasses.replace(
        state, weights=transfers.state_to_device(state.weights), outer=transfers.state_to_device(state.outer)
    )


async def capture_state(
    worker: StageWorker, gossip: Gossip | None = None, outer_round: int = 0, with_moments: bool = True
) -> StageState:
    """A consistent copy of `worker`'s stage (and the gossip outer state, when there is one; the
    optimizer's moments unless `with_moments` is False), taken on the worker's compute thread
    between two of its steps, on the host for the wire."""

    def take() -> StageState:
        # an outer state's tensors are never modified in place (every outer step makes new ones)
        outer = worker.transfers.state_to_host(gossip.export_outer(), copy=False) if gossip else {}
        # the gossip's own round counter is exact; the record's copy lags by up to a heartbeat
        round_now = gossip.outer_state.round if gossip else outer_round
        moments, optimizer_steps = optimizer_moments(worker, MOMENTS_DTYPE) if with_moments else ({}, 0)
        return StageState(
            stage=worker.stage,
            weights=worker.state_dict(),
            outer=outer,
            moments=worker.transfers.state_to_host(moments, copy=False),
            optimizer_steps=optimizer_steps,
            inner_step=worker.inner_step,
            outer_round=round_now,
            grad_norm=worker.last_grad_norm,
            lr_scale=worker.lr_scale,
        )

    return await worker.compute(take)


def state_provider(
    worker: StageWorker, me: PeerStatus, edge_copies: EdgeCopyHolder | None = None, gossip: Gossip | None = None
) -> StateProvider:
    """The provider a stage service hands serve_state.

    "stage" and "weights" are served only while this peer is `online` (a joiner or a peer being
    rebuilt holds no trustworthy weights yet); "embed"/"head" only by stage 0; "edge_copy" by
    whoever holds a copy (`edge_copies`, set on stage 1 / stage S peers with CheckFree+).
    """

    async def provide(part: StatePart) -> StageState:
        if part == StatePart.EDGE_COPY:
            if edge_copies is None:
                raise StateUnavailable(f"stage {worker.stage} keeps no edge copy")
            return await worker.compute(lambda: state_on_host(edge_copies.merged_state(), worker.transfers))
        if me.state != PeerState.ONLINE:
            raise StateUnavailable(f"this peer is {me.state}, not online")
        if part in (StatePart.STAGE, StatePart.WEIGHTS):
            return await capture_state(worker, gossip, me.outer_round, with_moments=part == StatePart.STAGE)
        if worker.stage != 0:
            raise StateUnavailable(f"part '{part}' is a piece of stage 0, this peer serves stage {worker.stage}")
        keys = PART_KEYS[part]

        def take() -> StageState:
            weights = weight_views(worker)
            return StageState(
                stage=0,
                weights=worker.transfers.state_to_host({k: weights[k].to(EDGE_COPY_DTYPE) for k in keys}),
                inner_step=worker.inner_step,
                grad_norm=worker.last_grad_norm,
            )

        return await worker.compute(take)

    return provide


async def adopt_state(worker: StageWorker, state: StageState, gossip: Gossip | None = None) -> None:
    """Make `worker` continue where the donor is: its weights and inner optimizer's moments, its
    schedule position and lr scale, and the gossip outer state. Moments that fail their checks are
    left out (a fresh optimizer, as before the donor's first step), with a warning."""

    def load() -> None:
        # the weights go through load_state_dict's own copies; the outer state is moved by import_outer
        worker.adopt(state.weights, state.inner_step, state.grad_norm, state.lr_scale)
        try:
            load_optimizer_moments(worker, state.moments, state.optimizer_steps)
        except ValueError as e:
            logger.warning(f"stage {worker.stage}: the donor's optimizer moments were left out: {e}")
        if gossip is not None and state.outer:
            gossip.import_outer(state.outer, state.outer_round)

    await worker.compute(load)


class StageParts(Protocol):
    """The parts of a running stage service that recovery steps use (node/server/stage_service.py's
    StageService has all of them): read-only, so any object with these attributes fits."""

    @property
    def config(self) -> SwarmConfig: ...
    @property
    def me(self) -> PeerAnnouncer: ...
    @property
    def worker(self) -> StageWorker: ...
    @property
    def transport(self) -> Transport: ...
    @property
    def view(self) -> SwarmView: ...
    @property
    def gossip(self) -> Gossip | None: ...


async def join_live_stage(
    service: StageParts,
    attempts: int = 3,
    rounds: int = 5,
    retry_every: float = 2.0,
    progress: ByteProgress | None = None,
) -> bool:
    """Before a peer of a live stage goes online: download the stage's state from one of its online
    peers and adopt it (its record stays `joining` meanwhile, so nobody routes to it or gossips
    with it). Up to `attempts` donors per round; between rounds the swarm view is refreshed (donors
    die, others join). Returns False when no donor is left (the stage is lost: the caller rebuilds
    it instead); raises TransportError after `rounds` failed rounds. `progress` shows the bytes of
    each download.
    """
    me = service.me
    rng = random.Random()
    for round_index in range(1, rounds + 1):
        donors = service.view.online(me.stage, exclude=me.peer_id)
        if not donors:
            return False
        try:
            state = await take_stage_state(service, donors, rng, attempts, progress)
        except TransportError as e:
            if round_index == rounds:
                raise
            logger.warning(f"joining stage {me.stage}: {e}; retrying in {retry_every:.0f} s")
            await asyncio.sleep(retry_every)
            await service.view.refresh()
            continue
        logger.info(f"joined live stage {me.stage} at inner step {state.inner_step}, outer round {state.outer_round}")
        return True
    return False


async def take_stage_state(
    service: StageParts,
    donors: Sequence[PeerRecord],
    rng: random.Random,
    attempts: int = 3,
    progress: ByteProgress | None = None,
) -> StageState:
    """Download this peer's stage's state from one of `donors` (download_from_any) and continue
    from it: weights, schedule, outer state (adopt_state) and the record's counters. Raises
    TransportError when every donor tried failed; the worker is untouched then."""
    me, worker = service.me, service.worker
    shapes = await worker.compute(weight_shapes, worker)
    state = await download_from_any(
        service.transport, donors, me.stage, StatePart.STAGE, rng, attempts, expect=shapes, progress=progress
    )
    await adopt_state(worker, state, service.gossip)
    me.restore_counters(state.inner_step, state.outer_round)
    return state

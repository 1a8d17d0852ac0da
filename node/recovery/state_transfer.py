"""Downloading a live stage's state from a peer that serves it (SWARM: "a new peer joins a stage
and downloads its parameters from a peer of that stage"), and serving it.

One libp2p stream ("state" session) per download; every frame is a `protocol` message:

    joiner -> donor   STATE_REQUEST {stage, part}
    donor  -> joiner  STATE_HEADER  {stage, part, names, shapes, dtypes, total_bytes, checksum,
                                     chunk_bytes, num_weights, inner_step, outer_round, grad_norm,
                                     lr_scale}
                      (or ERROR {reason} when it does not serve that stage/part, BUSY when it is
                      already streaming its state to MAX_CONCURRENT_UPLOADS others)
    donor  -> joiner  STATE_CHUNK   {index, offset} + tensor "chunk" (uint8, chunk_bytes each, the
                                     last one shorter), repeated
    donor  -> joiner  STATE_END     {checksum}

The payload is the raw bytes of every tensor (C order, native little-endian) concatenated in
`names` order; the first `num_weights` names are module weights, the rest the NoLoCo outer state
(prefixed "outer."). checksum = sha256 hex of the payload. The joiner checks everything it can
before allocating: names/shapes/dtypes well formed, total_bytes equal to what the shapes imply and
under `max_bytes`, the weights' names and shapes equal to its own module's (`expect`); then each
chunk's index, offset and size, then the checksum, announced twice (header and end) and computed.
Any mismatch raises ProtocolError, an unreachable or refusing donor TransportError; the caller
(download_from_any) then tries another donor.

`part` says what of the donor's stage is wanted (the request's `stage` is always the stage the
donor serves, and a donor refuses any other):
    "stage"      the whole stage: module weights, outer state, counters (joining a live stage)
    "embed"      stage 0 only: embed_tokens.weight (a CheckFree+ edge copy, kept by stage 1)
    "head"       stage 0 only: norm.weight and lm_head.weight (edge copy kept by stage S)
    "edge_copy"  stage 1 / stage S only: the copy of stage-0 entries this peer keeps (to rebuild
                 a lost stage 0; inner_step is the stage-0 step the copy was taken at)
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import random
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping, Sequence

import torch
from torch import Tensor

from dht.announcer import PeerAnnouncer
from dht.records import PeerRecord, PeerState
from node.p2p.transport import Transport, TransportError
from protocol import Message, MessageKind, ProtocolError, recv_message, send_message
from protocol.tensors import DTYPES
from node.runtime.timeouts import within

logger = logging.getLogger(__name__)

__all__ = [
    "PARTS",
    "CHUNK_BYTES",
    "MAX_STATE_BYTES",
    "StageState",
    "StateUnavailable",
    "serve_state",
    "download_state",
    "download_from_any",
    "choose_donor",
    "edge_part",
    "snapshot_worker",
    "stage_snapshot",
    "adopt_state",
    "join_live_stage",
]

SERVICE = "state"
PARTS = ("stage", "embed", "head", "edge_copy")
CHUNK_BYTES = 4 << 20  # well under the 256 MiB frame limit; a few ms of hashing per chunk
MAX_STATE_BYTES = 8 << 30  # refuse to allocate more than this for one download, whatever the header says
MAX_CONCURRENT_UPLOADS = 2  # each upload holds a full copy of the stage in memory
OUTER_PREFIX = "outer."
STATE_DTYPES = ("float32", "float16", "bfloat16", "float64")  # weights and outer state are floats

EMBED_KEYS = ("embed_tokens.weight",)
HEAD_KEYS = ("norm.weight", "lm_head.weight")


class StateUnavailable(ValueError):
    """This peer cannot serve the requested part right now (wrong stage, no edge copy yet, not online)."""


@dataclass
class StageState:
    """What a peer of a stage hands a joiner: everything but the inner optimizer's moments."""

    stage: int
    weights: dict[str, Tensor]
    outer: dict[str, Tensor] = field(default_factory=dict)  # NoLoCo phi (and momentum), may be empty
    inner_step: int = 0
    outer_round: int = 0
    grad_norm: float | None = None
    lr_scale: float = 1.0  # a rebuilt stage keeps lr x 1.1; its later replicas must train alike
    donor: str | None = None  # the peer it was downloaded from (None: taken locally)


Snapshot = Callable[[str], Awaitable[StageState]]


def edge_part(state_dict: Mapping[str, Tensor], part: str) -> dict[str, Tensor]:
    """The entries of a stage-0 state dict that form edge copy `part` ("embed" or "head")."""
    keys = EMBED_KEYS if part == "embed" else HEAD_KEYS if part == "head" else None
    if keys is None:
        raise StateUnavailable(f"{part!r} is not an edge part (embed, head)")
    return {key: state_dict[key] for key in keys}


# ------------------------------------------------------------------------------------------------
# Encoding


def _flatten(state: StageState) -> tuple[list[str], list[Tensor], int]:
    names = list(state.weights) + [OUTER_PREFIX + name for name in state.outer]
    tensors = list(state.weights.values()) + list(state.outer.values())
    return names, tensors, len(state.weights)


def encode_state(state: StageState, part: str, chunk_bytes: int = CHUNK_BYTES) -> tuple[dict, Tensor]:
    """The STATE_HEADER meta and the payload (one uint8 tensor) for `state`. CPU work: call it
    off the event loop."""
    names, tensors, num_weights = _flatten(state)
    dtype_names = {dtype: name for name, dtype in DTYPES.items()}
    flat = []
    for name, t in zip(names, tensors):
        if dtype_names.get(t.dtype) not in STATE_DTYPES:
            raise StateUnavailable(f"{name}: dtype {t.dtype} cannot be transferred")
        flat.append(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8))
    payload = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)
    meta = {
        "stage": state.stage,
        "part": part,
        "names": names,
        "shapes": [list(t.shape) for t in tensors],
        "dtypes": [dtype_names[t.dtype] for t in tensors],
        "total_bytes": payload.numel(),
        "checksum": hashlib.sha256(payload.numpy().data).hexdigest(),
        "chunk_bytes": chunk_bytes,
        "num_weights": num_weights,
        "inner_step": state.inner_step,
        "outer_round": state.outer_round,
        "grad_norm": state.grad_norm,
        "lr_scale": state.lr_scale,
    }
    return meta, payload


@dataclass(frozen=True)
class _Layout:
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    num_weights: int
    total_bytes: int
    chunk_bytes: int
    checksum: str


def _check_header(
    meta: Mapping, stage: int, part: str, max_bytes: int, expect: Mapping[str, Sequence[int]] | None
) -> _Layout:
    """Validate a STATE_HEADER against the request and our limits; nothing is allocated yet."""
    if meta.get("stage") != stage or meta.get("part") != part:
        raise ProtocolError(f"asked for stage {stage} part {part!r}, got stage {meta.get('stage')!r} part {meta.get('part')!r}")
    names, shapes, dtypes = meta["names"], meta["shapes"], meta.get("dtypes")
    if not isinstance(dtypes, list) or not len(names) == len(shapes) == len(dtypes):
        raise ProtocolError("state header: names, shapes and dtypes must be lists of the same length")
    if len(set(names)) != len(names):
        raise ProtocolError("state header: duplicate tensor names")
    num_weights = meta.get("num_weights")
    if not isinstance(num_weights, int) or isinstance(num_weights, bool) or not 0 <= num_weights <= len(names):
        raise ProtocolError(f"state header: num_weights {num_weights!r} out of range")
    if any(name.startswith(OUTER_PREFIX) for name in names[:num_weights]) or not all(
        name.startswith(OUTER_PREFIX) for name in names[num_weights:]
    ):
        raise ProtocolError(f"state header: outer-state names must come last and start with {OUTER_PREFIX!r}")
    total, torch_dtypes = 0, []
    for name, shape, dtype in zip(names, shapes, dtypes):
        if dtype not in STATE_DTYPES:
            raise ProtocolError(f"state header: {name}: dtype {dtype!r} not allowed")
        if len(shape) > 8:
            raise ProtocolError(f"state header: {name}: {len(shape)} dimensions")
        torch_dtypes.append(DTYPES[dtype])
        numel = math.prod(shape)  # every dim is an int >= 0 (the message schema checked it)
        total += numel * torch_dtypes[-1].itemsize
        if total > max_bytes:
            raise ProtocolError(f"state header: the tensors need more than max_bytes {max_bytes}")
    if meta["total_bytes"] != total:
        raise ProtocolError(f"state header: total_bytes {meta['total_bytes']} but the shapes need {total}")
    if expect is not None:
        got = {name: tuple(shape) for name, shape in zip(names[:num_weights], shapes[:num_weights])}
        want = {name: tuple(shape) for name, shape in expect.items()}
        if got != want:
            diff = sorted(set(got.items()) ^ set(want.items()))[:4]
            raise ProtocolError(f"state header: weights do not match this stage's module: {diff}")
    chunk_bytes = meta.get("chunk_bytes")
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < 1:
        raise ProtocolError(f"state header: chunk_bytes {chunk_bytes!r} must be a positive int")
    checksum = meta["checksum"]
    if len(checksum) != 64:
        raise ProtocolError("state header: checksum is not a sha256 hex digest")
    for key, kind in (("inner_step", int), ("outer_round", int)):
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool) or meta[key] < 0:
            raise ProtocolError(f"state header: {key} must be an int >= 0")
    grad_norm, lr_scale = meta.get("grad_norm"), meta.get("lr_scale")
    if grad_norm is not None and not (isinstance(grad_norm, (int, float)) and math.isfinite(grad_norm) and grad_norm >= 0):
        raise ProtocolError(f"state header: grad_norm {grad_norm!r} must be a finite number >= 0 or null")
    if not (isinstance(lr_scale, (int, float)) and math.isfinite(lr_scale) and 0 < lr_scale <= 100):
        raise ProtocolError(f"state header: lr_scale {lr_scale!r} out of range")
    return _Layout(names, [tuple(s) for s in shapes], torch_dtypes, num_weights, total, chunk_bytes, checksum)


def _decode_payload(payload: Tensor, layout: _Layout, meta: Mapping) -> StageState:
    weights, outer, offset = {}, {}, 0
    for index, (name, shape, dtype) in enumerate(zip(layout.names, layout.shapes, layout.dtypes)):
        size = math.prod(shape) * dtype.itemsize
        # clone first: a view of the shared buffer at an odd offset cannot be reinterpreted as float
        tensor = payload[offset:offset + size].clone().view(dtype).reshape(shape)
        offset += size
        if index < layout.num_weights:
            weights[name] = tensor
        else:
            outer[name[len(OUTER_PREFIX):]] = tensor
    grad_norm = meta.get("grad_norm")
    return StageState(
        stage=meta["stage"], weights=weights, outer=outer, inner_step=meta["inner_step"],
        outer_round=meta["outer_round"], grad_norm=None if grad_norm is None else float(grad_norm),
        lr_scale=float(meta["lr_scale"]),
    )


# ------------------------------------------------------------------------------------------------
# Serving


async def serve_state(
    transport: Transport, snapshot: Snapshot, chunk_bytes: int = CHUNK_BYTES, timeout: float = 60.0
) -> None:
    """Register the "state" session handler: answer STATE_REQUESTs for the stage this peer serves
    (transport.stage, read per request: the peer may move) with snapshot(part), streamed in chunks.

    `snapshot` must return copies (training goes on while the chunks stream) taken consistently
    (through the worker's executor); it raises StateUnavailable to refuse.
    """
    uploads = asyncio.Semaphore(MAX_CONCURRENT_UPLOADS)

    async def send(writer: asyncio.StreamWriter, message: Message) -> None:
        await within(send_message(writer, message, "none", transport.limits), timeout)

    async def handle(sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await within(recv_message(reader, transport.limits, transport.swarm_id), timeout)
        rid = request.request_id
        if request.kind != MessageKind.STATE_REQUEST:
            await send(writer, transport.error(f"expected a state request, got {request.kind.value}", rid))
            return
        stage, part = request.meta["stage"], request.meta.get("part", "stage")
        if stage != transport.stage or part not in PARTS:
            await send(writer, transport.error(f"this peer serves stage {transport.stage}; cannot serve stage {stage} part {part!r:.40}", rid))
            return
        if uploads.locked():
            await send(writer, transport.message(MessageKind.BUSY, request_id=rid))
            return
        async with uploads:
            try:
                state = await snapshot(part)
                meta, payload = await asyncio.to_thread(encode_state, state, part, chunk_bytes)
            except StateUnavailable as e:
                await send(writer, transport.error(str(e), rid))
                return
            await send(writer, transport.message(MessageKind.STATE_HEADER, meta, request_id=rid))
            for index, offset in enumerate(range(0, payload.numel(), chunk_bytes)):
                chunk = payload[offset:offset + chunk_bytes]
                await send(writer, transport.message(MessageKind.STATE_CHUNK, {"index": index, "offset": offset},
                                                     {"chunk": chunk}, request_id=rid))
            await send(writer, transport.message(MessageKind.STATE_END, {"checksum": meta["checksum"]}, request_id=rid))
            logger.info(f"sent stage {stage} part {part} ({payload.numel()} bytes) to {sender[-8:]}")

    await transport.serve_sessions(SERVICE, handle)


# ------------------------------------------------------------------------------------------------
# Downloading


class DonorBusy(TransportError):
    """The donor is already streaming its state to others: ask another one."""


async def download_state(
    transport: Transport,
    peer_id: str,
    stage: int,
    part: str = "stage",
    timeout: float = 60.0,
    *,
    expect: Mapping[str, Sequence[int]] | None = None,
    max_bytes: int = MAX_STATE_BYTES,
) -> StageState:
    """Download `part` of `stage` from `peer_id`. `timeout` bounds each message (not the whole
    download, which grows with the stage's size); `expect` (name -> shape of our own weights)
    rejects a donor serving another architecture before anything is allocated.

    Raises TransportError (unreachable, refused, busy, timed out) or ProtocolError (any mismatch).
    """
    if part not in PARTS:
        raise ValueError(f"unknown state part {part!r}; expected one of {PARTS}")
    who = peer_id[-8:]

    async def receive(reader: asyncio.StreamReader) -> Message:
        try:
            return await within(recv_message(reader, transport.limits, transport.swarm_id), timeout)
        except asyncio.TimeoutError:
            raise TransportError(f"state download from {who} stalled for {timeout:.0f} s") from None
        except EOFError:
            raise ProtocolError(f"state download from {who}: stream ended early") from None
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as e:
            raise TransportError(f"state download from {who} broke: {e!r}") from e

    async with transport.session(peer_id, SERVICE, timeout) as (reader, writer):
        request = transport.message(MessageKind.STATE_REQUEST, {"stage": stage, "part": part})
        try:
            await within(send_message(writer, request, "none", transport.limits), timeout)
        except (asyncio.TimeoutError, ConnectionError, OSError) as e:
            raise TransportError(f"state request to {who} failed: {e!r}") from e
        header = await receive(reader)
        if header.kind == MessageKind.ERROR:
            raise TransportError(f"{who} refused state of stage {stage} part {part}: {header.meta.get('reason')}")
        if header.kind == MessageKind.BUSY:
            raise DonorBusy(f"{who} is busy serving its state to others")
        if header.kind != MessageKind.STATE_HEADER:
            raise ProtocolError(f"state download from {who}: expected a header, got {header.kind.value}")
        layout = _check_header(header.meta, stage, part, max_bytes, expect)
        payload = torch.empty(layout.total_bytes, dtype=torch.uint8)
        digest, received, index = hashlib.sha256(), 0, 0
        while True:
            message = await receive(reader)
            if message.kind == MessageKind.STATE_END:
                break
            if message.kind != MessageKind.STATE_CHUNK:
                raise ProtocolError(f"state download from {who}: unexpected {message.kind.value}")
            chunk = message.tensors["chunk"]
            expected_size = min(layout.chunk_bytes, layout.total_bytes - received)
            if message.meta["index"] != index or message.meta["offset"] != received:
                raise ProtocolError(f"state download from {who}: chunk {message.meta['index']} at offset "
                                    f"{message.meta['offset']}, expected chunk {index} at {received}")
            if chunk.dtype != torch.uint8 or chunk.dim() != 1 or chunk.numel() != expected_size or expected_size == 0:
                raise ProtocolError(f"state download from {who}: chunk {index} has {chunk.numel()} {chunk.dtype} "
                                    f"elements, expected {expected_size} uint8")
            payload[received:received + expected_size] = chunk
            # hashlib releases the GIL on large buffers: a 4 MiB chunk costs the loop nothing
            await asyncio.to_thread(digest.update, chunk.numpy().data)
            received += expected_size
            index += 1
        if received != layout.total_bytes:
            raise ProtocolError(f"state download from {who}: stream ended after {received} of {layout.total_bytes} bytes")
        computed = digest.hexdigest()
        if not computed == layout.checksum == message.meta["checksum"]:
            raise ProtocolError(f"state download from {who}: checksum mismatch (computed {computed[:12]}, header "
                                f"{layout.checksum[:12]}, end {message.meta['checksum'][:12]})")
    return dataclasses.replace(_decode_payload(payload, layout, header.meta), donor=peer_id)


def choose_donor(candidates: Sequence[PeerRecord], rng: random.Random) -> PeerRecord:
    """A random online candidate, weighted by its announced throughput.

    Peer records carry no queue length. SWARM routing sends each peer work in proportion to its
    throughput, so a stage's peers are about equally busy; a faster one spends a smaller share of
    its time on the snapshot copy, and spreading the choice at random keeps several joiners from
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
    part: str,
    rng: random.Random,
    attempts: int = 3,
    *,
    timeout: float = 60.0,
    expect: Mapping[str, Sequence[int]] | None = None,
) -> StageState:
    """Download from a donor chosen by choose_donor among the online candidates (never this peer);
    a donor that fails (dies mid-download, refuses, is busy, sends garbage) is not asked again and
    another is tried, up to `attempts` donors. Raises TransportError when all of them fail."""
    me = transport.p2p.peer_id.to_base58()
    left = [peer for peer in candidates if peer.state == PeerState.ONLINE and peer.peer_id != me]
    failures = []
    for _ in range(attempts):
        if not left:
            break
        donor = choose_donor(left, rng)
        left.remove(donor)
        try:
            return await download_state(transport, donor.peer_id, stage, part, timeout, expect=expect)
        except (TransportError, ProtocolError) as e:
            logger.warning(f"state download of stage {stage} part {part} from {donor.peer_id[-8:]} failed: {e}")
            failures.append(f"{donor.peer_id[-8:]}: {e}")
    detail = "; ".join(failures) or "no online donor"
    raise TransportError(f"could not download stage {stage} part {part} ({detail})")


# ------------------------------------------------------------------------------------------------
# Between a StageState and a running worker


async def snapshot_worker(worker, gossip=None, outer_round: int = 0) -> StageState:
    """A consistent copy of `worker`'s stage (and the gossip outer state, when there is one),
    taken on the worker's compute thread between two of its steps."""

    def take() -> StageState:
        outer = {k: v.detach().to("cpu", copy=True) for k, v in gossip.export_outer().items()} if gossip else {}
        # the gossip's own round counter is exact; the record's copy lags by up to a heartbeat
        round_now = getattr(getattr(gossip, "outer_state", None), "round", outer_round)
        return StageState(
            stage=worker.stage, weights=worker.state_dict(), outer=outer, inner_step=worker.inner_step,
            outer_round=round_now, grad_norm=worker.last_grad_norm, lr_scale=worker.lr_scale,
        )

    return await asyncio.get_running_loop().run_in_executor(worker.executor, take)


def stage_snapshot(worker, me: PeerAnnouncer, edge_copies=None, gossip: Callable[[], object] = lambda: None) -> Snapshot:
    """The snapshot function a stage service hands serve_state.

    "stage" is served only while this peer is `online` (a joiner or a peer being rebuilt holds no
    trustworthy weights yet); "embed"/"head" only by stage 0; "edge_copy" by whoever holds a copy
    (`edge_copies`, an EdgeCopies, set on stage 1 / stage S peers with CheckFree+).
    """

    async def snapshot(part: str) -> StageState:
        if part == "edge_copy":
            if edge_copies is None:
                raise StateUnavailable(f"stage {worker.stage} keeps no edge copy")
            return edge_copies.snapshot()
        if me.state != PeerState.ONLINE:
            raise StateUnavailable(f"this peer is {me.state}, not online")
        if part == "stage":
            return await snapshot_worker(worker, gossip(), me.outer_round)
        if worker.stage != 0:
            raise StateUnavailable(f"part {part!r} is a piece of stage 0, this peer serves stage {worker.stage}")
        keys = EMBED_KEYS if part == "embed" else HEAD_KEYS

        def take() -> StageState:
            weights = dict(worker.module.state_dict())
            return StageState(stage=0, weights={k: weights[k].detach().to("cpu", copy=True) for k in keys},
                              inner_step=worker.inner_step, grad_norm=worker.last_grad_norm)

        return await asyncio.get_running_loop().run_in_executor(worker.executor, take)

    return snapshot


async def adopt_state(worker, state: StageState, gossip=None) -> None:
    """Make `worker` continue where the donor is: its weights (fresh inner optimizer: moments are
    never transferred), its schedule position and lr scale, and the gossip outer state."""

    def load() -> None:
        worker.load_state_dict(state.weights, fresh_optimizer=True)
        worker.inner_step = state.inner_step
        worker.last_grad_norm = state.grad_norm
        worker.set_lr_scale(state.lr_scale)
        if gossip is not None and state.outer:
            gossip.import_outer(state.outer, state.outer_round)

    await asyncio.get_running_loop().run_in_executor(worker.executor, load)


async def join_live_stage(service, attempts: int = 3, rounds: int = 5, retry_every: float = 2.0) -> bool:
    """Before a peer of a live stage goes online: download the stage's state from one of its online
    peers and adopt it (`service` is a StageService; its record stays `joining` meanwhile, so
    nobody routes to it or gossips with it). Up to `attempts` donors per round; between rounds the
    swarm view is refreshed (donors die, others join). Returns False when no donor is left (the
    stage is lost: the caller rebuilds it instead); raises TransportError after `rounds` failed rounds.
    """
    me, worker = service.me, service.worker
    shapes = await asyncio.get_running_loop().run_in_executor(
        worker.executor, lambda: {name: tuple(t.shape) for name, t in worker.module.state_dict().items()}
    )
    rng = random.Random()
    for round_index in range(1, rounds + 1):
        donors = service.view.online(me.stage, exclude=me.peer_id)
        if not donors:
            return False
        try:
            state = await download_from_any(service.transport, donors, me.stage, "stage", rng, attempts, expect=shapes)
        except TransportError as e:
            if round_index == rounds:
                raise
            logger.warning(f"joining stage {me.stage}: {e}; retrying in {retry_every:.0f} s")
            await asyncio.sleep(retry_every)
            await service.view.refresh()
            continue
        await adopt_state(worker, state, getattr(service, "gossip", None))
        me.restore_counters(state.inner_step, state.outer_round)
        logger.info(f"joined live stage {me.stage} at inner step {state.inner_step}, outer round {state.outer_round}")
        return True
    return False

"""NoLoCo gossip: every H inner steps, average outer weights with one random live peer of the stage.

Reads beside Kolehmainen et al., "NoLoCo: No-all-reduce Low Communication Training Method for Large
Models" (2025) and docs/gossip.md (the round protocol). The arithmetic is node/averaging/noloco.py; this
module only finds partners, moves tensors and decides when a round counts.

One noloco round, initiator A and responder B, on one `gossip` session (a libp2p stream):

    A: snapshot theta_A (executor) -> GOSSIP_REQUEST -> B: BUSY, ERROR, or snapshot theta_B + ACCEPT
    both at once: send own phi and Delta as GOSSIP_CHUNKs / receive the partner's
    both: validate what arrived (executor)
    A -> B: GOSSIP_DONE{accept, reason};  B -> A: GOSSIP_DONE{accept, reason}
    B applies after sending its DONE, A after receiving it (only when both accepted)

Any failure before that (timeout, disconnect, BUSY, rejection) leaves both peers' weights as they
were. The one window left: B has sent an accepting DONE and applied, the stream dies before A reads
it, A does not apply (a one-sided round: B moved toward A, A did not move; harmless, see the doc).

Inner steps keep running on the worker's executor while tensors move. Delta is taken from the
snapshot at the round start; whatever the inner optimizer did since the snapshot (theta_now -
theta_snap) is carried over onto the new phi, so no local progress is lost and the next round's
Delta counts it once.

Mode `diloco` (all live replicas average) uses the same service: the first replica due for round r
starts it, every member fetches every other member's Delta_r (a read-only fetch, many at once) and
takes DiLoCo's outer step with whatever it gathered in time. hivemind's DecentralizedAverager
would need hivemind.DHT's separate process, which this node does not run.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor

from dht.announcer import PeerAnnouncer
from dht.records import PeerState, SwarmEvent
from dht.registry import SwarmRegistry
from node.config import SwarmConfig
from node.averaging.noloco import (
    OuterState,
    apply_to_parameters,
    diloco_outer_step,
    outer_step,
    pseudo_gradient,
    relative_distance,
    validate_partner_update,
)
from node.pipeline.routing import BanList
from node.pipeline.stage_worker import StageWorker
from dht.swarm_view import SwarmView
from node.p2p.transport import Transport, TransportError
from protocol import Message, MessageKind, ProtocolError, recv_message, send_message
from node.runtime.timeouts import within

__all__ = ["Gossip", "RoundOutcome", "GOSSIP_SERVICE", "CHUNK_ELEMENTS", "WeightFingerprint"]

logger = logging.getLogger(__name__)

GOSSIP_SERVICE = "gossip"
CHUNK_ELEMENTS = 1 << 20  # 4 MiB of fp32 per GOSSIP_CHUNK
# phi travels uncompressed: replicas' phi differ by far less than fp16's relative 5e-4 rounding,
# so a compressed phi would swamp the very differences the pull term averages away
GOSSIP_COMPRESSION = "none"
MAX_PARTNER_TRIES = 3  # BUSY partners asked per attempt before backing off
POLL_SECONDS = 0.2  # how often the round loop checks the inner-step counter
FINGERPRINT_SIZE = 8
FINGERPRINT_COORDS = 1 << 14  # coordinates sampled by the fingerprint projection


@dataclass
class RoundOutcome:
    """What one round attempt did. status: applied | lone | busy | aborted | rejected | skipped."""

    status: str
    round: int
    partners: tuple[str, ...] = ()
    detail: str = ""
    divergence: float | None = None


@dataclass
class _Snapshot:
    """This replica at a round's start: the outer state it started from, theta and Delta."""

    state: OuterState
    theta: list[Tensor]
    delta: list[Tensor]
    inner_step: int
    has_progress: bool  # Delta is not all zero


class _Reject(Exception):
    """The partner's tensors failed validation: ban it and skip the round."""


class _Busy(Exception):
    """The partner is already exchanging (or has nothing to share yet)."""


class WeightFingerprint:
    """FINGERPRINT_SIZE floats: a fixed seeded random projection of a fixed seeded sample of the
    flattened parameters. Replicas of a stage use the same seed, so ||f_a - f_b|| / ||f_a|| tracks
    their relative distance without any gossip (how the none-mode divergence is measured). The
    sample (FINGERPRINT_COORDS coordinates, drawn with replacement) keeps the cost independent of
    the model size. Reads the module: call through the worker's executor."""

    def __init__(self, shapes: Sequence[torch.Size], seed: int):
        sizes = [math.prod(shape) for shape in shapes]
        total = sum(sizes)
        gen = torch.Generator().manual_seed(seed)
        count = min(total, FINGERPRINT_COORDS)
        coords = torch.randint(0, total, (count,), generator=gen).sort().values
        self.projection = torch.randn(FINGERPRINT_SIZE, count, generator=gen) / math.sqrt(count)
        starts = torch.tensor([0, *itertools.accumulate(sizes)])
        owner = torch.bucketize(coords, starts[1:], right=True)  # which tensor each coordinate is in
        self.local = [coords[owner == k] - starts[k] for k in range(len(sizes))]

    def __call__(self, params: Sequence[Tensor]) -> list[float]:
        with torch.no_grad():
            sample = torch.cat([p.detach().reshape(-1)[idx].to(torch.float32) for p, idx in zip(params, self.local)])
            return [float(v) for v in self.projection @ sample]


class Gossip:
    """One replica's outer optimizer and its gossip rounds (serving and initiating)."""

    def __init__(
        self,
        config: SwarmConfig,
        me: PeerAnnouncer,
        worker: StageWorker,
        transport: Transport,
        view: SwarmView,
        bans: BanList,
        registry: SwarmRegistry,
        ban_until: Callable[[str], float],
        rng: random.Random | None = None,
    ):
        self.config = config
        self.settings = config.gossip
        self.me = me
        self.worker = worker
        self.transport = transport
        self.view = view
        self.bans = bans
        self.registry = registry
        self.ban_until = ban_until
        self.rng = rng or random.Random()
        self._params = list(worker.module.parameters())
        self._names = [name for name, _ in worker.module.named_parameters()]
        with torch.no_grad():  # nothing trains before the service starts: safe off the executor
            self.outer_state = OuterState.from_parameters(self._params)
        self.last_partner: str | None = None
        self.divergence: float | None = None
        self.fingerprint: list[float] | None = None
        self._fingerprint = WeightFingerprint([p.shape for p in self._params], config.seed * 1009 + me.stage)
        self.history: deque[RoundOutcome] = deque(maxlen=256)
        self._round_start_step = worker.inner_step
        self._exchanging = False  # noloco: one exchange at a time, as initiator or responder
        self._published: tuple[int, _Snapshot] | None = None  # diloco: my Delta for a round
        self._diloco_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        await self.transport.serve_sessions(GOSSIP_SERVICE, self._on_session)

    async def run(self) -> None:
        """Initiate rounds whenever H inner steps passed since the last one (until cancelled).

        A due round whose partners are all busy is retried after a short random pause; one due for
        longer than round_timeout without a partner is taken alone (n = 1)."""
        if self.settings.mode == "none":
            return
        due_since: float | None = None
        try:
            while True:
                await asyncio.sleep(POLL_SECONDS)
                if self.me.state != PeerState.ONLINE or self.steps_since_round < self.settings.inner_steps:
                    due_since = None
                    continue
                if self._exchanging or (self._diloco_task is not None and not self._diloco_task.done()):
                    continue
                due_since = due_since or time.monotonic()
                # bounded wait for a free partner: in time, and in steps (a Delta of many more
                # steps than the partners' would fail their norm check)
                alone_ok = (time.monotonic() - due_since > self.settings.round_timeout
                            or self.steps_since_round >= 2 * self.settings.inner_steps)
                if self.settings.mode == "diloco":
                    outcome = await self._start_diloco_round(self.outer_state.round)
                else:
                    outcome = await self.run_round(alone_if_busy=alone_ok)
                if outcome.status in ("applied", "lone"):
                    due_since = None
                else:
                    await asyncio.sleep(self.rng.uniform(0.2, 1.0))
        finally:
            await self.close()

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._diloco_task] if self._diloco_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def steps_since_round(self) -> int:
        return self.worker.inner_step - self._round_start_step

    def _ripe(self, partner_steps: int) -> bool:
        """Has this replica trained enough since its last round to answer a partner that took
        `partner_steps` inner steps? At least half of H and a quarter of the partner's: a Delta
        from a handful of steps would be so small that validate_partner_update would reject an
        honest partner's full-round Delta as 'far beyond the local norm'."""
        return self.steps_since_round >= max(1, self.settings.inner_steps // 2, partner_steps // 4)

    # ---- outer state for state download (recovery) --------------------------------------------

    def export_outer(self) -> dict[str, Tensor]:
        """{"phi.<param name>", "momentum.<param name>"} -> fp32 tensors (not copies: an OuterState's
        tensors are never modified in place, every outer step makes new ones)."""
        state = self.outer_state
        out = {f"phi.{n}": t for n, t in zip(self._names, state.phi)}
        out.update({f"momentum.{n}": t for n, t in zip(self._names, state.momentum)})
        return out

    def import_outer(self, tensors: dict[str, Tensor], round: int) -> None:
        """Adopt a downloaded outer state (ValueError if names, shapes or values are wrong). Only
        the outer state: the caller loads theta (worker.load_state_dict). The next round is due H
        inner steps from now; a round in flight when this is called is discarded."""
        if isinstance(round, bool) or not isinstance(round, int) or round < 0:
            raise ValueError(f"round must be an int >= 0, got {round!r}")
        expected = {f"{kind}.{n}" for kind in ("phi", "momentum") for n in self._names}
        if set(tensors) != expected:
            raise ValueError(f"outer state names differ: missing {sorted(expected - set(tensors))[:3]}, "
                             f"unexpected {sorted(set(tensors) - expected)[:3]}")
        columns = {}
        for kind in ("phi", "momentum"):
            column = []
            for name, param in zip(self._names, self._params):
                t = tensors[f"{kind}.{name}"]
                if not isinstance(t, Tensor) or t.shape != param.shape or not t.is_floating_point():
                    raise ValueError(f"{kind}.{name}: expected a float tensor of shape {tuple(param.shape)}")
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{kind}.{name}: holds NaN or Inf")
                column.append(t.detach().to("cpu", torch.float32, copy=True))
            columns[kind] = column
        self.outer_state = OuterState(phi=columns["phi"], momentum=columns["momentum"], round=round)
        self._round_start_step = self.worker.inner_step
        self._published = None

    async def reset_outer(self) -> None:
        """phi <- the current weights, zero momentum, same round (after weights were replaced without
        an outer state, e.g. a CheckFree rebuild): otherwise Delta = old phi - new theta would be
        huge and every honest partner would reject it."""
        state = await self._compute(OuterState.from_parameters, self._params)
        state.round = self.outer_state.round
        self.outer_state = state
        self._round_start_step = self.worker.inner_step
        self._published = None

    # ---- measurements published in the DHT ----------------------------------------------------

    async def refresh_fingerprint(self) -> None:
        self.fingerprint = await self._compute(self._fingerprint, self._params)

    # ---- executor work ------------------------------------------------------------------------

    async def _compute(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self.worker.executor, fn, *args)

    def _take_snapshot(self) -> _Snapshot:
        state = self.outer_state
        with torch.no_grad():
            theta = [p.detach().to(torch.float32, copy=True) for p in self._params]
        delta = pseudo_gradient(state, theta)
        has_progress = any(bool(d.any()) for d in delta)
        return _Snapshot(state, theta, delta, self.worker.inner_step, has_progress)

    def _check_partner(self, snap: _Snapshot, phi: list[Tensor], delta: list[Tensor]) -> tuple[str | None, float | None]:
        reason = validate_partner_update(snap.state.phi, snap.delta, phi, delta, self.settings.max_norm_factor)
        if reason is not None:
            return reason, None
        return None, relative_distance(snap.state.phi, phi)

    def _apply(self, snap: _Snapshot, new_state: OuterState) -> bool:
        """phi <- new phi; theta <- new phi + the inner progress made since the snapshot."""
        if self.outer_state is not snap.state:  # an imported outer state replaced ours meanwhile
            return False
        with torch.no_grad():
            progress = [p.detach().to(torch.float32) - t for p, t in zip(self._params, snap.theta)]
            apply_to_parameters(new_state, self._params)
            for p, d in zip(self._params, progress):
                p.add_(d.to(p.dtype))
        self.outer_state = new_state
        return True

    async def _finish(self, snap: _Snapshot, new_state: OuterState, outcome: RoundOutcome) -> RoundOutcome:
        if not await self._compute(self._apply, snap, new_state):
            return self._record(RoundOutcome("aborted", snap.state.round, outcome.partners, "outer state replaced"))
        self._round_start_step = snap.inner_step
        if outcome.partners:
            self.last_partner = outcome.partners[0] if len(outcome.partners) == 1 else self.last_partner
            self.divergence = outcome.divergence
        return self._record(outcome)

    def _record(self, outcome: RoundOutcome) -> RoundOutcome:
        self.history.append(outcome)
        if outcome.status in ("applied", "lone"):
            who = ",".join(p[-8:] for p in outcome.partners) or "alone"
            div = "" if outcome.divergence is None else f", divergence {outcome.divergence:.3g}"
            logger.info(f"outer round {outcome.round} -> {outcome.round + 1} with {who}{div}")
        elif outcome.status in ("aborted", "rejected"):
            logger.info(f"gossip round {outcome.round} {outcome.status}: {outcome.detail}")
        return outcome

    # ---- reporting -----------------------------------------------------------------------------

    def _reject(self, peer_id: str, reason: str) -> None:
        """Ban a peer whose tensors failed validation and tell the dashboard."""
        self.bans.ban(peer_id, self.ban_until(peer_id), f"gossip: {reason}")
        logger.warning(f"rejected gossip from {peer_id[-8:]} and banned it: {reason}")
        self._publish_event("ban", peer_id, f"gossip from {peer_id[-8:]} rejected by {self.me.peer_id[-8:]}: {reason}")

    def _publish_event(self, kind: str, peer_id: str, detail: str) -> None:
        event = SwarmEvent(time.time(), kind, peer_id, self.me.stage, detail[:500])

        async def publish() -> None:
            try:
                await within(self.registry.publish_event(event), 10.0)
            except Exception as e:  # the event list is best effort
                logger.debug(f"could not publish {kind} event: {e!r}")

        task = asyncio.create_task(publish())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- noloco: initiator ---------------------------------------------------------------------

    def _candidates(self) -> list[str]:
        peers = [p.peer_id for p in self.view.online(self.me.stage, exclude=self.me.peer_id)
                 if not self.bans.is_banned(p.peer_id)]
        self.rng.shuffle(peers)
        return peers

    async def run_round(self, partner: str | None = None, alone_if_busy: bool = False) -> RoundOutcome:
        """One noloco round now: with `partner`, or a uniformly random live, unbanned peer of this
        stage (another one if it answers BUSY), or alone when the stage has no other live peer."""
        round_ = self.outer_state.round
        if self._exchanging:
            return RoundOutcome("busy", round_, detail="already exchanging")
        self._exchanging = True
        try:
            snap = await self._compute(self._take_snapshot)
            if not snap.has_progress:
                return self._record(RoundOutcome("skipped", round_, detail="no inner step since the last round"))
            candidates = [partner] if partner is not None else self._candidates()
            if not candidates:
                return await self._lone_step(snap)
            for peer in candidates[:MAX_PARTNER_TRIES]:
                try:
                    return await within(self._exchange_as_initiator(peer, snap), self.settings.round_timeout)
                except _Busy:
                    continue
                except _Reject as e:
                    self._reject(peer, str(e))
                    return self._record(RoundOutcome("rejected", round_, (peer,), str(e)))
                except (TransportError, ProtocolError, EOFError, ConnectionError, OSError,
                        asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
                    detail = f"exchange with {peer[-8:]} failed: {e!r}"[:300]
                    self._publish_event("gossip_failure", self.me.peer_id, detail)
                    return self._record(RoundOutcome("aborted", round_, (peer,), detail))
            if alone_if_busy:
                return await self._lone_step(snap)
            return self._record(RoundOutcome("busy", round_, detail="every partner asked was busy"))
        finally:
            self._exchanging = False

    async def _lone_step(self, snap: _Snapshot) -> RoundOutcome:
        s = self.settings
        new_state = await self._compute(outer_step, snap.state, snap.delta, [], [], s.outer_momentum,
                                        s.outer_lr, s.pull_coefficient)
        return await self._finish(snap, new_state, RoundOutcome("lone", snap.state.round))

    def _request_meta(self, round_: int, steps: int = 0) -> dict:
        """`steps`: the inner steps the sender's Delta covers (lets the partner judge ripeness)."""
        return {"round": round_, "num_tensors": len(self._params),
                "total_numel": sum(p.numel() for p in self._params), "mode": self.settings.mode, "steps": steps}

    async def _exchange_as_initiator(self, peer: str, snap: _Snapshot) -> RoundOutcome:
        t = self.transport
        timeout = self.settings.round_timeout
        async with t.session(peer, GOSSIP_SERVICE, timeout) as (reader, writer):
            steps = snap.inner_step - self._round_start_step
            await self._send(writer, t.message(MessageKind.GOSSIP_REQUEST, self._request_meta(snap.state.round, steps)))
            reply = await self._recv(reader)
            if reply.kind == MessageKind.BUSY:
                raise _Busy()
            if reply.kind == MessageKind.ERROR:
                raise TransportError(f"{peer[-8:]} refused: {reply.meta.get('reason')}")
            if reply.kind != MessageKind.GOSSIP_ACCEPT:
                raise ProtocolError(f"expected gossip_accept, got {reply.kind.value}")
            phi, delta = await self._swap(reader, writer, snap)
            reason, divergence = await self._compute(self._check_partner, snap, phi, delta)
            await self._send(writer, self._done(snap, reason))
            theirs = await self._expect(reader, MessageKind.GOSSIP_DONE)
        if reason is not None:
            raise _Reject(reason)
        if not theirs.meta.get("accept"):
            raise TransportError(f"{peer[-8:]} declined the round: {theirs.meta.get('reason')}")
        return await self._step_with(snap, peer, phi, delta, divergence)

    async def _step_with(self, snap: _Snapshot, peer: str, phi: list[Tensor], delta: list[Tensor],
                         divergence: float | None) -> RoundOutcome:
        s = self.settings
        new_state = await self._compute(outer_step, snap.state, snap.delta, [phi], [delta], s.outer_momentum,
                                        s.outer_lr, s.pull_coefficient)
        return await self._finish(snap, new_state, RoundOutcome("applied", snap.state.round, (peer,),
                                                                divergence=divergence))

    # ---- the wire ------------------------------------------------------------------------------

    async def _send(self, writer: asyncio.StreamWriter, message: Message) -> None:
        await send_message(writer, message, GOSSIP_COMPRESSION, self.transport.limits)

    async def _recv(self, reader: asyncio.StreamReader) -> Message:
        return await recv_message(reader, self.transport.limits, self.transport.swarm_id)

    async def _expect(self, reader: asyncio.StreamReader, kind: MessageKind) -> Message:
        message = await self._recv(reader)
        if message.kind == MessageKind.ERROR:
            raise TransportError(f"partner aborted: {message.meta.get('reason')}")
        if message.kind != kind:
            raise ProtocolError(f"expected {kind.value}, got {message.kind.value}")
        return message

    def _done(self, snap: _Snapshot, reason: str | None) -> Message:
        meta = {"round": snap.state.round, "accept": reason is None, "reason": (reason or "")[:500]}
        return self.transport.message(MessageKind.GOSSIP_DONE, meta)

    async def _swap(self, reader, writer, snap: _Snapshot) -> tuple[list[Tensor], list[Tensor]]:
        """Send my phi and Delta while receiving the partner's (both directions at once)."""
        sending = asyncio.create_task(self._send_tensors(writer, snap.state.round, [*snap.state.phi, *snap.delta]))
        receiving = asyncio.create_task(self._recv_tensors(reader, 2 * len(self._params)))
        try:
            done, _ = await asyncio.wait({sending, receiving}, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            await sending
            tensors = await receiving
        finally:
            for task in (sending, receiving):
                task.cancel()
            await asyncio.gather(sending, receiving, return_exceptions=True)
        return tensors[: len(self._params)], tensors[len(self._params):]

    async def _send_tensors(self, writer: asyncio.StreamWriter, round_: int, tensors: Sequence[Tensor]) -> None:
        for index, tensor in enumerate(tensors):
            flat = tensor.detach().reshape(-1)
            for offset in range(0, flat.numel(), CHUNK_ELEMENTS):
                chunk = flat[offset: offset + CHUNK_ELEMENTS]
                meta = {"round": round_, "index": index, "offset": offset}
                await self._send(writer, self.transport.message(MessageKind.GOSSIP_CHUNK, meta, {"chunk": chunk}))

    async def _recv_tensors(self, reader: asyncio.StreamReader, count: int) -> list[Tensor]:
        """`count` tensors shaped like my parameters (phi..., then Delta...), in order, chunk by
        chunk; every chunk's place and size is checked before it is copied."""
        shapes = [p.shape for p in self._params] * (count // len(self._params))
        out = []
        for index, shape in enumerate(shapes):
            buffer = torch.empty(shape, dtype=torch.float32)
            flat = buffer.view(-1)
            offset = 0
            while offset < flat.numel():
                message = await self._expect(reader, MessageKind.GOSSIP_CHUNK)
                chunk = message.tensors["chunk"]
                if message.meta["index"] != index or message.meta["offset"] != offset:
                    raise ProtocolError(f"chunk for tensor {message.meta['index']} at {message.meta['offset']}, "
                                        f"expected tensor {index} at {offset}")
                if chunk.dim() != 1 or not 0 < chunk.numel() <= flat.numel() - offset or not chunk.is_floating_point():
                    raise ProtocolError(f"bad chunk for tensor {index}: {chunk.dtype} {tuple(chunk.shape)}")
                flat[offset: offset + chunk.numel()].copy_(chunk)
                offset += chunk.numel()
            out.append(buffer)
        return out

    # ---- serving -------------------------------------------------------------------------------

    async def _on_session(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await within(self._recv(reader), self.settings.round_timeout)
        refusal = self._refusal(sender, request)
        if refusal is not None:
            await self._send(writer, self.transport.error(refusal, request.request_id))
            return
        if self.settings.mode == "diloco":
            await within(self._serve_diloco(sender, request, writer), self.settings.round_timeout)
            return
        steps = request.meta.get("steps")
        partner_steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else 0
        if self._exchanging or not self._ripe(partner_steps) or self.me.state != PeerState.ONLINE:
            await self._send(writer, self.transport.message(MessageKind.BUSY, request_id=request.request_id))
            return
        self._exchanging = True
        try:
            await within(self._exchange_as_responder(sender, reader, writer), self.settings.round_timeout)
        except _Reject as e:
            self._reject(sender, str(e))
            self._record(RoundOutcome("rejected", self.outer_state.round, (sender,), str(e)))
        except (TransportError, ProtocolError, EOFError, ConnectionError, OSError,
                asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            self._record(RoundOutcome("aborted", self.outer_state.round, (sender,), f"as responder: {e!r}"[:300]))
        finally:
            self._exchanging = False

    def _refusal(self, sender: str, request: Message) -> str | None:
        if request.kind != MessageKind.GOSSIP_REQUEST:
            return f"expected gossip_request, got {request.kind.value}"
        if self.settings.mode == "none":
            return "gossip is disabled on this peer"
        if request.sender_stage != self.me.stage:
            return f"this peer serves stage {self.me.stage}, not {request.sender_stage}"
        if self.bans.is_banned(sender):
            return "banned"
        mine = self._request_meta(0)
        for key in ("num_tensors", "total_numel", "mode"):
            if request.meta.get(key) != mine[key]:
                return f"{key} {request.meta.get(key)!r} != {mine[key]!r}"
        return None

    async def _exchange_as_responder(self, sender: str, reader, writer) -> None:
        snap = await self._compute(self._take_snapshot)
        if not snap.has_progress:
            await self._send(writer, self.transport.message(MessageKind.BUSY))
            return
        await self._send(writer, self.transport.message(MessageKind.GOSSIP_ACCEPT, {"round": snap.state.round}))
        phi, delta = await self._swap(reader, writer, snap)
        reason, divergence = await self._compute(self._check_partner, snap, phi, delta)
        theirs = await self._expect(reader, MessageKind.GOSSIP_DONE)
        await self._send(writer, self._done(snap, reason))
        if reason is not None:
            raise _Reject(reason)
        if not theirs.meta.get("accept"):
            raise TransportError(f"{sender[-8:]} declined the round: {theirs.meta.get('reason')}")
        await self._step_with(snap, sender, phi, delta, divergence)

    # ---- diloco: every live replica of the stage -----------------------------------------------

    async def _start_diloco_round(self, round_: int) -> RoundOutcome:
        """Run my diloco round `round_` (one at a time) and wait for it: snapshot, publish my Delta,
        fetch everyone else's, step."""
        if self._diloco_task is None or self._diloco_task.done():
            self._diloco_task = asyncio.create_task(self._diloco_round(round_))
        return await asyncio.shield(self._diloco_task)

    async def _diloco_round(self, round_: int) -> RoundOutcome:
        snap = await self._compute(self._take_snapshot)
        if not snap.has_progress:
            return self._record(RoundOutcome("skipped", round_, detail="no inner step since the last round"))
        self._published = (round_, snap)
        members = self._candidates()
        fetched = await asyncio.gather(*(self._fetch_delta(peer, round_, snap) for peer in members))
        group = [(peer, delta) for peer, delta in zip(members, fetched) if delta is not None]
        s = self.settings
        new_state = await self._compute(diloco_outer_step, snap.state, [snap.delta, *(d for _, d in group)],
                                        s.outer_momentum, s.outer_lr)
        status = "applied" if group else "lone"
        return await self._finish(snap, new_state, RoundOutcome(status, round_, tuple(p for p, _ in group)))

    async def _fetch_delta(self, peer: str, round_: int, snap: _Snapshot) -> list[Tensor] | None:
        """Peer's Delta for `round_`, or None (it failed, is elsewhere in time, or sent garbage)."""
        t = self.transport
        try:
            async def fetch() -> list[Tensor]:
                async with t.session(peer, GOSSIP_SERVICE, self.settings.round_timeout) as (reader, writer):
                    await self._send(writer, t.message(MessageKind.GOSSIP_REQUEST, self._request_meta(round_)))
                    await self._expect(reader, MessageKind.GOSSIP_ACCEPT)
                    delta = await self._recv_tensors(reader, len(self._params))
                    await self._expect(reader, MessageKind.GOSSIP_DONE)
                    return delta

            delta = await within(fetch(), self.settings.round_timeout)
        except (TransportError, ProtocolError, EOFError, ConnectionError, OSError,
                asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            logger.info(f"diloco round {round_}: no Delta from {peer[-8:]}: {e!r}")
            return None
        # all replicas share phi in diloco: check the partner's Delta against ours
        reason, _ = await self._compute(self._check_partner, snap, snap.state.phi, delta)
        if reason is not None:
            self._reject(peer, reason)
            return None
        return delta

    async def _serve_diloco(self, sender: str, request: Message, writer) -> None:
        """Stream my Delta for the requested round; a request for my current round starts it."""
        wanted = request.meta["round"]
        if self._published is None or self._published[0] != wanted:
            running = self._diloco_task is not None and not self._diloco_task.done()
            if not running:
                if wanted < self.outer_state.round or not self.steps_since_round or self.me.state != PeerState.ONLINE:
                    await self._send(writer, self.transport.error(f"no Delta for round {wanted}", request.request_id))
                    return
                # a peer may be ahead of our round counter (we missed rounds): round labels only
                # group Deltas, so take its number
                self.outer_state.round = wanted
                self._diloco_task = asyncio.create_task(self._diloco_round(wanted))
            # our round is starting (its snapshot goes through the executor): wait for its Delta
            while self._published is None or self._published[0] != wanted:
                if self._diloco_task is None or self._diloco_task.done():
                    await self._send(writer, self.transport.error(f"no Delta for round {wanted}", request.request_id))
                    return
                await asyncio.sleep(0.01)
        published = self._published
        snap = published[1]
        await self._send(writer, self.transport.message(MessageKind.GOSSIP_ACCEPT, {"round": wanted}))
        await self._send_tensors(writer, wanted, snap.delta)
        await self._send(writer, self.transport.message(MessageKind.GOSSIP_DONE, {"round": wanted}))

"""SWARM pipeline traffic: activations forward along a randomly routed chain of peers, gradients back.

A microbatch's life (path = the peers it visited, path[0] its stage-0 origin):
  origin embeds -> FORWARD to a peer of stage order[0] (hop 1) -> ... each peer runs its stage and
  forwards to a routed choice among the next stage's peers ... the last block stage sends the
  final hidden states back to the origin (hop len(order)+1), which computes the loss and sends
  BACKWARD to path[-1]; every peer backpropagates and passes the gradient to the peer before it,
  down to the origin, which finishes the embedding's backward. `order` is the stage order of this
  microbatch (CheckFree+ swaps edge block stages on odd microbatches).

Every attempt carries a random `token` chosen by its origin; only peers on the microbatch's path
see it, so only they can abort the microbatch or hand its results back to the origin (a stranger
who guesses a microbatch id cannot). A tensor a worker rejects (non-finite, absurd, misshapen) is
a strike against the peer that sent it (node/p2p/peer_conduct.py); repeated strikes ban it.

Each hop is posted (node/pipeline/hops.py): the receiver queues the work and answers only to refuse
it, so no peer waits for a round trip and a taken hop costs one frame. A send that errors, or is
refused with an ERROR, bans that peer until its DHT record expires and goes to another peer of the
stage; a send that times out or is refused BUSY goes to another peer without a ban, as SWARM does (a
slow or momentarily overloaded peer is not a faulty one; docs/algorithms.md, "SWARM routing"); all
within bounded retries. A microbatch lost past its hop's refusal window (a peer died or hung holding
it) is told to its origin where a peer on the path can, and otherwise noticed by the origin's
deadline, and run again from the start under a new id.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable
from enum import StrEnum
from functools import partial

import torch

from dht.announcer import PeerAnnouncer
from dht.records import PeerState, short_peer_id
from node.config import SwarmConfig, TrainingConfig
from node.model.data import TokenSource
from node.p2p.transport import Transport, TransportError
from node.pipeline.abort_notices import AbortNotices
from node.pipeline.contracts import ABORT_CONTRACT, BACKWARD_CONTRACT, FORWARD_CONTRACT
from node.pipeline.fair_turns import FairTurns
from node.pipeline.hops import HopSender, PipelineStats
from node.pipeline.in_flight import InFlight, ticket_for, ticket_named_by
from node.pipeline.in_flight_window import InFlightWindow, keep_in_flight
from node.pipeline.link_compression import LinkCompression
from node.pipeline.order import pipeline_order, visits_every_block_stage
from node.pipeline.receipts import ReceiptKeeper
from node.pipeline.retry_pause import RetryPause
from node.pipeline.routing import Router
from node.pipeline.token_anchors import carried_token_ids, hop_token_ids
from node.pipeline.verifier import Verifier
from node.runtime.tasks import BackgroundTasks
from node.runtime.timeouts import within
from node.stage.activation_store import UnknownMicrobatch
from node.stage.admission import RejectedInput
from node.stage.forward_only import eval_embed, eval_forward, eval_loss
from node.stage.stage_worker import StageWorker
from protocol import (
    ANCHOR_IDS,
    BackwardHeader,
    ForwardHeader,
    Message,
    MessageKind,
    MicrobatchHeader,
    MicrobatchPurpose,
    ProtocolError,
)

logger = logging.getLogger(__name__)


class PipelineService(StrEnum):
    """The stream handlers of pipeline traffic (one libp2p protocol each, node/p2p/transport.py)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    ABORT = "abort"


FORWARD, BACKWARD, ABORT = PipelineService.FORWARD, PipelineService.BACKWARD, PipelineService.ABORT


def _no_op() -> None:
    pass


Handler = Callable[[str, Message], Message]
ForwardHandler = Callable[[str, ForwardHeader, Message], Message]
BackwardHandler = Callable[[str, BackwardHeader, Message], Message]


def _forward_service(on_forward: ForwardHandler, verifier: Verifier | None) -> Handler:
    """The FORWARD service's handler: `on_forward` with the hop's header read once, and a training
    microbatch's output from a block-stage peer, once taken, shown to the verifier: this peer is
    that hop's next peer (node/pipeline/hop_observations.py)."""

    def handle(sender: str, msg: Message) -> Message:
        header = ForwardHeader.from_meta(msg.meta)
        reply = on_forward(sender, header, msg)
        if verifier is not None and reply.kind == MessageKind.ACK and header.hop >= 2 and header.trains:
            stage = header.order[header.hop - 2]  # hop 1 came from the origin; the final hop from the last block stage
            verifier.forward_received(
                stage,
                sender,
                header.origin,
                header.microbatch_id,
                header.token,
                msg.tensors["hidden"],
                msg.tensors.get(ANCHOR_IDS),
            )
        return reply

    return handle


def _backward_service(on_backward: BackwardHandler, verifier: Verifier | None) -> Handler:
    """The BACKWARD service's handler: `on_backward` with the hop's header read once, and the
    gradient a block-stage peer returns for the input this peer sent it, once taken, shown to the
    verifier: this peer is that hop's previous peer."""

    def handle(sender: str, msg: Message) -> Message:
        header = BackwardHeader.from_meta(msg.meta)
        reply = on_backward(sender, header, msg)
        # from the next peer on the path, not the origin
        if verifier is not None and reply.kind == MessageKind.ACK and header.hop + 1 < len(header.path):
            verifier.backward_received(sender, header.origin, header.microbatch_id, msg.tensors["grad"])
        return reply

    return handle


def _hop_sender(
    training: TrainingConfig,
    transport: Transport,
    router: Router,
    stats: PipelineStats,
    ban_until: Callable[[str], float],
    unreachable: Callable[[], set[str]],
    verifier: Verifier | None,
) -> HopSender:
    """The pipeline's sender of hops, with the swarm's retries and timeouts, and each hop's encoding
    chosen from this peer's uplink load (int8 while fp16 would keep its links busy)."""
    wire = LinkCompression(training.wire_compression, training.slow_link_compression, transport.channels.link_capacity)
    return HopSender(
        transport,
        router,
        stats,
        training.hop_timeout,
        training.max_retries,
        ban_until,
        unreachable,
        verifier,
        compression=wire,
    )


class Pipeline:
    def __init__(
        self,
        config: SwarmConfig,
        transport: Transport,
        worker: StageWorker,
        router: Router,
        me: PeerAnnouncer,
        *,
        rng: random.Random | None = None,
        ban_until: Callable[[str], float] | None = None,
        max_queue: int | None = None,
        refusal: Callable[[str, int], str | None] | None = None,
        unreachable: Callable[[], set[str]] = set,
        verifier: Verifier | None = None,
        receipts: ReceiptKeeper | None = None,  # a block stage's record of what it computed, for checks
        max_in_flight: int | None = None,  # the window's ceiling here: less than the swarm's where memory is short
    ):
        self.config = config
        self.transport = transport
        self.worker = worker
        self.router = router
        self.me = me
        self.rng = rng or random.Random()
        self.ban_until = ban_until or (lambda peer_id: time.time() + config.heartbeat.ttl)
        # why a peer may not send us a microbatch from a stage (node/p2p/membership.py): compute
        # is spent only on members' microbatches
        self.refusal = refusal or (lambda peer_id, stage: None)
        training = config.training
        deadline = training.hop_timeout * config.num_stages  # a microbatch's: through every stage, back to us
        self.window = InFlightWindow(training.min_in_flight, max_in_flight or training.max_in_flight, deadline)
        self.max_queue = max_queue or self.window.ceiling
        self.num_block_stages = config.num_stages - 1
        self.in_flight: dict[int, InFlight] = {}
        self.stats = PipelineStats()
        self.receipts = receipts
        self.hops = _hop_sender(training, transport, router, self.stats, self.ban_until, unreachable, verifier)
        self._microbatch_ids = itertools.count(self.rng.randrange(1 << 40))
        self._microbatch_index = itertools.count()
        self._queued = 0
        self.retry = RetryPause(training.max_retries, config.heartbeat, deadline)  # node/pipeline/retry_pause.py
        # a block stage's compute, shared fairly among the origins whose microbatches wait for it
        self._turns = FairTurns()
        self._tasks = BackgroundTasks()
        notify = self.hops.notify_abort  # who may be told is AbortNotices' to decide (no reflection)
        self.aborts = AbortNotices(lambda *notice: notify(notice[0], ABORT, *notice[1:]), self._tasks.spawn)

    # ---- serving -------------------------------------------------------------------------------

    async def start(self) -> None:
        # many small hops to the same few peers: one long-lived stream each (node/p2p/channels.py)
        self.transport.multiplex(FORWARD, BACKWARD, ABORT)
        forward = _forward_service(self.on_forward, self.hops.verifier)
        await self.transport.serve_requests(FORWARD, forward, FORWARD_CONTRACT)
        backward = _backward_service(self.on_backward, self.hops.verifier)
        await self.transport.serve_requests(BACKWARD, backward, BACKWARD_CONTRACT)
        await self.transport.serve_requests(ABORT, self.on_abort, ABORT_CONTRACT)

    def _ack(self, request: Message) -> Message:
        return self.transport.message(MessageKind.ACK, request_id=request.request_id)

    def on_forward(self, sender: str, header: ForwardHeader, msg: Message) -> Message:
        """A FORWARD whose header `_forward_service` read: an unknown purpose was a ProtocolError
        there, not a failure later."""
        order, path, hop = header.order, header.path, header.hop
        if not visits_every_block_stage(order, self.num_block_stages):
            raise ProtocolError(f"bad stage order {list(order)}")
        # the path runs from its origin to the sender: abort notices and gradients follow it
        if not 1 <= hop <= len(order) + 1 or len(path) != hop or path[-1] != sender or path[0] != header.origin:
            raise ProtocolError(f"inconsistent hop {hop} for a path of {len(path)} peers from its origin")
        expected_stage = order[hop - 1] if hop <= len(order) else 0
        if expected_stage != self.me.stage or self.me.state != PeerState.ONLINE:
            return self.transport.error(
                f"this peer serves stage {self.me.stage} ({self.me.state}), not {expected_stage}"
            )
        if hop == len(order) + 1:
            if header.origin != self.me.peer_id or ticket_for(self.in_flight, header) is None:
                return self.transport.error("unknown microbatch")
            self._tasks.spawn(self._finish_forward(header, msg))
            return self._ack(msg)
        # the sender serves the stage before ours on this path, the origin stage 0; a stranger (or a
        # joiner our view has not seen yet) gets BUSY, not a strike: an honest sender asks another peer
        refusal = self.refusal(sender, order[hop - 2] if hop >= 2 else 0) or self.refusal(header.origin, 0)
        if refusal is not None:
            self.stats.busy_replies += 1
            return self.transport.message(MessageKind.BUSY, {"reason": refusal}, request_id=msg.request_id)
        if self._queued >= self.max_queue:
            self.stats.busy_replies += 1
            return self.transport.message(MessageKind.BUSY, request_id=msg.request_id)
        self._queued += 1
        self._tasks.spawn(self._run_block_forward(header, msg))
        return self._ack(msg)

    def on_backward(self, sender: str, header: BackwardHeader, msg: Message) -> Message:
        path, hop = header.path, header.hop
        if not 0 <= hop < len(path) or path[hop] != self.me.peer_id:
            raise ProtocolError(f"backward hop {hop} does not match its path")
        if sender != header.sender:
            raise ProtocolError("backward arrived from a peer that is not the next hop of its path")
        if not (ticket_for(self.in_flight, header) if hop == 0 else self.aborts.computed(header)):
            return self.transport.error("unknown microbatch")  # not computed here: no work, no notice to anyone
        self._tasks.spawn(self._run_backward(header, msg))
        return self._ack(msg)

    def on_abort(self, sender: str, msg: Message) -> Message:
        """A peer on a microbatch's path gave up on it: retry now instead of at the deadline. Only an
        ERROR naming a microbatch by id and token gets here (ABORT_CONTRACT, checked by the transport)."""
        ticket = ticket_named_by(self.in_flight, msg.meta.get("microbatch_id"), msg.meta.get("token"))
        # the ERROR schema makes "reason" a string (protocol/messages.py); shown, never parsed
        reason = f"{short_peer_id(sender)} gave up: {msg.meta['reason'][:200]}"
        if ticket is None:  # a block stage passes on a notice for a microbatch it handled; else nothing
            return self._ack(msg) if self.aborts.relay(msg.meta, reason) else self.transport.error("unknown microbatch")
        ticket.finish(error=TransportError(reason))
        return self._ack(msg)

    def _reject(self, sender: str, header: MicrobatchHeader, reason: str) -> None:
        """A tensor from `sender` was unusable: a strike against it, and the origin retries elsewhere."""
        self.transport.conduct.strike(sender, reason)
        self.aborts.tell_origin(header.origin, header.microbatch_id, header.token, reason, sender)

    async def _run_block_forward(self, header: ForwardHeader, msg: Message) -> None:
        key = (header.origin, header.microbatch_id)
        try:
            async with self._turns.turn(key[0]):
                if header.purpose is MicrobatchPurpose.EVAL:  # forward only: nothing stored, nothing to drop
                    hidden = await self.worker.compute(eval_forward, self.worker, msg.tensors["hidden"])
                elif self.receipts is not None:  # kept for a while: a check of this microbatch may come
                    hidden = await self.worker.compute(self.receipts.forward, key, header.token, msg.tensors["hidden"])
                else:
                    hidden = await self.worker.compute(self.worker.forward, key, msg.tensors["hidden"])
        except ValueError as e:  # a malformed tensor from a stranger: its origin will retry elsewhere
            logger.info(f"rejected forward from {short_peer_id(header.path[-1])}: {e}")
            self._reject(header.path[-1], header, f"forward rejected: {e}")
            return
        except Exception:
            logger.exception(f"forward of microbatch {header.microbatch_id} failed")
            self.aborts.tell_origin(*key, header.token, "forward failed", header.path[-1])
            return
        finally:
            self._queued -= 1
        self.aborts.handled(*key, header.token)
        next_stage = header.order[header.hop] if header.hop < len(header.order) else 0
        onward = header.next_hop(self.me.peer_id)
        tensors = {"hidden": hidden, **carried_token_ids(msg, self.config.training)}

        def lost() -> None:  # the header only: `msg` holds the tensors that came in
            self.worker.drop(key)
            if next_stage != 0:
                self.aborts.tell_origin(*key, header.token, f"no peer of stage {next_stage} took it")

        if next_stage == 0:
            sent = await self.hops.send_to(header.origin, FORWARD, onward, tensors, lost)
        else:
            sent = await self.hops.send_routed(next_stage, FORWARD, onward, tensors, lost)
        self.stats.forwarded += sent is not None

    async def _run_backward(self, header: BackwardHeader, msg: Message) -> None:
        hop = header.hop
        key = (header.origin, header.microbatch_id)
        sender = header.sender
        if hop == 0:
            ticket = self.in_flight.get(header.microbatch_id)
            if ticket is None or ticket.done.done():
                return
            try:
                await self.worker.compute(self.worker.embed_backward, key, msg.tensors["grad"])
            except RejectedInput as e:
                self.transport.conduct.strike(sender, f"embedding gradient rejected: {e}")
                ticket.finish(error=TransportError(f"embedding backward failed: {e}"))
                return
            except (ValueError, RuntimeError, KeyError) as e:
                ticket.finish(error=TransportError(f"embedding backward failed: {e}"))
                return
            ticket.finish(ticket.loss)  # an abort may have settled it while the backward ran
            return
        try:
            backward = self.worker.backward if self.receipts is None else self.receipts.backward
            async with self._turns.turn(key[0]):
                grad = await self.worker.compute(backward, key, msg.tensors["grad"])
        except RejectedInput as e:
            logger.info(f"rejected the gradient of microbatch {header.microbatch_id}: {e}")
            self._reject(sender, header, f"backward rejected at stage {self.me.stage}: {e}")
            return
        except (ValueError, KeyError) as e:  # activations already expired or dropped here
            logger.info(f"backward of microbatch {header.microbatch_id} failed here: {e}")
            self.aborts.tell_origin(*key, header.token, f"backward failed at stage {self.me.stage}", sender)
            return
        except Exception:
            logger.exception(f"backward of microbatch {header.microbatch_id} failed")
            self.aborts.tell_origin(*key, header.token, f"backward failed at stage {self.me.stage}", sender)
            return
        # lost before the origin: tell it; lost on the way to the origin: the origin's deadline sees it
        lost = (
            partial(self.aborts.tell_origin, *key, header.token, "backward could not reach the previous hop")
            if hop > 1
            else _no_op
        )
        sent = await self.hops.send_to(header.path[hop - 1], BACKWARD, header.next_hop(), {"grad": grad}, lost)
        self.stats.backwarded += sent is not None

    # ---- stage 0: the microbatch driver ------------------------------------------------------------

    async def drive(self, source: TokenSource, stop: asyncio.Event, ready: Callable[[], bool] = lambda: True) -> None:
        """Keep the in-flight window full of microbatches until `stop`; while `ready()` is false (a
        stage has no peer) start none, instead of failing them one by one."""
        training = self.config.training

        def launch() -> asyncio.Task:
            tokens, targets = source.next_batch(training.microbatch_size, training.sequence_length)
            return self._tasks.spawn(self.run_microbatch(tokens, targets))

        self.retry.stages_served = ready
        await keep_in_flight(self.window, launch, stop, ready)

    async def run_microbatch(
        self, tokens: torch.Tensor, targets: torch.Tensor, purpose: MicrobatchPurpose = MicrobatchPurpose.TRAIN
    ) -> float | None:
        """One microbatch through the swarm with bounded retries; its loss, or None if dropped. An
        EVAL microbatch is forward only, in the normal stage order, and counts in no training statistic."""
        deadline = self.window.deadline
        training = purpose is MicrobatchPurpose.TRAIN
        index = next(self._microbatch_index) if training else 0
        order = pipeline_order(self.config.num_stages, index, self.config.recovery.checkfree_plus, training)
        async for attempt in self.retry.attempts():  # node/pipeline/retry_pause.py
            microbatch_id = next(self._microbatch_ids)
            key = (self.me.peer_id, microbatch_id)
            ticket = InFlight.start(microbatch_id, targets, order, purpose)
            self.in_flight[microbatch_id] = ticket
            try:
                if training:
                    hidden = await self.worker.compute(self.worker.embed, key, tokens)
                else:
                    hidden = await self.worker.compute(eval_embed, self.worker, tokens)
                header = ForwardHeader(
                    microbatch_id=microbatch_id,
                    origin=self.me.peer_id,
                    path=(self.me.peer_id,),
                    order=tuple(order),
                    hop=1,
                    token=ticket.token,
                    purpose=None if training else purpose,  # none stated is training, to older peers too
                )
                # the targets stay here with the ticket: the head is this stage's, and at a real preset
                # they would be 8 more bytes a token on every hop (a subspace hop carries 35)
                tensors = {"hidden": hidden, **hop_token_ids(tokens, self.config)}
                lost = ticket.on_lost(f"no peer of stage {order[0]} took it")
                await self.hops.send_routed(order[0], FORWARD, header, tensors, lost)
                loss = await within(ticket.done, deadline)
                if not training:
                    return loss
                now = time.monotonic()
                self.stats.losses.append(loss)
                self.stats.completed += 1
                self.stats.completions.append(now)
                self.window.on_completed(now, now - ticket.started)
                return loss
            except (TimeoutError, TransportError) as e:
                logger.info(f"microbatch {microbatch_id} failed (attempt {attempt + 1}): {e!r}")
                self.window.on_failed(time.monotonic(), ticket.started)
            finally:
                self.in_flight.pop(microbatch_id, None)
                if not ticket.done.done():
                    ticket.done.cancel()
            self.worker.drop(key)
            self.stats.retried += 1
        self.stats.dropped += 1
        logger.warning("dropped a microbatch: its attempts ran out")
        return None

    async def _finish_forward(self, header: ForwardHeader, msg: Message) -> None:
        """At the origin: loss on the final hidden states, then the gradient goes back."""
        ticket = self.in_flight.get(header.microbatch_id)
        if ticket is None or ticket.done.done():
            return
        key = (self.me.peer_id, ticket.microbatch_id)
        try:
            if ticket.purpose is MicrobatchPurpose.EVAL:  # the loss is all it was for: no backward
                ticket.finish(await self.worker.compute(eval_loss, self.worker, msg.tensors["hidden"], ticket.targets))
                return
            loss, grad = await self.worker.compute(
                self.worker.head_loss_backward, key, msg.tensors["hidden"], ticket.targets
            )
        except RejectedInput as e:
            self.transport.conduct.strike(header.path[-1], f"final hidden states rejected: {e}")
            ticket.finish(error=TransportError(f"loss computation failed: {e}"))
            return
        except (ValueError, RuntimeError, UnknownMicrobatch) as e:  # UnknownMicrobatch: its activations expired
            ticket.finish(error=TransportError(f"loss computation failed: {e}"))
            return
        ticket.loss = loss
        path = header.path
        backward = BackwardHeader(ticket.microbatch_id, path, len(path) - 1, ticket.token)
        lost = ticket.on_lost("backward to the last stage failed")
        await self.hops.send_to(path[-1], BACKWARD, backward, {"grad": grad}, lost)

    async def close(self) -> None:
        await self._tasks.close()
        await self.hops.close()

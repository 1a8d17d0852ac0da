"""Stage 0's role in the pipeline: the origin of its microbatches (node/pipeline/traffic.py says how
a microbatch travels). It keeps its in-flight window full, embeds each microbatch and sends it out
under a fresh id and token, takes the final hidden states back for the loss and the gradient, ends
the embedding's backward, and runs a failed attempt again after its pause, or drops it."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable

import torch

from node.config import SwarmConfig
from node.model.data import TokenSource
from node.p2p.transport import TransportError
from node.pipeline.in_flight import InFlight, ticket_for, ticket_named_by
from node.pipeline.in_flight_window import InFlightWindow, keep_in_flight
from node.pipeline.order import pipeline_order
from node.pipeline.retry_pause import RetryPause
from node.pipeline.token_anchors import hop_token_ids
from node.pipeline.traffic import BACKWARD, FORWARD, Pipeline, PipelineParts
from node.runtime.timeouts import within
from node.stage.activation_store import UnknownMicrobatch
from node.stage.admission import RejectedInput
from node.stage.forward_only import eval_embed, eval_loss
from protocol import BackwardHeader, ForwardHeader, Message, MicrobatchPurpose

logger = logging.getLogger(__name__)


class Origin(Pipeline):
    """A stage-0 peer's pipeline: it drives microbatches through the swarm and finishes both their
    forward (the loss) and their backward (the embedding's)."""

    def __init__(
        self,
        config: SwarmConfig,
        parts: PipelineParts,
        *,
        rng: random.Random | None = None,
        max_in_flight: int | None = None,  # the window's ceiling here: less than the swarm's where memory is short
    ):
        super().__init__(config.training, config.num_stages, parts)
        self.config = config
        training = config.training
        deadline = training.hop_timeout * config.num_stages  # a microbatch's: through every stage, back to us
        self.window = InFlightWindow(training.min_in_flight, max_in_flight or training.max_in_flight, deadline)
        self.in_flight: dict[int, InFlight] = {}
        self._microbatch_ids = itertools.count((rng or random.Random()).randrange(1 << 40))
        self._microbatch_index = itertools.count()
        self.retry = RetryPause(training.max_retries, config.heartbeat, deadline)  # node/pipeline/retry_pause.py

    async def drive(self, source: TokenSource, stop: asyncio.Event, ready: Callable[[], bool] = lambda: True) -> None:
        """Keep the in-flight window full of microbatches until `stop`; while `ready()` is false (a
        stage has no peer) start none, instead of failing them one by one."""
        training = self.training

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
                if training:  # milliseconds, where a head takes seconds: ahead of the queued heads
                    hidden = await self.worker.compute(self.worker.embed, key, tokens, first=True)
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
                tensors = {"hidden": hidden, **hop_token_ids(tokens, self.config.training, self.config.model)}
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

    def _take_forward(self, sender: str, header: ForwardHeader, msg: Message) -> Message:
        """The final hidden states of one of our attempts, back from the last block stage."""
        if header.origin != self.me.peer_id or ticket_for(self.in_flight, header) is None:
            return self.transport.error("unknown microbatch")
        self._tasks.spawn(self._finish_forward(header, msg))
        return self._ack(msg)

    async def _finish_forward(self, header: ForwardHeader, msg: Message) -> None:
        """Loss on the final hidden states, then the gradient goes back."""
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

    def _expects_backward(self, header: BackwardHeader) -> bool:
        """The embedding's gradient (hop 0) of one of our attempts: no other hop is ours."""
        return header.hop == 0 and ticket_for(self.in_flight, header) is not None

    async def _run_backward(self, header: BackwardHeader, msg: Message) -> None:
        """The embedding's backward ends the attempt (stepping when due)."""
        ticket = self.in_flight.get(header.microbatch_id)
        if ticket is None or ticket.done.done():
            return
        try:
            key = (header.origin, header.microbatch_id)
            await self.worker.compute(self.worker.embed_backward, key, msg.tensors["grad"], first=True)
        except RejectedInput as e:
            self.transport.conduct.strike(header.sender, f"embedding gradient rejected: {e}")
            ticket.finish(error=TransportError(f"embedding backward failed: {e}"))
            return
        except (ValueError, RuntimeError, KeyError) as e:
            ticket.finish(error=TransportError(f"embedding backward failed: {e}"))
            return
        ticket.finish(ticket.loss)  # an abort may have settled it while the backward ran

    def _take_abort(self, meta: dict, reason: str) -> bool:
        """Retry now instead of at the deadline."""
        ticket = ticket_named_by(self.in_flight, meta["microbatch_id"], meta["token"])
        if ticket is None:
            return False
        ticket.finish(error=TransportError(reason))
        return True

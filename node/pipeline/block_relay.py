"""A block stage's role in the pipeline: it relays other peers' microbatches (node/pipeline/traffic.py
says how a microbatch travels). It takes a FORWARD only from members (node/p2p/membership.py) and
while its queue has room, computes it in a turn fair among origins, passes the output on to the next
stage (the last block stage: back to the origin), backpropagates the gradient that comes back for
it, and tells an origin, and only an origin on the path, that a microbatch was lost here
(node/pipeline/abort_notices.py)."""

from __future__ import annotations

import logging
from functools import partial

from dht.records import short_peer_id
from node.config import TrainingConfig
from node.pipeline.abort_notices import AbortNotices
from node.pipeline.fair_turns import FairTurns
from node.pipeline.receipts import ReceiptKeeper
from node.pipeline.token_anchors import carried_token_ids
from node.pipeline.traffic import ABORT, BACKWARD, FORWARD, Pipeline, PipelineParts
from node.stage.admission import RejectedInput
from node.stage.forward_only import eval_forward
from protocol import BackwardHeader, ForwardHeader, Message, MessageKind, MicrobatchHeader, MicrobatchPurpose

logger = logging.getLogger(__name__)


def _no_op() -> None:
    pass


class BlockRelay(Pipeline):
    """A block-stage peer's pipeline: the forward and the backward of each microbatch routed here."""

    def __init__(
        self,
        training: TrainingConfig,
        num_stages: int,
        parts: PipelineParts,
        *,
        receipts: ReceiptKeeper | None = None,  # a record of what it computed, for checks
        max_queue: int | None = None,  # hops queued here at most; None: training.max_in_flight
    ):
        super().__init__(training, num_stages, parts)
        self.peers = parts.peers  # compute is spent only on members' microbatches
        self.receipts = receipts
        # as many as an origin keeps in flight: the activations stored here are bounded by it too
        self.max_queue = max_queue or training.max_in_flight
        self._queued = 0
        # the stage's compute, shared fairly among the origins whose microbatches wait for it
        self._turns = FairTurns()
        notify = self.hops.notify_abort  # who may be told is AbortNotices' to decide (no reflection)
        self.aborts = AbortNotices(lambda *notice: notify(notice[0], ABORT, *notice[1:]), self._tasks.spawn)

    def _take_forward(self, sender: str, header: ForwardHeader, msg: Message) -> Message:
        """Queued unless the sender or the origin may not send us work, or the queue is full."""
        order, hop = header.order, header.hop
        # the sender serves the stage before ours on this path, the origin stage 0; a stranger (or a
        # joiner our view has not seen yet) gets BUSY, not a strike: an honest sender asks another peer
        refusal = self.peers.refusal(sender, order[hop - 2] if hop >= 2 else 0) or self.peers.refusal(header.origin, 0)
        if refusal is not None:
            self.stats.busy_replies += 1
            return self.transport.message(MessageKind.BUSY, {"reason": refusal}, request_id=msg.request_id)
        if self._queued >= self.max_queue:
            self.stats.busy_replies += 1
            return self.transport.message(MessageKind.BUSY, request_id=msg.request_id)
        self._queued += 1
        self._tasks.spawn(self._run_block_forward(header, msg))
        return self._ack(msg)

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
        tensors = {"hidden": hidden, **carried_token_ids(msg, self.training)}

        def lost() -> None:  # the header only: `msg` holds the tensors that came in
            self.worker.drop(key)
            if next_stage != 0:
                self.aborts.tell_origin(*key, header.token, f"no peer of stage {next_stage} took it")

        if next_stage == 0:
            sent = await self.hops.send_to(header.origin, FORWARD, onward, tensors, lost)
        else:
            sent = await self.hops.send_routed(next_stage, FORWARD, onward, tensors, lost)
        self.stats.forwarded += sent is not None

    def _expects_backward(self, header: BackwardHeader) -> bool:
        """A gradient for a forward computed here, named by its origin, id and token (hop 0 is an
        origin's, never a block stage's)."""
        return header.hop > 0 and self.aborts.computed(header)

    async def _run_backward(self, header: BackwardHeader, msg: Message) -> None:
        """This stage's backward; the input's gradient goes to the previous peer on the path."""
        hop = header.hop
        key = (header.origin, header.microbatch_id)
        sender = header.sender
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

    def _reject(self, sender: str, header: MicrobatchHeader, reason: str) -> None:
        """A tensor from `sender` was unusable: a strike against it, and the origin retries elsewhere."""
        self.transport.conduct.strike(sender, reason)
        self.aborts.tell_origin(header.origin, header.microbatch_id, header.token, reason, sender)

    def _take_abort(self, meta: dict, reason: str) -> bool:
        """A notice from further on the path, for a microbatch this peer handled: passed on to its origin."""
        return self.aborts.relay(meta, reason)

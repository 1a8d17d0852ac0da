"""A block-stage replica's side of a spot-check: committing to what it computed, then opening one
layer of it (docs/verification.md; the checker's side is node/pipeline/verifier.py).

A CHECK names a microbatch this replica computed (with the microbatch's token, which only peers on
its path know); an AUDIT brings an input and a probe from a stage mate, computed here and now at the
current weights, whose copy is kept for the opening. Either way the replica answers with a
COMMITMENT: digests of its weights, layer by layer, and of every boundary of the microbatch
through its layers, forward and backward. Only then does the checker name the layer it wants to
see (OPEN), and the replica sends that layer's weights and boundaries (OPENING), bit-exact. A
replica that committed to something else than it computed cannot show a layer that both hashes to
its commitment and recomputes to its boundaries, unless it guesses the layer in advance.

Receipts and weight versions live on the stage's device and the host; every use of them runs on
the stage's compute thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor

from dht.records import short_peer_id
from node.config import VerificationConfig
from node.p2p.membership import Membership
from node.p2p.transport import Transport
from node.pipeline.check_wire import CHECK_SERVICE, WEIGHTS, backward_name, exact, forward_name
from node.pipeline.contracts import CHECK_CONTRACT
from node.pipeline.receipts import Receipt, ReceiptKeeper, WeightsVersion
from node.pipeline.spot_check import digest
from node.stage.access import weights_copy
from node.stage.layers import LayerLayout, stage_boundaries
from node.stage.precision import StagePrecision
from protocol import Message, MessageKind, ProtocolError

logger = logging.getLogger(__name__)

MAX_COMMITMENTS = 16  # commitments waiting for their opening (a checker opens within a round trip)
COMMITMENT_SECONDS = 60.0


@dataclass
class Commitment:
    """What this replica committed to for one check, kept until the checker opens a layer of it."""

    requester: str
    weights: WeightsVersion
    forward: list[Tensor]  # h_0..h_L on the host, as hashed
    backward: list[Tensor] | None  # g_0..g_L, None before the backward
    made: float


class CheckServer:
    """Answers checks of this replica's microbatches and its stage mates' audits."""

    def __init__(
        self,
        settings: VerificationConfig,
        transport: Transport,
        keeper: ReceiptKeeper,
        membership: Membership,
    ) -> None:
        self.settings, self.transport, self.keeper, self.membership = settings, transport, keeper, membership
        self.worker = keeper.worker
        self.layout = LayerLayout(self.worker.config.model)
        self.layers = self.worker.config.model.layers_per_stage
        # recomputations keep their own fp16 loss scale: training's is not theirs to move
        self.precision = StagePrecision(self.worker.precision.precision, self.worker.device)
        self._commitments: OrderedDict[int, Commitment] = OrderedDict()
        self._ids = itertools.count(1)
        self._serving = 0
        self.served = 0  # openings sent: checks this replica answered in full

    async def start(self) -> None:
        await self.transport.serve_requests(CHECK_SERVICE, self.on_request, CHECK_CONTRACT)

    async def on_request(self, sender: str, msg: Message) -> Message:
        """A CHECK, AUDIT or OPEN (CHECK_CONTRACT, checked by the transport)."""
        if msg.meta["stage"] != self.worker.stage or self.worker.stage == 0:
            return self.transport.error(f"this peer serves stage {self.worker.stage}", msg.request_id)
        refusal = await self.membership.admit(sender)
        if refusal is not None:
            return self.transport.message(MessageKind.BUSY, {"reason": refusal}, request_id=msg.request_id)
        if msg.kind == MessageKind.OPEN:  # finishes a check already under way: never BUSY
            return await self._open(sender, msg)
        if self._serving >= self.settings.max_concurrent:
            return self.transport.message(MessageKind.BUSY, request_id=msg.request_id)
        self._serving += 1
        try:
            if msg.kind == MessageKind.AUDIT:
                try:
                    receipt = await self.worker.compute(self._audited, msg.tensors["hidden"], msg.tensors["probe"])
                except ValueError as e:  # a malformed input (RejectedInput): refused, as a hop would be
                    return self.transport.error(f"audit refused: {e}", msg.request_id)
            else:
                receipt = self._receipt(msg)
            if receipt is None:
                return self.transport.error("no receipt of that microbatch here: expired, or never computed here")
            if receipt.weights is None:
                return self.transport.error("that microbatch ran on the live weights, which keep no copy")
            return await self._commit(sender, receipt, msg.request_id)
        finally:
            self._serving -= 1

    def _receipt(self, msg: Message) -> Receipt | None:
        meta = msg.meta
        receipt = self.keeper.book.get((meta["origin"], meta["microbatch_id"]))
        if receipt is None or not _same_token(receipt.token, meta["token"]):
            return None
        return receipt

    def _audited(self, hidden: Tensor, probe: Tensor) -> Receipt:
        """A stage mate's input through this stage at the current weights (a copy of them is the
        version committed to), its probe as the gradient at the output. Compute thread."""
        worker = self.worker
        inputs = worker.hidden_from_wire("audit input", hidden)
        grad_output = worker.hidden_from_wire("audit probe", probe, shape=inputs.shape)
        named = weights_copy(worker)
        forward, backward = stage_boundaries(worker, self.layout, named, inputs, grad_output, self.precision)
        assert backward is not None
        sent, grad_sent = worker.transfers.to_host([forward[-1], backward[0]])
        received = hidden.detach().float()
        receipt = Receipt("", received, sent, WeightsVersion(named), self.precision.precision, time.monotonic())
        receipt.grad_received, receipt.grad_sent = probe.detach().float(), grad_sent
        return receipt

    async def _commit(self, sender: str, receipt: Receipt, request_id: int) -> Message:
        # the device only where it must be (recomputed boundaries, a version not hashed yet): a
        # commitment then does not wait behind the training compute queued on the stage's thread
        if self.layers > 1:
            commitment = await self.worker.compute(self._boundaries, sender, receipt)
        else:
            commitment = self._boundaries(sender, receipt)
        version = commitment.weights
        if version.digests is None:
            flat = await self.worker.compute(version.layers_on_host, self.layout, self.layers, self.worker.transfers)
            await asyncio.to_thread(version.hash_layers, flat)
        forward, backward = await asyncio.to_thread(_digests, commitment.forward, commitment.backward)
        self._forget_old()
        commitment_id = next(self._ids)
        self._commitments[commitment_id] = commitment
        meta = {
            "stage": self.worker.stage,
            "commitment": commitment_id,
            "precision": receipt.precision.value,
            "weights": version.digests,
            "forward": forward,
            "backward": backward,
        }
        return self.transport.message(MessageKind.COMMITMENT, meta, request_id=request_id)

    def _boundaries(self, requester: str, receipt: Receipt) -> Commitment:
        """Every boundary of the receipt's microbatch through this stage's layers: the ends as they
        crossed the wire, the ones between recomputed at the receipt's weights (on the compute
        thread: with one layer there is none and this touches no device)."""
        assert receipt.weights is not None
        backward_ran = receipt.grad_received is not None and receipt.grad_sent is not None
        forward, backward = [receipt.received, receipt.sent], None
        if backward_ran:
            backward = [receipt.grad_sent, receipt.grad_received]
        if self.layers > 1:
            to_device = self.worker.transfers.to_device
            inner_forward, inner_backward = stage_boundaries(
                self.worker,
                self.layout,
                receipt.weights.named,
                to_device(receipt.received),
                to_device(receipt.grad_received) if backward_ran else None,
                self.precision,
            )
            inner = inner_forward[1:-1] + (inner_backward[1:-1] if inner_backward is not None else [])
            host = self.worker.transfers.to_host(inner)
            forward = [receipt.received, *host[: self.layers - 1], receipt.sent]
            if backward is not None:
                backward = [receipt.grad_sent, *host[self.layers - 1 :], receipt.grad_received]
        return Commitment(requester, receipt.weights, forward, backward, time.monotonic())

    async def _open(self, sender: str, msg: Message) -> Message:
        meta = msg.meta
        commitment = self._commitments.get(meta["commitment"])
        if commitment is None or commitment.requester != sender:
            return self.transport.error("no such commitment to open", msg.request_id)
        layer, forward, backward = meta["layer"], meta["forward"], meta["backward"]
        if layer >= self.layers or any(i > self.layers for i in (*forward, *backward)):
            raise ProtocolError(f"no layer {layer} or boundary beyond {self.layers} in this stage")
        if backward and commitment.backward is None:
            raise ProtocolError("asked for backward boundaries of a commitment without a backward")
        # one opening per commitment: a second layer would be chosen knowing the first
        del self._commitments[meta["commitment"]]
        weights = await self.worker.compute(self.opened_layer, commitment.weights, layer)
        tensors = {WEIGHTS: exact(weights)}
        tensors |= {forward_name(i): exact(commitment.forward[i]) for i in forward}
        if commitment.backward is not None:
            tensors |= {backward_name(j): exact(commitment.backward[j]) for j in backward}
        self.served += 1
        logger.debug(f"opened layer {layer} of a check for {short_peer_id(sender)}")
        return self.transport.message(
            MessageKind.OPENING, {"stage": self.worker.stage, "commitment": meta["commitment"]}, tensors, msg.request_id
        )

    def opened_layer(self, weights: WeightsVersion, layer: int) -> Tensor:
        """The weights of `layer` this replica shows, flat on the host. Compute thread."""
        return self.worker.transfers.to_host([weights.layer(self.layout, layer)])[0]

    def _forget_old(self) -> None:
        oldest = time.monotonic() - COMMITMENT_SECONDS
        while self._commitments and (
            len(self._commitments) >= MAX_COMMITMENTS or next(iter(self._commitments.values())).made < oldest
        ):
            self._commitments.popitem(last=False)


def _digests(forward: list[Tensor], backward: list[Tensor] | None) -> tuple[list[str], list[str]]:
    return [digest(t) for t in forward], [digest(t) for t in backward] if backward is not None else []


def _same_token(kept: str, given: str) -> bool:
    """The tokens compared in constant time (a stranger guessing one learns nothing from timing)."""
    return secrets.compare_digest(kept.encode(), given.encode())

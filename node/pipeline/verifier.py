"""Spot-checks on the wire, the checker's side: which hops this peer checks, asking the replica to
commit and then to open a layer, and acting on the finding (the pure rules are
node/pipeline/spot_check.py and node/pipeline/verdict.py, the replica's side is
node/pipeline/check_server.py; docs/verification.md says what a check can and cannot catch).

A peer checks the block-stage hops it takes part in (node/pipeline/hop_observations.py): as the
hop's previous peer, after the replica's backward reached it; as its next peer, as soon as the
replica's output arrived. Neither is a message a replica could tell from traffic: the microbatch
was real, and the replica learns it is checked only once it has sent what it computed. Stage mates
also audit each other every `verification.audit_seconds` with an input of their own: how a replica
that computes wrong gets banned by its own stage, whose gossip then refuses it.

Only a finding that is evidence strikes (every one is something no honest replica produces); a
replica that leaves a check unanswered is checked more often for a while and struck by nobody.
Enough strikes ban the peer: its streams are refused, routing avoids it and its gossip is refused
(all three read the same ban), and a signed `verification` event names it with the evidence.
Checks run in the background: a hop never waits for one.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dht.records import MAX_REPORTED_PEERS, EventKind, VerificationReport, short_peer_id
from node.config import VerificationConfig
from node.p2p.bans import BanList
from node.p2p.transport import Transport, TransportError
from node.pipeline.check_wire import CHECK_SERVICE, CommitmentReply
from node.pipeline.hop_observations import Observed, PendingChecks
from node.pipeline.spot_check import CheckRate, Finding, RecomputeTolerance, StrikeBook, probe_direction
from node.pipeline.verdict import Judgement, boundaries_to_open, judge
from node.runtime.events import EventPublisher
from node.runtime.tasks import BackgroundTasks
from node.stage.admission import RejectedInput
from node.stage.layers import LayerLayout
from node.stage.stage_worker import StageWorker
from protocol import Message, MessageKind

logger = logging.getLogger(__name__)

MAX_CHECKS_RUNNING = 4  # checks this peer runs at once: a burst of drawn hops queues none more
MAX_PENDING = 256  # hops drawn as a previous peer, waiting for their backward


@dataclass
class CheckStats:
    """What this peer's checks found (published in its record, node status, the dashboard)."""

    checks: int = 0  # checks decided
    failed: int = 0  # checks that found evidence
    unanswered: int = 0
    largest_error: float = 0.0  # among checks that passed: the largest output replay error
    largest_gradient_error: float = 0.0
    tolerance: float = 0.0  # what largest_error was held to
    seconds: float = 0.0  # total time from request to verdict of the checks decided

    @property
    def mean_seconds(self) -> float:
        return self.seconds / self.checks if self.checks else 0.0

    def passed(self, judgement: Judgement) -> None:
        if judgement.forward_error is not None and judgement.forward_error >= self.largest_error:
            self.largest_error, self.tolerance = judgement.forward_error, judgement.tolerance or 0.0
        if judgement.backward_error is not None:
            self.largest_gradient_error = max(self.largest_gradient_error, judgement.backward_error)


class Verifier:
    """Checks the block-stage replicas this peer exchanges hops with and audits its stage mates."""

    def __init__(
        self,
        settings: VerificationConfig,
        transport: Transport,
        worker: StageWorker,
        bans: BanList,
        events: EventPublisher | None,
        *,
        peer_id: str,
        replicas: Callable[[int], list[str]],
        hop_timeout: float,
        served: Callable[[], int] = lambda: 0,
        rng: random.Random | None = None,
    ):
        """`replicas(stage)`: the live peers of `stage` this peer can reach, itself excluded;
        `served()`: how many checks this peer answered for others (its CheckServer's count)."""
        self.settings, self.transport, self.worker, self.bans = settings, transport, worker, bans
        self.events, self.peer_id, self.replicas, self.served = events, peer_id, replicas, served
        self.hop_timeout = hop_timeout
        self.rng = rng or random.Random()
        self.generator = torch.Generator().manual_seed(self.rng.randrange(1 << 62))
        self.layout = LayerLayout(worker.config.model)
        self.layers = worker.config.model.layers_per_stage
        self.tolerance = RecomputeTolerance.from_settings(settings)
        self.strikes = StrikeBook(settings.strikes_to_ban, settings.strike_half_life)
        self.rate = CheckRate(settings.rate, settings.raised_rate, settings.raised_seconds)
        # a microbatch's backward comes back within its deadline, a hop timeout per stage at most
        self.pending = PendingChecks(MAX_PENDING, hop_timeout * worker.config.num_stages)
        self.stats = CheckStats()
        self.banned: dict[str, str] = {}  # peers this verifier banned -> the evidence
        self._tasks = BackgroundTasks()

    # ---- what this peer saw of a hop (event loop: draws and bookkeeping only) -------------------

    def forward_sent(
        self,
        stage: int,
        peer: str,
        origin: str,
        microbatch_id: int,
        token: str,
        hidden: Tensor,
        token_ids: Tensor | None,
    ) -> None:
        """This peer sent `peer` of block stage `stage` a training microbatch's input (and token ids)."""
        if self._draw(stage, peer):
            self.pending.add(
                Observed(
                    stage, peer, origin, microbatch_id, token, time.monotonic(), sent_input=hidden, token_ids=token_ids
                )
            )

    def forward_received(
        self,
        stage: int,
        sender: str,
        origin: str,
        microbatch_id: int,
        token: str,
        output: Tensor,
        token_ids: Tensor | None,
    ) -> None:
        """`sender`, of block stage `stage`, sent this peer a training microbatch's output (and token ids)."""
        pending = self.pending.get((origin, microbatch_id, sender))
        if pending is not None:  # this peer sent it the input too: one check after its backward
            pending.received_output = output
            return
        if self._draw(stage, sender):
            self._launch(
                Observed(
                    stage,
                    sender,
                    origin,
                    microbatch_id,
                    token,
                    time.monotonic(),
                    received_output=output,
                    token_ids=token_ids,
                )
            )

    def backward_sent(self, peer: str, origin: str, microbatch_id: int, grad: Tensor) -> None:
        """This peer sent `peer` the gradient with respect to the output it received from it."""
        pending = self.pending.get((origin, microbatch_id, peer))
        if pending is not None:
            pending.sent_grad_output = grad

    def backward_received(self, sender: str, origin: str, microbatch_id: int, grad: Tensor) -> None:
        """`sender` sent this peer the gradient with respect to the input this peer sent it."""
        observed = self.pending.pop((origin, microbatch_id, sender))
        if observed is not None:
            observed.received_grad_input = grad
            self._launch(observed)

    def _draw(self, stage: int, peer: str) -> bool:
        return stage != 0 and peer != self.peer_id and self.rng.random() < self.rate.of(peer)

    def _launch(self, observed: Observed) -> None:
        if len(self._tasks) < MAX_CHECKS_RUNNING:
            self._tasks.spawn(self.check(observed), name=f"check-stage{observed.stage}")

    # ---- checking --------------------------------------------------------------------------------

    async def check(self, observed: Observed) -> Finding | None:
        """Check `observed.peer` on that microbatch; None when it gave no answer."""
        meta = {
            "stage": observed.stage,
            "origin": observed.origin,
            "microbatch_id": observed.microbatch_id,
            "token": observed.token,
        }
        return await self._verify(observed, self.transport.message(MessageKind.CHECK, meta))

    async def audit(self) -> Finding | None:
        """Check a random mate of this peer's stage on the input of this peer's newest microbatch;
        None when there is nothing to audit with (no input in flight, no mate) or no answer."""
        stage = self.worker.stage
        mates = sorted(peer for peer in self.replicas(stage) if not self.bans.is_banned(peer))
        if stage == 0 or not mates:
            return None

        def newest_input_on_host() -> Tensor | None:
            hidden = self.worker.store.newest_input()  # on the device: read on the compute thread
            return None if hidden is None else self.worker.transfers.to_host([hidden.detach().float()], copy=True)[0]

        hidden = await self.worker.compute(newest_input_on_host)
        if hidden is None:
            return None
        probe = probe_direction(hidden.shape, self.generator)
        mate = self.rng.choice(mates)
        observed = Observed(stage, mate, "", 0, "", time.monotonic(), sent_input=hidden, sent_grad_output=probe)
        request = self.transport.message(MessageKind.AUDIT, {"stage": stage}, {"hidden": hidden, "probe": probe})
        return await self._verify(observed, request)

    async def _verify(self, observed: Observed, request: Message) -> Finding | None:
        peer, began = observed.peer, time.monotonic()
        reply = await self._ask(peer, request, MessageKind.COMMITMENT)
        if reply is None:
            return self._unanswered(observed, "no commitment")
        try:
            commitment = CommitmentReply.parse(reply, self.layers)
        except ValueError as e:
            return self._act(observed, Judgement(Finding.MALFORMED, f"commitment: {e}"), began)
        layer = self.rng.randrange(self.layers)  # drawn after the commitment: the replica could not know it
        forward, backward = boundaries_to_open(layer, self.layers, observed, commitment.has_backward)
        meta = {"stage": observed.stage, "commitment": commitment.commitment, "layer": layer}
        meta |= {"forward": forward, "backward": backward}
        opening = await self._ask(peer, self.transport.message(MessageKind.OPEN, meta), MessageKind.OPENING)
        if opening is None:
            return self._unanswered(observed, f"layer {layer} not opened")
        judgement = await self.worker.compute(
            judge, self.layout, self.tolerance, commitment, layer, opening.tensors, observed, self.worker.transfers
        )
        return self._act(observed, judgement, began)

    async def _ask(self, peer: str, request: Message, expected: MessageKind) -> Message | None:
        try:
            reply = await self.transport.request(peer, CHECK_SERVICE, request, self.hop_timeout)
        except TransportError as e:
            logger.debug(f"{short_peer_id(peer)} did not answer a check: {e}")
            return None
        return reply if reply.kind == expected else None

    async def run_audits(self) -> None:
        """Audit a stage mate every `audit_seconds` (jittered, so replicas do not audit in step)."""
        if self.worker.stage == 0:
            return
        while True:
            await asyncio.sleep(self.settings.audit_seconds * self.rng.uniform(0.5, 1.5))
            try:
                await self.audit()
            except (RejectedInput, RuntimeError, ValueError) as e:
                logger.info(f"audit of stage {self.worker.stage} skipped: {e}")

    # ---- acting on a finding ---------------------------------------------------------------------

    def _unanswered(self, observed: Observed, why: str) -> None:
        """No answer is not evidence (the replica may be busy, restarting, or past its receipts'
        window): no strike, but a closer watch on it for a while."""
        self.stats.unanswered += 1
        self.rate.raise_for(observed.peer)
        logger.debug(f"check of {short_peer_id(observed.peer)} (stage {observed.stage}) unanswered: {why}")
        return None

    def _act(self, observed: Observed, judgement: Judgement, began: float) -> Finding:
        self.stats.checks += 1
        self.stats.seconds += time.monotonic() - began
        peer, stage = observed.peer, observed.stage
        what = (
            f"microbatch {observed.microbatch_id} of {short_peer_id(observed.origin)}" if observed.origin else "audit"
        )
        if not judgement.finding.is_evidence:
            self.stats.passed(judgement)
            logger.debug(f"check of {short_peer_id(peer)} (stage {stage}, {what}) passed: {judgement.detail}")
            return judgement.finding
        self.stats.failed += 1
        evidence = f"stage {stage}, {what}: {judgement.finding}: {judgement.detail}"
        logger.warning(f"strike for {short_peer_id(peer)}: {evidence}")
        self._publish(stage, peer, f"strike: {evidence}")
        if self.strikes.strike(peer):
            self._ban(stage, peer, f"{self.settings.strikes_to_ban} checks found evidence; last: {evidence}")
        return judgement.finding

    def _ban(self, stage: int, peer_id: str, evidence: str) -> None:
        self.banned[peer_id] = evidence
        # into the node's one ban store: its streams are refused, and routing and gossip avoid it,
        # until its record expires
        self.transport.conduct.ban(peer_id, f"spot-checks: {evidence}", at_least=self.settings.ban_seconds)
        logger.warning(f"banned {short_peer_id(peer_id)} (stage {stage}) after spot-checks: {evidence}")
        self._publish(stage, peer_id, f"banned: {evidence}")

    def _publish(self, stage: int, peer_id: str, detail: str) -> None:
        if self.events is not None:
            self.events.publish(EventKind.VERIFICATION, stage, detail, peer_id=peer_id)

    def report(self) -> VerificationReport:
        """What this peer's record says about its checks: counts, strikes and bans it holds."""
        scores = sorted(self.strikes.scores().items(), key=lambda item: -item[1])[:MAX_REPORTED_PEERS]
        bans = [peer for peer in self.banned if self.bans.is_banned(peer)][:MAX_REPORTED_PEERS]
        self.banned = {peer: why for peer, why in self.banned.items() if peer in bans}
        stats = self.stats
        return VerificationReport(
            checks=stats.checks,
            failed=stats.failed,
            unanswered=stats.unanswered,
            served=self.served(),
            largest_error=stats.largest_error,
            largest_gradient_error=stats.largest_gradient_error,
            tolerance=stats.tolerance,
            check_seconds=stats.mean_seconds,
            strikes={peer: round(score, 3) for peer, score in scores},
            bans=bans,
        )

    async def close(self) -> None:
        await self._tasks.close()
        if self.events is not None:
            await self.events.close()

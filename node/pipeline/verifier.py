"""Spot-checks on the wire: asking replicas of a block stage for the same computation and acting
on the verdict (the pure rules are node/pipeline/spot_check.py; docs/verification.md says what a
check can and cannot catch).

After a routed hop to peer A of stage s, with probability `verification.rate` (raised for peers
under suspicion) the routing peer sends a CHECK with the hop's input and a random probe direction
to A and to a second replica B of stage s, chosen at random. Each answers with its output and the
gradient of <output, probe> wrt the input, computed with its current weights and nothing stored or
accumulated. If the two answers are further apart than the tolerance (scaled by the stage's
published replica divergence), a third replica C arbitrates: the one C disagrees with gets a
strike. Without a third replica nobody is struck on one word against another: both are checked
at the raised rate and a `verification` event says so. Enough strikes ban the peer: its streams
are refused, routing avoids it and its gossip is refused (all three read the same ban), and a
signed `verification` event names it with the evidence.

Replicas of a stage also audit each other every `verification.audit_seconds`: a peer checks a
random stage mate against its own answer on a recent input, with another mate as the arbiter. That
is how a replica that computes wrong is banned by its own stage, whose gossip then refuses it
(routers see its traffic, not its gossip). A peer that finds itself in the minority strikes nobody
and says so in its log and in an event: its own computation may be the faulty one.

A replica that does not answer a check (timeout, BUSY, an old release) is not struck: being slow
or absent is routing's business. Checks run in the background; a hop never waits for one.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dht.records import MAX_REPORTED_PEERS, EventKind, VerificationReport, short_peer_id
from node.config import VerificationConfig
from node.p2p.transport import Transport, TransportError
from node.pipeline.admission import RejectedInput
from node.pipeline.routing import BanList
from node.pipeline.spot_check import (
    Answer,
    CheckRate,
    Comparison,
    Limits,
    StrikeBook,
    Tolerance,
    Verdict,
    arbitrate,
    compare,
    probe_direction,
)
from node.pipeline.stage_worker import StageWorker
from node.runtime.events import EventPublisher
from node.runtime.tasks import BackgroundTasks
from protocol import Message, MessageKind, ProtocolError

logger = logging.getLogger(__name__)

CHECK_SERVICE = "check"
MAX_CHECKS_RUNNING = 4  # checks this peer runs as a router at once: a burst of hops queues none more


def answer_check(worker: StageWorker, hidden: Tensor, probe: Tensor) -> tuple[Tensor, Tensor]:
    """What a replica computes for a check: its output on `hidden` and d<output, probe>/d hidden,
    with the current weights; no activation stored, no parameter gradient, nothing counted. Runs on
    the worker's compute thread like every other use of its module."""
    if worker.stage == 0:
        raise RejectedInput("stage 0 is not spot-checked")
    x = worker.hidden_from_wire("check input", hidden)
    direction = worker.hidden_from_wire("check probe", probe, shape=x.shape)
    leaf = x.requires_grad_(True)
    with torch.enable_grad(), worker.precision.autocast():
        out = worker.module(leaf)
    (grad_in,) = worker.precision.grad(out, [leaf], direction.to(out.dtype))
    if grad_in is None:
        raise RuntimeError("the stage's output does not depend on its input")
    output, grad_input = worker.transfers.to_host([out.detach().float(), grad_in.detach().float()])
    return output, grad_input


@dataclass
class CheckStats:
    """What this peer's checks found (published in its record, node status, the dashboard)."""

    checks: int = 0  # hops checked with two answers compared
    disagreements: int = 0
    arbitrations: int = 0
    unanswered: int = 0  # checks abandoned because a replica did not answer
    served: int = 0  # checks this peer answered for others
    # in a settled stage, between two answers that agreed: the largest output and gradient measures
    largest_agreeing: float = 0.0
    tolerance_then: float = 0.0  # the tolerance that output measure was compared with
    largest_gradient: float = 0.0


class Verifier:
    """Runs spot-checks of the next stages as a router, answers them as a replica."""

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
        stage_divergence: Callable[[int], float | None],
        replica_distance: Callable[[str, str], float | None],
        stage_steps: Callable[[int], int],
        is_member: Callable[[str], bool],
        hop_timeout: float,
        rng: random.Random | None = None,
    ):
        """`replicas(stage)`: the live peers of `stage` this peer can reach, itself excluded;
        `stage_divergence(stage)`: the replica divergence its peers publish (None: unknown);
        `replica_distance(a, b)`: how far apart the live weights of two replicas are now, from
        their published fingerprints (None: unknown);
        `stage_steps(stage)`: how many inner steps its live peers report (their median)."""
        self.settings, self.transport, self.worker, self.bans = settings, transport, worker, bans
        self.events, self.peer_id, self.replicas = events, peer_id, replicas
        self.stage_divergence, self.stage_steps = stage_divergence, stage_steps
        self.replica_distance = replica_distance
        self.is_member, self.hop_timeout = is_member, hop_timeout
        self.rng = rng or random.Random()
        self.generator = torch.Generator().manual_seed(self.rng.randrange(1 << 62))
        self.tolerance = Tolerance(
            settings.tolerance_floor,
            settings.tolerance_factor,
            settings.tolerance_ceiling,
            settings.gradient_tolerance,
            settings.gross_direction_tolerance,
            settings.gross_scale_tolerance,
        )
        self.strikes = StrikeBook(settings.strikes_to_ban, settings.strike_half_life)
        self.rate = CheckRate(settings.rate, settings.raised_rate, settings.raised_seconds)
        self.stats = CheckStats()
        self.banned: dict[str, str] = {}  # peers this verifier banned -> the evidence
        self._serving = 0
        self._tasks = BackgroundTasks()

    # ---- serving: this peer is a replica asked for a check -------------------------------------

    async def start(self) -> None:
        await self.transport.serve_requests(CHECK_SERVICE, self.on_check)

    async def on_check(self, sender: str, msg: Message) -> Message:
        if msg.kind != MessageKind.CHECK:
            raise ProtocolError(f"expected a check, got {msg.kind}")
        if msg.meta["stage"] != self.worker.stage or self.worker.stage == 0:
            return self.transport.error(f"this peer serves stage {self.worker.stage}", msg.request_id)
        if not self.is_member(sender) or self._serving >= self.settings.max_concurrent:
            return self.transport.message(MessageKind.BUSY, request_id=msg.request_id)
        self._serving += 1
        try:
            output, grad_input = await self.worker.compute(
                answer_check, self.worker, msg.tensors["hidden"], msg.tensors["probe"]
            )
        finally:
            self._serving -= 1
        self.stats.served += 1
        return self.transport.message(
            MessageKind.CHECK_RESULT,
            {"stage": self.worker.stage},
            {"output": output, "grad_input": grad_input},
            request_id=msg.request_id,
        )

    # ---- checking: this peer routed a hop ------------------------------------------------------

    def after_hop(self, stage: int, peer_id: str, hidden: Tensor) -> None:
        """Called after a hop to `peer_id` of block stage `stage` was accepted: maybe check it."""
        if stage == 0 or len(self._tasks) >= MAX_CHECKS_RUNNING:
            return
        if self.rng.random() >= self.rate.of(peer_id):
            return
        self._tasks.spawn(self.check(stage, peer_id, hidden), name=f"check-stage{stage}")

    def _other_replica(self, stage: int, exclude: set[str]) -> str | None:
        candidates = [peer for peer in self.replicas(stage) if peer not in exclude and not self.bans.is_banned(peer)]
        return self.rng.choice(sorted(candidates)) if candidates else None

    async def _ask(self, stage: int, peer_id: str, hidden: Tensor, probe: Tensor) -> Answer | None:
        """One replica's answer, or None if it gave none (no strike: absence is not a wrong answer).
        This peer's own answer, in an audit of its stage, is computed here."""
        if peer_id == self.peer_id:
            return Answer(*await self.worker.compute(answer_check, self.worker, hidden, probe))
        request = self.transport.message(MessageKind.CHECK, {"stage": stage}, {"hidden": hidden, "probe": probe})
        try:
            reply = await self.transport.request(peer_id, CHECK_SERVICE, request, self.hop_timeout)
        except TransportError as e:
            logger.debug(f"{short_peer_id(peer_id)} did not answer a check: {e}")
            return None
        if reply.kind != MessageKind.CHECK_RESULT:
            return None
        # a wrong shape is a wrong answer, not a missing one: compare() puts it at infinite distance
        return Answer(reply.tensors["output"].float(), reply.tensors["grad_input"].float())

    async def check(self, stage: int, first: str, hidden: Tensor) -> Verdict | None:
        """Check `first`'s stage on `hidden` against another replica; None if no verdict was possible."""
        second = self._other_replica(stage, {first})
        if second is None:
            return None  # the stage has one replica: nobody to compare with
        probe = probe_direction(hidden.shape, self.generator)
        answers = await asyncio.gather(self._ask(stage, first, hidden, probe), self._ask(stage, second, hidden, probe))
        if answers[0] is None or answers[1] is None:
            self.stats.unanswered += 1
            return None
        # settled: past the first steps, and no replica far from the others (just rebuilt by CheckFree)
        divergence = self.stage_divergence(stage)
        settled = self.stage_steps(stage) >= self.settings.settle_steps and (
            divergence is None or divergence <= self.settings.settled_divergence
        )
        limits = self.tolerance.limits(self._tolerated_divergence(divergence, first, second), settled)
        first_vs_second = await self._compare(answers[0], answers[1], limits)
        logger.debug(f"check of {short_peer_id(first)} against {short_peer_id(second)}: {first_vs_second.describe()}")
        self.stats.checks += 1
        if first_vs_second.agree:
            if settled and first_vs_second.distance >= self.stats.largest_agreeing:
                self.stats.largest_agreeing, self.stats.tolerance_then = first_vs_second.distance, limits.output_scale
            if settled:
                self.stats.largest_gradient = max(self.stats.largest_gradient, first_vs_second.gradient_distance)
            return Verdict.AGREED
        self.stats.disagreements += 1
        arbiter = self._other_replica(stage, {first, second})
        verdict, evidence = Verdict.UNARBITRATED, f"stage {stage}: {first_vs_second.describe()}"
        if arbiter is not None:
            third = await self._ask(stage, arbiter, hidden, probe)
            if third is not None:
                self.stats.arbitrations += 1
                verdict = arbitrate(
                    await self._compare(answers[0], third, limits), await self._compare(answers[1], third, limits)
                )
                evidence += f", arbiter {short_peer_id(arbiter)}"
        self._act(stage, verdict, first, second, evidence)
        return verdict

    async def _compare(self, first: Answer, second: Answer, limits: Limits) -> Comparison:
        """compare() on this stage's device and compute thread: the answers arrived as host tensors."""

        def compared() -> Comparison:
            to_device = self.worker.transfers.to_device_all
            on_device = [Answer(*to_device([a.output, a.grad_input])) for a in (first, second)]
            return compare(on_device[0], on_device[1], limits)

        return await self.worker.compute(compared)

    def _tolerated_divergence(self, published: float | None, first: str, second: str) -> float | None:
        """What the outputs' tolerance scales with: the larger of the stage's published divergence
        and the live distance of the two replicas compared. The published one is measured between
        phi at the last gossip round, ~0 right after a catch-up or between two replicas that
        always pair, while their live weights drift apart within a round (seen in a 3 x 2 swarm
        near step 200: published 2.5e-08, fingerprints 0.58-0.93 apart, outputs 1 - cos 0.16-0.22
        against a floor of 0.2). Either can come from a liar; it loosens the tolerance up to its
        ceiling only, which still catches the mildest fault checked for (Tolerance)."""
        live = self.replica_distance(first, second)
        known = [d for d in (published, live) if d is not None]
        return max(known) if known else None

    async def audit(self) -> Verdict | None:
        """Check a random mate of this peer's stage against this peer's own answer on its newest
        input; None when there is nothing to check with (no input in flight, no mate)."""
        if self.worker.stage == 0:
            return None

        def newest_input_on_host() -> Tensor | None:
            hidden = self.worker.store.newest_input()  # on the device: read on the compute thread
            return None if hidden is None else self.worker.transfers.to_host([hidden.detach().float()], copy=True)[0]

        hidden = await self.worker.compute(newest_input_on_host)
        if hidden is None:
            return None
        return await self.check(self.worker.stage, self.peer_id, hidden)

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

    def _act(self, stage: int, verdict: Verdict, first: str, second: str, evidence: str) -> None:
        if verdict == Verdict.UNARBITRATED:
            logger.info(f"unarbitrated disagreement of {short_peer_id(first)} and {short_peer_id(second)}: {evidence}")
            self.rate.raise_for(first, second)
            self._publish(stage, first, f"disagreement with {short_peer_id(second)}, no arbiter: {evidence}")
            return
        if verdict == Verdict.INCONCLUSIVE:
            logger.info(f"inconclusive check of stage {stage}: {evidence}")
            return
        wrong, right = (first, second) if verdict == Verdict.FIRST_WRONG else (second, first)
        if wrong == self.peer_id:
            logger.warning(f"this peer lost an audit of stage {stage} against {short_peer_id(right)}: {evidence}")
            self._publish(stage, wrong, f"lost an audit of its own stage against {short_peer_id(right)}: {evidence}")
            return
        logger.info(f"strike for {short_peer_id(wrong)} (stage {stage}): against {short_peer_id(right)}, {evidence}")
        if self.strikes.strike(wrong):
            self._ban(stage, wrong, f"{self.settings.strikes_to_ban} lost arbitrations; last: {evidence}")

    def _ban(self, stage: int, peer_id: str, evidence: str) -> None:
        self.banned[peer_id] = evidence
        # the transport's ban refuses its streams and (through its on_ban) the router's BanList keeps
        # routing and gossip away from it, until its record expires
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
        return VerificationReport(
            checks=self.stats.checks,
            disagreements=self.stats.disagreements,
            served=self.stats.served,
            largest_agreeing=self.stats.largest_agreeing,
            tolerance=self.stats.tolerance_then,
            largest_gradient=self.stats.largest_gradient,
            strikes={peer: round(score, 3) for peer, score in scores},
            bans=bans,
        )

    async def close(self) -> None:
        await self._tasks.close()
        if self.events is not None:
            await self.events.close()

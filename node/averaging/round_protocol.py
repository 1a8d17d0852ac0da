"""NoLoCo's pairwise round: one replica (A, the initiator) and one random partner (B, the responder).

On one gossip session (docs/gossip.md, "A round on the wire"):

    A: capture theta_A -> GOSSIP_REQUEST -> B: BUSY, ERROR, or capture theta_B + GOSSIP_ACCEPT
    both at once: send own phi and Delta as GOSSIP_CHUNKs / receive the partner's
    both: validate what arrived (compute thread)
    A -> B: GOSSIP_DONE{accept, reason};  B -> A: GOSSIP_DONE{accept, reason}
    B applies after sending its DONE, A after receiving it (only when both accepted)

Any failure before that (timeout, stall, disconnect, BUSY, rejection) leaves both peers' weights as
they were. Each message must move within STALL_TIMEOUT (gossip_wire.py; a reply the partner
computes first gets COMPUTE_SLACK x what the same work took us on top): a silent partner ends the
round within seconds and is left alone for STALL_COOLDOWN, the whole round is bounded by
round_timeout. The one window left: B has sent an accepting DONE and applied, the stream dies
before A reads it, A does not apply (a one-sided round: B moved toward A, A did not move;
harmless, see the doc). A replica takes part in one exchange at a time, as initiator or responder.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor

from dht.records import PeerState, short_peer_id
from node.averaging.answer_pacing import AnswerPace, UnfinishedAnswers
from node.averaging.gossip_codec import MAX_PHI_SEED, PhiDither
from node.averaging.gossip_wire import COMPUTE_SLACK, STALL_TIMEOUT, GossipWire
from node.averaging.outer_replica import RoundOutcome, RoundStart, RoundStatus
from node.averaging.round_context import RoundContext
from node.p2p.tensor_stream import Session
from node.p2p.transport import PEER_FAILURES, StreamNotOpened, TransportError
from node.runtime.timeouts import within
from protocol import Message, MessageKind, ProtocolError

__all__ = ["MAX_PARTNER_TRIES", "PairwiseRound", "PartnerBusy", "PartnerRejected", "PartnerStalled", "PartnerUpdate"]

MAX_PARTNER_TRIES = 3  # BUSY partners asked per attempt before backing off


class PartnerRejected(Exception):
    """The partner's tensors failed validation: skip the round and ban it (or, when they were
    well-formed but `implausible` and we are the stale one, catch up: RoundContext.reject)."""

    def __init__(self, reason: str, implausible: bool = False):
        super().__init__(reason)
        self.implausible = implausible


class PartnerBusy(Exception):
    """The partner is already exchanging (or has nothing to share yet)."""


class PartnerStalled(TimeoutError):
    """The partner let a message's deadline pass mid-exchange: the round ends, it cools down."""


@contextlib.contextmanager
def _silence_is_a_stall(peer: str) -> Iterator[None]:
    """A per-message deadline that passed inside the exchange is the partner's stall. (The whole
    round's deadline is enforced around the exchange, so it never surfaces in here as a timeout.)"""
    try:
        yield
    except PartnerStalled:
        raise
    except TimeoutError as e:
        raise PartnerStalled(f"{short_peer_id(peer)} went silent mid-exchange") from e


def _after_compute(own_seconds: float) -> float:
    """The deadline for a reply the partner computes first, given what the same work took us."""
    return STALL_TIMEOUT + COMPUTE_SLACK * own_seconds


@dataclass
class PartnerUpdate:
    """What the partner sent in an exchange both sides accepted."""

    peer: str
    phi: list[Tensor]
    delta: list[Tensor]
    divergence: float | None  # relative distance of our phi from the partner's, before the step
    began: float  # time.monotonic() when this side's first message of the exchange went out or came in
    sent_bytes: int  # framed bytes this side sent in the exchange


# the BUSY reason of a paced answer (an honest initiator asks its next candidate)
ANSWER_BUDGET = "gossip answer budget"


class PairwiseRound:
    """The NoLoCo round of one replica, both as initiator (`run`) and as responder (`respond`)."""

    def __init__(self, ctx: RoundContext):
        self.ctx = ctx
        self.exchanging = False  # one exchange at a time, as initiator or responder
        # answers whose round did not finish, paced in our inner steps (node/averaging/answer_pacing.py)
        self.unfinished = UnfinishedAnswers(AnswerPace(gap_steps=max(1, ctx.settings.inner_steps // 2)))

    # ---- initiator -----------------------------------------------------------------------------

    async def run(self, partner: str | None = None, alone_if_no_partner: bool = False) -> RoundOutcome:
        """One round now: with `partner`, or a uniformly random live, unbanned peer of this stage
        (another one if it answers BUSY), or alone when the stage has no other live peer.

        `alone_if_no_partner`: the round is overdue, take the lone step when no exchange succeeds,
        however the attempts ended (BUSY, refused, failed, rejected). Retrying instead lets Delta
        grow with every inner step until honest partners reject it as "far beyond the local norm"
        and ban us, which makes the next attempts fail too (seen: a replica stuck at one round
        while it took 279 inner steps)."""
        ctx = self.ctx
        round_ = ctx.replica.state.round
        if self.exchanging:
            return RoundOutcome(RoundStatus.BUSY, round_, detail="already exchanging")
        self.exchanging = True
        try:
            # the dither both sides code phi with this round: the initiator draws it and names it
            key = PhiDither(ctx.rng.randrange(MAX_PHI_SEED + 1))
            start = await ctx.capture_start(key)
            if not start.has_progress:
                return ctx.record(
                    RoundOutcome(RoundStatus.SKIPPED, round_, detail="no inner step since the last round")
                )
            candidates = [partner] if partner is not None else ctx.candidates()
            if not candidates:
                return await self._step_with(start, None)
            failure = None
            for peer in candidates[:MAX_PARTNER_TRIES]:
                try:
                    return await within(self._initiate(peer, start, key), ctx.wire.round_budget(key, peer))
                except PartnerBusy:
                    continue
                except PartnerRejected as e:
                    ctx.reject(peer, str(e), e.implausible)
                    failure = ctx.record(RoundOutcome(RoundStatus.REJECTED, round_, (peer,), str(e)))
                except PartnerStalled as e:
                    ctx.stall(peer)
                    ctx.report_failure(str(e))
                    failure = ctx.record(RoundOutcome(RoundStatus.ABORTED, round_, (peer,), str(e)))
                except StreamNotOpened as e:  # nothing was exchanged: ask the next candidate
                    ctx.unreachable(peer)
                    failure = ctx.record(RoundOutcome(RoundStatus.ABORTED, round_, (peer,), str(e)[:300]))
                    continue
                except PEER_FAILURES as e:
                    detail = f"exchange with {short_peer_id(peer)} failed: {e!r}"[:300]
                    ctx.report_failure(detail)
                    failure = ctx.record(RoundOutcome(RoundStatus.ABORTED, round_, (peer,), detail))
                break  # a partner that failed ends the attempt; only BUSY ones send us to the next
            # a replica found far behind its stage waits for the catch-up instead (its state is replaced)
            if alone_if_no_partner and not ctx.behind.is_set():
                return await self._step_with(start, None)
            return failure or ctx.record(RoundOutcome(RoundStatus.BUSY, round_, detail="every partner asked was busy"))
        finally:
            self.exchanging = False

    async def _initiate(self, peer: str, start: RoundStart, key: PhiDither) -> RoundOutcome:
        ctx = self.ctx
        began = time.monotonic()
        async with ctx.wire.open(peer, STALL_TIMEOUT) as session:
            with _silence_is_a_stall(peer):
                steps = start.inner_step - ctx.round_start_step
                await session.send(ctx.wire.request(start.state.round, steps, key.seed))
                # the partner captures its start on its compute thread before it answers
                reply = await GossipWire.recv_within(session, _after_compute(start.capture_seconds))
                if reply.kind == MessageKind.BUSY:
                    raise PartnerBusy()
                if reply.kind == MessageKind.ERROR:
                    raise TransportError(f"{short_peer_id(peer)} refused: {reply.meta.get('reason')}")
                if reply.kind != MessageKind.GOSSIP_ACCEPT:
                    raise ProtocolError(f"expected gossip_accept, got {reply.kind.value}")
                received = await self._swap(session, start)
                reason, divergence, seconds, phi, delta = await self._check(peer, start, received)
                await session.send(ctx.wire.done(start.state.round, reason))
                theirs = await GossipWire.recv_within(session, _after_compute(seconds), MessageKind.GOSSIP_DONE)
        if reason is not None:
            raise PartnerRejected(reason, implausible=divergence is not None)
        if not theirs.meta.get("accept"):
            raise TransportError(f"{short_peer_id(peer)} declined the round: {theirs.meta.get('reason')}")
        return await self._step_with(start, PartnerUpdate(peer, phi, delta, divergence, began, session.sent_bytes))

    # ---- responder -----------------------------------------------------------------------------

    async def respond(self, sender: str, session: Session, request: Message) -> None:
        """Serve a GOSSIP_REQUEST the gossip has not refused: BUSY, or a whole exchange."""
        ctx = self.ctx
        steps = request.meta.get("steps")
        partner_steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else 0
        if self.exchanging or not ctx.ripe(partner_steps) or ctx.me.state != PeerState.ONLINE:
            await session.send(ctx.wire.transport.message(MessageKind.BUSY, request_id=request.request_id))
            return
        step = ctx.worker.inner_step
        if (paced := self.unfinished.refusal(sender, step)) is not None:
            reason = {"reason": f"{ANSWER_BUDGET}: {paced}"}
            await session.send(ctx.wire.transport.message(MessageKind.BUSY, reason, request_id=request.request_id))
            return
        self.exchanging = True
        key = PhiDither(request.meta["phi_seed"])  # checked by GossipWire.refusal
        finished = False
        try:
            await within(self._answer(sender, session, key), ctx.wire.round_budget(key, sender))
            finished = True
        except PartnerRejected as e:
            ctx.reject(sender, str(e), e.implausible)
            ctx.record(RoundOutcome(RoundStatus.REJECTED, ctx.replica.state.round, (sender,), str(e)))
        except PartnerStalled as e:
            ctx.stall(sender)
            ctx.record(RoundOutcome(RoundStatus.ABORTED, ctx.replica.state.round, (sender,), f"as responder: {e}"))
        except PEER_FAILURES as e:
            ctx.record(
                RoundOutcome(RoundStatus.ABORTED, ctx.replica.state.round, (sender,), f"as responder: {e!r}"[:300])
            )
        finally:
            self.exchanging = False
            if not finished:
                self.unfinished.note(sender, step)

    async def _answer(self, sender: str, session: Session, key: PhiDither) -> None:
        ctx = self.ctx
        began = time.monotonic()
        start = await ctx.capture_start(key)
        if not start.has_progress:
            await session.send(ctx.wire.transport.message(MessageKind.BUSY))
            return
        with _silence_is_a_stall(sender):
            await session.send(ctx.wire.accept(start.state.round))
            received = await self._swap(session, start)
            reason, divergence, seconds, phi, delta = await self._check(sender, start, received)
            # the initiator validates ours meanwhile (its DONE comes after that)
            theirs = await GossipWire.recv_within(session, _after_compute(seconds), MessageKind.GOSSIP_DONE)
            await session.send(ctx.wire.done(start.state.round, reason))
        if reason is not None:
            raise PartnerRejected(reason, implausible=divergence is not None)
        if not theirs.meta.get("accept"):
            raise TransportError(f"{short_peer_id(sender)} declined the round: {theirs.meta.get('reason')}")
        await self._step_with(start, PartnerUpdate(sender, phi, delta, divergence, began, session.sent_bytes))

    # ---- both ----------------------------------------------------------------------------------

    async def _check(
        self, peer: str, start: RoundStart, received: list[Tensor]
    ) -> tuple[str | None, float | None, float, list[Tensor], list[Tensor]]:
        """ctx.check_partner, how long it took (the compute thread's queue included), and the
        partner's phi and Delta, decoded on this replica's device."""
        began = time.monotonic()
        reason, divergence, phi, delta = await self.ctx.check_partner(peer, start, received)
        return reason, divergence, time.monotonic() - began, phi, delta

    async def _swap(self, session: Session, start: RoundStart) -> list[Tensor]:
        """What I send out, the partner's tensors in (into host buffers sized from my own shapes)."""
        buffers = await self.ctx.host_buffers(start.key is not None)
        return await self.ctx.wire.swap(session, start.state.round, start.wire, buffers)

    async def _step_with(self, start: RoundStart, partner: PartnerUpdate | None) -> RoundOutcome:
        """The outer step with the partner's update, or the lone step (n = 1) without one."""
        ctx = self.ctx
        if partner is None:
            new_state = await ctx.worker.compute(ctx.replica.pairwise_step, start, [], [])
            return await ctx.finish(start, new_state, RoundOutcome(RoundStatus.LONE, start.state.round))
        new_state = await ctx.worker.compute(ctx.replica.pairwise_step, start, [partner.phi], [partner.delta])
        outcome = RoundOutcome(
            RoundStatus.APPLIED,
            start.state.round,
            (partner.peer,),
            divergence=partner.divergence,
            sent_bytes=partner.sent_bytes,
            seconds=time.monotonic() - partner.began,
        )
        return await ctx.finish(start, new_state, outcome)

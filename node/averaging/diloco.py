"""DiLoCo mode: every live replica of the stage averages in each round (docs/gossip.md, "Modes").

The first replica due for round r starts it: it captures its Delta_r, publishes it (serves it to
whoever asks) and fetches every other live replica's Delta_r, many at once, read-only:
GOSSIP_REQUEST{round: r} -> GOSSIP_ACCEPT, Delta as GOSSIP_CHUNKs, GOSSIP_DONE. A replica asked
for a round it has not started starts it on the spot, so one due replica starts the whole stage's
round. Each member takes DiLoCo's outer step with whatever Deltas it gathered in time.
hivemind's DecentralizedAverager would need hivemind.DHT's separate process, which this node does
not run.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

from torch import Tensor

from dht.records import PeerState, short_peer_id
from node.averaging.outer_replica import RoundOutcome, RoundStart, RoundStatus
from node.averaging.round_context import RoundContext
from node.p2p.tensor_stream import Session
from node.p2p.transport import PEER_FAILURES
from node.runtime.tasks import BackgroundTasks
from node.runtime.timeouts import within
from protocol import Message, MessageKind

__all__ = ["DilocoRound"]

logger = logging.getLogger(__name__)

MAX_ANSWERED = 4096  # (peer, round) pairs remembered: far more than a stage's replicas x live rounds


class DilocoRound:
    """This replica's part in the group rounds: one round at a time, started here or by a peer."""

    def __init__(self, ctx: RoundContext):
        self.ctx = ctx
        self._published: tuple[int, RoundStart] | None = None  # my Delta for a round, served on request
        self._task: asyncio.Task | None = None
        self._tasks = BackgroundTasks()
        # who got which round's Delta: once each, so a member cannot have us upload it in a loop
        self._answered: OrderedDict[tuple[str, int], None] = OrderedDict()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def forget(self) -> None:
        """Stop serving the published Delta (the outer state it was taken from was replaced)."""
        self._published = None

    async def close(self) -> None:
        await self._tasks.close()

    def _spawn(self, round_: int) -> None:
        self._task = self._tasks.spawn(self._round(round_), name=f"diloco-round-{round_}")

    async def start_round(self, round_: int) -> RoundOutcome:
        """Run my round `round_` (unless one is already running) and wait for it."""
        if not self.running:
            self._spawn(round_)
        # shielded: a caller giving up must not cancel a round the other members are counting on
        return await asyncio.shield(self._task)

    async def _round(self, round_: int) -> RoundOutcome:
        ctx = self.ctx
        start = await ctx.capture_start(None)  # every replica shares phi: Delta alone travels
        if not start.has_progress:
            return ctx.record(RoundOutcome(RoundStatus.SKIPPED, round_, detail="no inner step since the last round"))
        self._published = (round_, start)
        members = ctx.candidates()
        fetched = await asyncio.gather(*(self._fetch_delta(peer, round_, start) for peer in members))
        group = [(peer, delta) for peer, delta in zip(members, fetched) if delta is not None]
        deltas = [start.sent_delta, *(delta for _, delta in group)]  # as every member decodes them
        new_state = await ctx.worker.compute(ctx.replica.group_step, start, deltas)
        status = RoundStatus.APPLIED if group else RoundStatus.LONE
        return await ctx.finish(start, new_state, RoundOutcome(status, round_, tuple(peer for peer, _ in group)))

    async def _fetch_delta(self, peer: str, round_: int, start: RoundStart) -> list[Tensor] | None:
        """Peer's Delta for `round_`, or None (it failed, is elsewhere in time, or sent garbage)."""
        ctx = self.ctx
        wire = ctx.wire

        async def fetch() -> list[Tensor]:
            buffers = await ctx.host_buffers(False)
            async with wire.open(peer) as session:
                await session.send(wire.request(round_))
                await session.expect(MessageKind.GOSSIP_ACCEPT)
                received = await wire.recv_tensors(session, buffers)
                await session.expect(MessageKind.GOSSIP_DONE)
                return received

        try:
            received = await within(fetch(), wire.round_budget(None, peer))
        except PEER_FAILURES as e:
            logger.info(f"diloco round {round_}: no Delta from {short_peer_id(peer)}: {e!r}")
            return None
        # all replicas share phi in diloco: check the partner's Delta against ours
        reason, _, _, delta_here = await ctx.check_partner(peer, start, received)
        if reason is not None:
            ctx.reject(peer, reason)
            return None
        return delta_here

    async def serve(self, sender: str, session: Session, request: Message) -> None:
        """Stream my Delta for the requested round, once per peer; a request for my current round
        starts it."""
        ctx, wire = self.ctx, self.ctx.wire
        wanted = request.meta["round"]
        if (sender, wanted) in self._answered:
            await session.send(
                wire.transport.error(f"round {wanted}'s Delta was sent to you already", request.request_id)
            )
            return
        if self._published is None or self._published[0] != wanted:
            if not self.running:
                state = ctx.replica.state
                if wanted < state.round or not ctx.steps_since_round or ctx.me.state != PeerState.ONLINE:
                    await session.send(wire.transport.error(f"no Delta for round {wanted}", request.request_id))
                    return
                # a peer may be ahead of our round counter (we missed rounds): round labels only
                # group Deltas, so take its number
                state.round = wanted
                self._spawn(wanted)
            # our round is starting (its capture goes through the compute thread): wait for its Delta
            while self._published is None or self._published[0] != wanted:
                if not self.running:
                    await session.send(wire.transport.error(f"no Delta for round {wanted}", request.request_id))
                    return
                await asyncio.sleep(0.01)
        start = self._published[1]
        self._answered[(sender, wanted)] = None
        while len(self._answered) > MAX_ANSWERED:
            self._answered.popitem(last=False)
        await session.send(wire.accept(wanted))
        await wire.send_tensors(session, wanted, start.wire)
        await session.send(wire.transport.message(MessageKind.GOSSIP_DONE, {"round": wanted}))

"""Gossip: every H inner steps, an outer step that pulls this replica toward others of its stage.

Reads beside docs/algorithms.md ("NoLoCo: the outer step") and docs/gossip.md. This module is the
owner and scheduler: it decides when a round is due, serves the "gossip" session, holds the outer
state (through OuterReplica) and publishes what the rounds measured. The pieces:

    outer_replica.py   the outer state bound to the parameters: capture, check, apply (no network)
    noloco.py          the formulas (pure)
    gossip_wire.py     the session's messages and the chunked phi / Delta streams
    round_protocol.py  mode noloco: the pairwise round with one random partner
    diloco.py          mode diloco: the group round with every live replica
    fingerprint.py     the weight fingerprint replicas publish to measure their divergence

Inner steps keep running on the worker's compute thread while tensors move. Delta is taken at the
round start; whatever the inner optimizer did since then is carried over onto the new phi, so no
local progress is lost and the next round's Delta counts it once.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from torch import Tensor

from dht.announcer import PeerAnnouncer
from dht.records import PeerState
from dht.registry import SwarmRegistry
from dht.swarm_view import SwarmView
from node.averaging.diloco import DilocoRound
from node.averaging.fingerprint import WeightFingerprint
from node.averaging.gossip_wire import GOSSIP_SERVICE, STALL_TIMEOUT, GossipWire
from node.averaging.noloco import OuterState
from node.averaging.outer_replica import STEPPED, OuterReplica, RoundOutcome
from node.averaging.round_context import RoundContext
from node.averaging.round_protocol import PairwiseRound
from node.config import GossipConfig, GossipMode
from node.p2p.bans import BanList
from node.p2p.membership import (
    LIVENESS_PENDING,
    LivenessChecks,
    LivenessSettings,
    Membership,
    serve_liveness,
    transport_ping,
)
from node.p2p.transport import Transport
from node.runtime.events import EventPublisher
from node.runtime.timeouts import within
from node.stage.stage_worker import StageWorker
from protocol import MessageKind

__all__ = ["NOT_A_STAGE_MEMBER", "Gossip"]

# why a gossip request from a peer with no record of our stage is answered BUSY
NOT_A_STAGE_MEMBER = "gossip partners are the stage's members: no record of you at stage"

# a partner's first request waits this long for its answer to our liveness ping, well within the
# initiator's STALL_TIMEOUT for our reply
MEMBER_WAIT = 1.5
POLL_SECONDS = 0.2  # how often the round loop checks the inner-step counter


class Gossip:
    """One replica's outer optimizer and its gossip rounds (serving and initiating)."""

    def __init__(
        self,
        settings: GossipConfig,
        seed: int,
        me: PeerAnnouncer,
        worker: StageWorker,
        transport: Transport,
        *,
        view: SwarmView,
        bans: BanList,
        registry: SwarmRegistry,
        ban_until: Callable[[str], float],
        rng: random.Random | None = None,
        replica: OuterReplica | None = None,
        membership: Membership | None = None,
    ):
        """`seed`: the swarm's, from which every replica of a stage draws the same fingerprint
        projection. `membership`: the node's gate (node/p2p/membership.py), whose liveness service the node
        serves; None: a gate of this Gossip's own, its liveness service served by `start`."""
        self.settings = settings
        self.me = me
        self.worker = worker
        self.transport = transport
        self.bans = bans
        self.registry = registry
        self.rng = rng or random.Random()
        self.events = EventPublisher(registry, me.peer_id)
        self.rounds = RoundContext(
            self.settings, me, worker, transport, view, bans, ban_until, self.events, self.rng, replica
        )
        self.wire = self.rounds.wire
        self.pairwise = PairwiseRound(self.rounds)
        self.diloco = DilocoRound(self.rounds)
        self.fingerprint: list[float] | None = None
        self._serves_liveness = membership is None
        self.membership = membership or Membership(
            view, LivenessChecks(transport_ping(transport, LivenessSettings().timeout)), me.peer_id
        )
        # same seed on every replica of a stage: their fingerprints are comparable
        self._fingerprint = WeightFingerprint(self.rounds.replica.shapes, seed * 1009 + me.stage)

    # ---- what the DHT record reports -----------------------------------------------------------

    @property
    def outer_state(self) -> OuterState:
        return self.rounds.replica.state

    @property
    def last_partner(self) -> str | None:
        return self.rounds.last_partner

    @property
    def divergence(self) -> float | None:
        return self.rounds.divergence

    @property
    def steps_since_round(self) -> int:
        return self.rounds.steps_since_round

    @property
    def exchanging(self) -> bool:
        return self.pairwise.exchanging

    @property
    def behind(self) -> asyncio.Event:
        """Set when a round found this replica far behind its stage (RoundContext.reject); the
        catch-up (node/recovery/catch_up.py) clears it and takes the stage's state again."""
        return self.rounds.behind

    @property
    def behind_partner(self) -> str | None:
        """The partner whose round last showed this replica behind."""
        return self.rounds.behind_partner

    async def refresh_fingerprint(self) -> None:
        """Every heartbeat: the fingerprint to publish, and the divergences the stage published
        (the partner check scales with them)."""
        self.fingerprint = await self.worker.compute(self._fingerprint, self.rounds.replica.params)
        self.rounds.observe_stage()

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._serves_liveness:
            await serve_liveness(self.transport)
        await self.transport.serve_sessions(GOSSIP_SERVICE, self._on_session)

    async def run(self) -> None:
        """Initiate rounds whenever H inner steps passed since the last one (until cancelled).

        A due round that found no partner (all busy, or the exchange failed) is retried after a
        short random pause; one due for longer than round_timeout, or for 2H inner steps, takes the
        lone step (n = 1) when its exchange does not succeed."""
        if self.settings.mode == GossipMode.NONE:
            return
        due_since: float | None = None
        try:
            while True:
                await asyncio.sleep(POLL_SECONDS)
                if self.me.state != PeerState.ONLINE or self.steps_since_round < self.settings.inner_steps:
                    due_since = None
                    continue
                if self.pairwise.exchanging or self.diloco.running:
                    continue
                due_since = due_since or time.monotonic()
                # bounded wait for a free partner: in time, and in steps (a Delta of many more
                # steps than the partners' would fail their norm check)
                alone_ok = (
                    time.monotonic() - due_since > self.settings.round_timeout
                    or self.steps_since_round >= 2 * self.settings.inner_steps
                )
                if self.settings.mode == GossipMode.DILOCO:
                    outcome = await self.diloco.start_round(self.outer_state.round)
                else:
                    outcome = await self.run_round(alone_if_no_partner=alone_ok)
                if outcome.status in STEPPED:
                    due_since = None
                else:
                    await asyncio.sleep(self.rng.uniform(0.2, 1.0))
        finally:
            await self.close()

    async def close(self) -> None:
        await self.diloco.close()
        await self.events.close()

    async def run_round(self, partner: str | None = None, alone_if_no_partner: bool = False) -> RoundOutcome:
        """One noloco round now: with `partner`, or a uniformly random live, unbanned peer of this
        stage (another one if it answers BUSY), or alone when the stage has no other live peer
        (or, with `alone_if_no_partner`, when no exchange succeeded: PairwiseRound.run)."""
        return await self.pairwise.run(partner, alone_if_no_partner)

    async def _on_session(self, sender: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # noloco: every message of the exchange must move within STALL_TIMEOUT (the round's slot
        # is this peer's only one); diloco serves many at once, each bounded as a whole
        pairwise = self.settings.mode != GossipMode.DILOCO
        session = self.wire.session(reader, writer, STALL_TIMEOUT if pairwise else None)
        request = await GossipWire.recv_within(session, STALL_TIMEOUT)  # sent as soon as the stream opens
        refusal = self.wire.refusal(
            request, self.me.stage, self.bans.is_banned(sender), self.rounds.cooling_down(sender)
        )
        if refusal is not None:
            await session.send(self.transport.error(refusal, request.request_id))
        elif (refused := await self.membership.admit(sender, self.me.stage, wait=MEMBER_WAIT)) is not None:
            # BUSY, not ERROR: a replica online a moment ago may not be in our view yet, and an honest
            # initiator asks its next candidate after a BUSY without counting a failure
            reason = refused if refused == LIVENESS_PENDING else f"{NOT_A_STAGE_MEMBER} {self.me.stage} here"
            await session.send(
                self.transport.message(MessageKind.BUSY, {"reason": reason}, request_id=request.request_id)
            )
        elif self.settings.mode == GossipMode.DILOCO:
            await within(self.diloco.serve(sender, session, request), self.wire.round_budget(None, sender))
        else:
            await self.pairwise.respond(sender, session, request)

    # ---- the outer state, for state transfer (docs/gossip.md, "State download") ---------------

    def export_outer(self) -> dict[str, Tensor]:
        """{"phi.<param name>", "momentum.<param name>"} -> fp32 tensors (not copies: an OuterState's
        tensors are never modified in place, every outer step makes new ones)."""
        return self.rounds.replica.export_outer()

    def import_outer(self, tensors: dict[str, Tensor], round: int) -> None:
        """Adopt a downloaded outer state (ValueError if names, shapes or values are wrong). Only
        the outer state: the caller loads theta (worker.load_state_dict). The next round is due H
        inner steps from now; a round in flight when this is called is discarded."""
        self.rounds.replica.import_outer(tensors, round)
        self.rounds.restart()
        self.diloco.forget()

    async def reset_outer(self) -> None:
        """phi <- the current weights, zero momentum, same round (after weights were replaced without
        an outer state, e.g. a CheckFree rebuild): otherwise Delta = old phi - new theta would be
        huge and every honest partner would reject it."""
        await self.worker.compute(self.rounds.replica.restart_from_weights)
        self.rounds.restart()
        self.diloco.forget()

"""What every gossip round shares, whichever kind it is (NoLoCo pair, DiLoCo group).

The replica and its compute thread, the wire, which partners may be picked, and the record of how
rounds went: the outcome history, the partner and divergence the DHT record reports, the recent
replica divergences the partner check scales with, bans and dashboard events for partners that
sent bad tensors, and a cool-down for partners that stalled (docs/gossip.md, "Robustness").
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Callable

from torch import Tensor

from dht.announcer import PeerAnnouncer
from dht.records import EventKind, short_peer_id
from dht.swarm_view import SwarmView
from node.averaging.gossip_codec import PhiDither
from node.averaging.gossip_wire import STALL_COOLDOWN, GossipWire
from node.averaging.noloco import OuterState
from node.averaging.outer_replica import STEPPED, OuterReplica, RoundOutcome, RoundStart, RoundStatus
from node.averaging.plausibility import DivergenceMemory, PartnerMeasures, lagging_behind
from node.config import GossipConfig
from node.p2p.bans import BanList
from node.p2p.reachability import carries_training
from node.p2p.transport import Transport
from node.runtime.events import EventPublisher
from node.stage.access import live_parameters
from node.stage.stage_worker import StageWorker

__all__ = ["CATCH_UP_LEAD_ROUNDS", "RoundContext"]

logger = logging.getLogger(__name__)

# how far behind (in rounds' worth of inner steps, H each) a replica must be before a failed
# plausibility check reads as "we are stale" rather than "the partner is hostile"
CATCH_UP_LEAD_ROUNDS = 2
COOLDOWN_TABLE = 256  # peers a Cooldowns holds before it forgets the expired ones


class Cooldowns:
    """Peers set aside for `seconds` each (not bans: nothing says they misbehaved). Strangers with
    fresh identities could fill it: past COOLDOWN_TABLE entries, the expired ones are forgotten."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._until: dict[str, float] = {}  # peer -> monotonic time its cool-down ends

    def start(self, peer_id: str) -> None:
        now = time.monotonic()
        if len(self._until) >= COOLDOWN_TABLE:
            self._until = {peer: until for peer, until in self._until.items() if until > now}
        self._until[peer_id] = now + self.seconds

    def __contains__(self, peer_id: object) -> bool:
        until = self._until.get(peer_id)  # type: ignore[arg-type]
        if until is not None and until <= time.monotonic():
            del self._until[peer_id]  # type: ignore[arg-type]
            return False
        return until is not None


class RoundContext:
    """One replica's gossip state outside the outer state itself, and the steps every round takes."""

    def __init__(
        self,
        settings: GossipConfig,
        me: PeerAnnouncer,
        worker: StageWorker,
        transport: Transport,
        view: SwarmView,
        bans: BanList,
        ban_until: Callable[[str], float],
        events: EventPublisher,
        rng: random.Random,
        replica: OuterReplica | None = None,
    ):
        """`replica`: the outer state, built on the worker's compute thread (its first phi is a copy
        of the weights, on the stage's device: a CUDA call the event loop must not make); None
        builds it here, for a worker on the CPU."""
        self.settings = settings
        self.me = me
        self.worker = worker
        self.view = view
        self.bans = bans
        self.ban_until = ban_until
        self.events = events
        self.rng = rng
        self.replica = replica if replica is not None else OuterReplica(live_parameters(worker), settings)
        self.wire = GossipWire(transport, settings, self.replica)
        self.round_start_step = worker.inner_step  # the inner step the last counted round started at
        self.history: deque[RoundOutcome] = deque(maxlen=256)
        self.outcomes: Counter[RoundStatus] = Counter()  # every round since start, by how it ended (metrics)
        self.last_partner: str | None = None
        self.divergence: float | None = None
        self.divergences = DivergenceMemory()  # recent honest divergences: the partner check scales with them
        self.stalled = Cooldowns(STALL_COOLDOWN)  # peers neither asked nor answered (they went silent)
        self.unreached = Cooldowns(STALL_COOLDOWN)  # peers not asked (no stream to them opened)
        # set when a partner check found this replica far behind its stage; node/recovery/catch_up.py
        # waits on it and takes the stage's state again (docs/gossip.md, "Catching up")
        self.behind = asyncio.Event()
        self.behind_partner: str | None = None  # the partner whose phi showed it

    @property
    def steps_since_round(self) -> int:
        return self.worker.inner_step - self.round_start_step

    def ripe(self, partner_steps: int) -> bool:
        """Has this replica trained enough since its last round to answer a partner that took
        `partner_steps` inner steps? At least half of H and a quarter of the partner's: a Delta
        from a handful of steps would be so small that validate_partner_update would reject an
        honest partner's full-round Delta as 'far beyond the local norm'."""
        return self.steps_since_round >= max(1, self.settings.inner_steps // 2, partner_steps // 4)

    def candidates(self) -> list[str]:
        """The live, unbanned other replicas of this stage we can exchange weights with (not another
        peer behind a NAT when we are one, unless a direct link reaches it through a relay:
        node/p2p/reachability.py, traversal.py), in random order."""
        mine = self.me.record().reachability
        direct = self.wire.transport.direct
        peers = [
            p.peer_id
            for p in self.view.online(self.me.stage, exclude=self.me.peer_id)
            if not self.bans.is_banned(p.peer_id)
            and not self.cooling_down(p.peer_id)
            and p.peer_id not in self.unreached
            and carries_training(mine, p.reachability, direct is not None and direct.reaches_through_relay(p.peer_id))
        ]
        self.rng.shuffle(peers)
        return peers

    def cooling_down(self, peer_id: str) -> bool:
        """Did `peer_id` stall one of our rounds less than STALL_COOLDOWN seconds ago?"""
        return peer_id in self.stalled

    def stall(self, peer_id: str) -> None:
        """`peer_id` went silent in an exchange: leave it alone for STALL_COOLDOWN seconds. Not a
        ban: a frozen or cut-off honest peer looks the same, and a ban would also stop routing."""
        self.stalled.start(peer_id)

    def unreachable(self, peer_id: str) -> None:
        """No stream to `peer_id` opened (its record outlived it, or it serves no gossip): do not
        ask it for STALL_COOLDOWN seconds. It may still ask us: nothing says it misbehaved."""
        self.unreached.start(peer_id)

    def observe_stage(self) -> None:
        """Note the divergences the stage's other peers publish (every heartbeat)."""
        now = time.monotonic()
        for record in self.view.online(self.me.stage, exclude=self.me.peer_id):
            if record.divergence is not None:
                self.divergences.note_published(record.peer_id, record.divergence, now)

    def restart(self) -> None:
        """The outer state was replaced from outside: the next round is due H inner steps from now."""
        self.round_start_step = self.worker.inner_step

    # ---- work on the compute thread ------------------------------------------------------------

    async def capture_start(self, key: PhiDither | None) -> RoundStart:
        worker, replica = self.worker, self.replica
        began = time.monotonic()
        # the step counter is read on the compute thread too: theta and the step must match
        start = await worker.compute(lambda: replica.capture_start(worker.inner_step, key))
        start.capture_seconds = time.monotonic() - began
        return start

    def distance_limit(self, partner: str) -> float:
        """How far (relative distance) the partner's phi may be from ours: scaled with the largest
        divergence of the last minutes, not counting what the partner itself published."""
        bounds = self.replica.bounds
        reference = self.divergences.reference(time.monotonic(), exclude=partner, min_own=bounds.min_observations)
        return bounds.distance_limit(reference)

    async def host_buffers(self, with_phi: bool) -> list[Tensor]:
        """Host buffers for a partner's tensors of a round (allocated on the compute thread: pinned
        memory on a GPU is a CUDA call, which the event loop never makes)."""
        return await self.worker.compute(self.replica.host_buffers, with_phi)

    async def check_partner(
        self, partner: str, start: RoundStart, received: list[Tensor]
    ) -> tuple[str | None, float | None, list[Tensor], list[Tensor]]:
        """The partner's tensors (as received, on the host) moved to this replica's device, decoded
        and checked there: (why the update is refused, None) or (None, the relative distance of
        its phi), with its phi and Delta on the device for the outer step."""
        limit = self.distance_limit(partner)

        def on_device() -> tuple[str | None, PartnerMeasures | None, list[Tensor], list[Tensor]]:
            phi_here, delta_here, edge_share = self.replica.receive(received, start)
            verdict = self.replica.check_partner(start, phi_here, delta_here, limit, edge_share)
            return (*verdict, phi_here, delta_here)

        reason, measures, phi_here, delta_here = await self.worker.compute(on_device)
        if measures is not None:  # once per round: what an honest partner measures is how the bounds are set
            logger.info(f"partner {short_peer_id(partner)}: {measures.describe()}, distance limit {limit:.3g}")
        return reason, None if measures is None else measures.distance, phi_here, delta_here

    async def finish(self, start: RoundStart, new_state: OuterState, outcome: RoundOutcome) -> RoundOutcome:
        """Apply `new_state` (computed from `start`) and record `outcome`, or record an abort if
        the outer state was replaced since the round started."""
        if not await self.worker.compute(self.replica.apply, start, new_state):
            return self.record(
                RoundOutcome(RoundStatus.ABORTED, start.state.round, outcome.partners, "outer state replaced")
            )
        self.round_start_step = start.inner_step
        if outcome.partners:
            self.last_partner = outcome.partners[0] if len(outcome.partners) == 1 else self.last_partner
            self.divergence = outcome.divergence
            if outcome.divergence is not None:
                self.divergences.note_own(outcome.divergence, time.monotonic())
        return self.record(outcome)

    # ---- reporting -----------------------------------------------------------------------------

    def record(self, outcome: RoundOutcome) -> RoundOutcome:
        self.history.append(outcome)
        self.outcomes[outcome.status] += 1
        who = ",".join(short_peer_id(p) for p in outcome.partners) or "alone"
        if outcome.status in STEPPED:
            div = "" if outcome.divergence is None else f", divergence {outcome.divergence:.3g}"
            moved = ""
            if outcome.sent_bytes is not None and outcome.seconds is not None:
                moved = f", sent {outcome.sent_bytes} bytes in {outcome.seconds:.2f} s"
            logger.info(f"outer round {outcome.round} -> {outcome.round + 1} with {who}{div}{moved}")
        elif outcome.status in (RoundStatus.ABORTED, RoundStatus.REJECTED):
            logger.info(f"gossip round {outcome.round} with {who} {outcome.status}: {outcome.detail}")
        return outcome

    def lags_behind(self, partner: str) -> bool:
        """Are we, not `partner`, the stale replica (plausibility.lagging_behind on the published steps)?"""
        steps = {p.peer_id: p.inner_step for p in self.view.online(self.me.stage, exclude=self.me.peer_id)}
        lead = CATCH_UP_LEAD_ROUNDS * self.settings.inner_steps
        return lagging_behind(self.worker.inner_step, partner, steps, lead)

    def partner_far_behind(self, partner: str) -> bool:
        """Is `partner` the stale one, by its published step (as far behind us as `lags_behind` asks)?"""
        record = next((p for p in self.view.online(self.me.stage) if p.peer_id == partner), None)
        lead = CATCH_UP_LEAD_ROUNDS * self.settings.inner_steps
        return record is not None and record.inner_step + lead <= self.worker.inner_step

    def reject(self, peer_id: str, reason: str, implausible: bool = False) -> None:
        """Ban a peer whose tensors failed validation and tell the dashboard; but when they were
        well-formed (`implausible`: only the plausibility check failed) and this replica is the one
        far behind the stage, ask for a catch-up instead (`behind`) and ban nobody; when the
        partner is the one far behind us, decline the round and ban nobody (it catches up)."""
        if implausible and self.lags_behind(peer_id):
            self.behind_partner = peer_id
            self.behind.set()
            logger.warning(
                f"gossip from {short_peer_id(peer_id)} failed the plausibility check ({reason}), but this replica "
                f"(inner step {self.worker.inner_step}) is far behind it and most of its stage: catching up"
            )
            return
        if implausible and self.partner_far_behind(peer_id):  # it will catch up from us: decline, ban nobody
            logger.info(f"declined gossip from {short_peer_id(peer_id)}, far behind this replica: {reason}")
            return
        self.bans.ban(peer_id, self.ban_until(peer_id), f"gossip: {reason}")
        logger.warning(f"rejected gossip from {short_peer_id(peer_id)} and banned it: {reason}")
        self.events.publish(
            EventKind.BAN,
            self.me.stage,
            peer_id=peer_id,
            detail=(f"gossip from {short_peer_id(peer_id)} rejected by {short_peer_id(self.me.peer_id)}: {reason}"),
        )

    def report_failure(self, detail: str) -> None:
        """An exchange this peer started broke off (shown on the dashboard, never acted upon)."""
        self.events.publish(EventKind.GOSSIP_FAILURE, self.me.stage, detail)

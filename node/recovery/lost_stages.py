"""Lost stages: noticing them from the DHT, and knowing when the swarm cannot be saved.

Reads beside docs/recovery.md ("Rebuilding lost stages", "Detection", "Unrecoverable") and
docs/algorithms.md ("Rebuild plans"). Rebuilding a lost stage is node/recovery/rebuild.py's job;
this module only decides which stages are lost:

- A stage is *lost* when no peer of it is live (`online` or `rebuilding`) for longer than
  `recovery.lost_grace`, after the swarm has trained (some live peer has taken an optimizer
  step). Before any step a missing stage is merely *empty*: a fresh init from the swarm seed is as
  good as the weights that died.
- Every peer runs a `LostStageWatch` over its SwarmView, so all of them reach the same verdict from
  the same DHT records; the lowest live peer id (`reporter`) publishes it as a SwarmEvent so
  one-shot observers (`node status`, the dashboard) see it too (`lost_stages_from_events`).
- Unrecoverable: `checkfree.unrecoverable` over the currently lost stages; stage-0 peers stop
  driving microbatches while it holds (training garbage would be worse than waiting).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dht.announcer import PeerAnnouncer
from dht.records import EventKind, PeerRecord, PeerState, SwarmEvent
from dht.registry import SwarmRegistry
from node.config import RecoveryConfig
from node.recovery.checkfree import unrecoverable
from node.runtime.events import EventPublisher
from node.runtime.tasks import BackgroundTasks

logger = logging.getLogger(__name__)

__all__ = [
    "LIVE_STATES",
    "LOST_EVENT_REFRESH",
    "LostStageTracker",
    "LostStageWatch",
    "live_peers",
    "lost_stages_from_events",
    "must_rebuild",
    "reporter",
    "swarm_has_trained",
]

LIVE_STATES = (PeerState.ONLINE, PeerState.REBUILDING)
LOST_EVENT_REFRESH = 100.0  # re-announce a stage still lost before its event (TTL 300 s) expires

PeersByStage = Mapping[int, Sequence[PeerRecord]]


def live_peers(peers: Sequence[PeerRecord], exclude: str | None = None) -> list[PeerRecord]:
    """Peers that hold the stage's weights now: `online`, or `rebuilding` them."""
    return [peer for peer in peers if peer.state in LIVE_STATES and peer.peer_id != exclude]


def swarm_has_trained(peers_by_stage: PeersByStage, exclude: str | None = None) -> bool:
    """Whether some live peer has taken an optimizer step: from then on weights are worth keeping."""
    return any(peer.inner_step > 0 for peers in peers_by_stage.values() for peer in live_peers(peers, exclude))


def must_rebuild(peers_by_stage: PeersByStage, stage: int, me: str) -> bool:
    """Whether a peer taking `stage` has to rebuild it: nobody else is online there to download the
    stage from, and the swarm has trained (an untrained swarm's empty stage starts from the seed)."""
    donors = [peer for peer in peers_by_stage.get(stage, ()) if peer.state == PeerState.ONLINE and peer.peer_id != me]
    if donors:
        return False
    trained = swarm_has_trained(peers_by_stage, exclude=me)
    seen = {s: [(str(p.state), p.inner_step) for p in peers] for s, peers in peers_by_stage.items()}
    logger.info(
        f"stage {stage} has no online peer to download from; the swarm has "
        f"{'trained: rebuilding it' if trained else 'not trained: starting from the seed'} (seen: {seen})"
    )
    return trained


@dataclass
class LostStageTracker:
    """Since when each stage has had no live peer (in a trained swarm); pure bookkeeping.

    Feed it every fresh DHT picture with `observe`; `lost_stages(now)` are those empty for longer
    than `lost_grace`. Peers' records vanish TTL after their last heartbeat, so a stage is declared
    lost about TTL + lost_grace after its last peer died.
    """

    num_stages: int
    lost_grace: float
    empty_since: dict[int, float] = field(default_factory=dict)

    def observe(self, peers_by_stage: PeersByStage, now: float) -> None:
        trained = swarm_has_trained(peers_by_stage)
        for stage in range(self.num_stages):
            if live_peers(peers_by_stage.get(stage, ())):
                self.empty_since.pop(stage, None)
            elif trained:
                self.empty_since.setdefault(stage, now)

    def lost_for(self, stage: int, now: float) -> float:
        """Seconds stage has been lost (0.0 if it is not lost)."""
        since = self.empty_since.get(stage)
        if since is None or now - since < self.lost_grace:
            return 0.0
        return now - since - self.lost_grace

    def lost_stages(self, now: float) -> set[int]:
        return {stage for stage, since in self.empty_since.items() if now - since >= self.lost_grace}


def reporter(peers_by_stage: PeersByStage) -> str | None:
    """The one live peer that publishes swarm-wide verdicts (lowest peer id): one event, not N."""
    ids = [peer.peer_id for peers in peers_by_stage.values() for peer in live_peers(peers)]
    return min(ids) if ids else None


class LostStageWatch:
    """One peer's running verdict on lost stages, updated on every SwarmView refresh.

    `lost` and `unrecoverable_reason` are read by the stage-0 driver (pause) and the rebalancer;
    transitions are logged here, and published as events when this peer is the reporter.
    """

    def __init__(
        self,
        recovery: RecoveryConfig,
        num_stages: int,
        registry: SwarmRegistry,
        me: PeerAnnouncer,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.recovery, self.num_stages = recovery, num_stages
        self.me = me
        self.clock = clock
        self.events = EventPublisher(registry, me.peer_id)
        self.tracker = LostStageTracker(num_stages, recovery.lost_grace)
        self.lost: set[int] = set()
        self.unrecoverable_reason: str | None = None
        self._reported: dict[tuple[EventKind, int | None], float] = {}  # (kind, stage) -> when last published
        # our own holder rather than EventPublisher.publish: a failed publish must be forgotten
        # (see _publish) so the next refresh retries, not LOST_EVENT_REFRESH later
        self._publishing = BackgroundTasks()

    def lost_for(self, stage: int) -> float:
        return self.tracker.lost_for(stage, self.clock())

    def on_refresh(self, peers_by_stage: PeersByStage) -> None:
        """SwarmView listener (synchronous: it runs inside the view's refresh)."""
        now = self.clock()
        self.tracker.observe(peers_by_stage, now)
        lost = self.tracker.lost_stages(now)
        recovery = self.recovery
        reason = unrecoverable(lost, self.num_stages, recovery.strategy, recovery.checkfree_plus) if lost else None
        for stage in sorted(lost - self.lost):
            logger.warning(f"stage {stage} is lost: no live peer for over {recovery.lost_grace:.0f} s")
        for stage in sorted(self.lost - lost):
            logger.info(f"stage {stage} is served again")
            self._reported.pop((EventKind.LOST, stage), None)
        if reason is not None and reason != self.unrecoverable_reason:
            logger.error(
                f"the swarm cannot recover from losing stages {sorted(lost)}: {reason}; "
                f"stage 0 stops training until those stages are served again (e.g. from checkpoints)"
            )
        if reason is None and self.unrecoverable_reason is not None:
            logger.info("the swarm is recoverable again")
            self._reported.pop((EventKind.UNRECOVERABLE, None), None)
        self.lost, self.unrecoverable_reason = lost, reason
        if reporter(peers_by_stage) == self.me.peer_id:
            for stage in sorted(lost):
                self._publish_due(
                    EventKind.LOST,
                    stage,
                    f"stage {stage} has had no live peer for over {recovery.lost_grace:.0f} s",
                    now,
                )
            if reason is not None:
                self._publish_due(EventKind.UNRECOVERABLE, None, reason, now)

    def _publish_due(self, kind: EventKind, stage: int | None, detail: str, now: float) -> None:
        """Publish unless the same verdict went out less than LOST_EVENT_REFRESH seconds ago."""
        last = self._reported.get((kind, stage))
        if last is not None and now - last < LOST_EVENT_REFRESH:
            return
        self._reported[(kind, stage)] = now
        event = SwarmEvent(time=time.time(), kind=kind, peer_id=self.me.peer_id, stage=stage, detail=detail)
        self._publishing.spawn(self._publish(event), name=f"event-{kind}")

    async def _publish(self, event: SwarmEvent) -> None:
        if not await self.events.publish_now(event):  # best effort: the next refresh period retries
            self._reported.pop((EventKind(event.kind), event.stage), None)

    def close(self) -> None:
        """Cancel publishes still under way (synchronous: the stage service's cleanup calls it)."""
        self._publishing.cancel()


def lost_stages_from_events(peers_by_stage: PeersByStage, events: Sequence[SwarmEvent], num_stages: int) -> set[int]:
    """What a one-shot observer can tell: stages with no live peer whose latest lost/rebuild event
    says "lost" (the peers only publish it after lost_grace, so the grace is honoured)."""
    latest: dict[int, SwarmEvent] = {}
    for event in events:
        if event.kind in (EventKind.LOST, EventKind.REBUILD) and event.stage is not None:
            if event.stage not in latest or event.time >= latest[event.stage].time:
                latest[event.stage] = event
    return {
        stage
        for stage in range(num_stages)
        if not live_peers(peers_by_stage.get(stage, ())) and stage in latest and latest[stage].kind == EventKind.LOST
    }

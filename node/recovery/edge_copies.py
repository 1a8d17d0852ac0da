"""CheckFree+ edge copies: stage 1 keeps a copy of stage 0's embedding, stage S of its final norm
and LM head, so a lost stage 0 can be rebuilt (docs/algorithms.md, "CheckFree+: out-of-order
pipeline, edge stages"). Small extra storage, no extra compute: the copies only travel.

Refresh rule (RecoveryConfig.edge_copy_interval, counted in stage-0 optimizer steps): a holder
refreshes when the most advanced online stage-0 peer announces an inner_step at least
`edge_copy_interval` past the step of the copy it holds, checked every `check_period` seconds
(the heartbeat period: that is how often the announced steps change). Steps rather than seconds,
because what a stale copy loses is training progress: a stalled swarm costs no traffic, a fast
one never lets the copy fall more than one interval behind. Without any copy the holder fetches
at once.

A copy is served back through the "state" service as part "edge_copy"; its inner_step is the
stage-0 step it was taken at, and weights hold the stage-0 names (embed_tokens.weight, or
norm.weight + lm_head.weight, or all three when S = 1 and stage 1 holds both).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from torch import Tensor

from dht.records import PeerRecord, PeerState
from node.config import RecoveryConfig, RecoveryStrategy
from node.p2p.transport import Transport, TransportError
from node.recovery.state_transfer import download_from_any, state_on_device
from node.stage.stage_worker import StageWorker
from protocol.stage_state import StageState, StatePart, StateUnavailable

logger = logging.getLogger(__name__)

__all__ = [
    "EdgeCopies",
    "edge_copies_for",
    "edge_parts_for",
    "refresh_due",
    "refresh_edge_copies",
    "run_edge_copy_refresher",
]


# the strategies whose plan_rebuild rebuilds stage 0 from these copies (docs/algorithms.md, "Rebuild plans")
EDGE_COPY_STRATEGIES = (RecoveryStrategy.CHECKFREE, RecoveryStrategy.COPY)


def edge_parts_for(stage: int, num_stages: int) -> tuple[StatePart, ...]:
    """Which stage-0 parts a peer of `stage` keeps: stage 1 "embed", stage S "head" (both if S = 1)."""
    last = num_stages - 1
    parts = []
    if stage == 1:
        parts.append(StatePart.EMBED)
    if stage == last and last >= 1:
        parts.append(StatePart.HEAD)
    return tuple(parts)


def edge_copies_for(recovery: RecoveryConfig, num_stages: int, stage: int) -> EdgeCopies | None:
    """The copies a peer of `stage` keeps, or None: only stage 1 / stage S peers, only with
    CheckFree+ and a strategy that rebuilds stage 0 from them (checkfree, copy; see plan_rebuild)."""
    parts = edge_parts_for(stage, num_stages)
    if not (parts and recovery.checkfree_plus and recovery.strategy in EDGE_COPY_STRATEGIES):
        return None
    return EdgeCopies(stage=stage, parts=parts)


@dataclass
class EdgeCopy:
    weights: dict[str, Tensor]
    inner_step: int  # stage 0's inner step when the copy was taken


@dataclass
class EdgeCopies:
    """The latest copies of stage-0 parts this peer holds, by part ("embed", "head")."""

    stage: int
    parts: tuple[StatePart, ...]
    copies: dict[StatePart, EdgeCopy] = field(default_factory=dict)

    def update(self, part: StatePart, state: StageState) -> None:
        if part not in self.parts:
            raise ValueError(f"stage {self.stage} keeps {[str(p) for p in self.parts]}, not '{part}'")
        self.copies[part] = EdgeCopy(state.weights, state.inner_step)

    def step_of(self, part: StatePart) -> int | None:
        copy = self.copies.get(part)
        return None if copy is None else copy.inner_step

    def merged_state(self) -> StageState:
        """All copies held, merged (part "edge_copy"); inner_step is the oldest copy's step. The
        tensors are replaced, never modified, on refresh: handing them out without a copy is safe."""
        if not self.copies:
            raise StateUnavailable(f"stage {self.stage} holds no edge copy yet")
        weights: dict[str, Tensor] = {}
        for copy in self.copies.values():
            weights.update(copy.weights)
        return StageState(stage=self.stage, weights=weights, inner_step=min(c.inner_step for c in self.copies.values()))


def refresh_due(copy_step: int | None, stage0_peers: Sequence[PeerRecord], interval: int) -> bool:
    """Whether a copy taken at `copy_step` (None: no copy yet) should be refreshed now."""
    online = [peer for peer in stage0_peers if peer.state == PeerState.ONLINE]
    if not online:
        return False
    return copy_step is None or max(peer.inner_step for peer in online) >= copy_step + interval


async def refresh_edge_copies(
    copies: EdgeCopies,
    transport: Transport,
    stage0_peers: Sequence[PeerRecord],
    interval: int,
    rng: random.Random,
    *,
    worker: StageWorker | None = None,
    force: bool = False,
) -> list[StatePart]:
    """Refresh every due part from a stage-0 peer; returns the parts refreshed. A failed download
    keeps the previous copy (stale beats none) and is retried at the next check. With `worker`
    (the holder's own), a copy is kept on its device, moved there on its compute thread."""
    refreshed = []
    for part in copies.parts:
        if not (force or refresh_due(copies.step_of(part), stage0_peers, interval)):
            continue
        try:
            state = await download_from_any(transport, stage0_peers, 0, part, rng)
        except TransportError as e:
            logger.warning(f"edge copy {part} not refreshed: {e}")
            continue
        if worker is not None:
            state = await worker.compute(state_on_device, state, worker.transfers)
        copies.update(part, state)
        refreshed.append(part)
        logger.info(f"edge copy {part} refreshed at stage-0 step {state.inner_step}")
    return refreshed


async def run_edge_copy_refresher(
    copies: EdgeCopies,
    transport: Transport,
    stage0_peers: Callable[[], Sequence[PeerRecord]],
    interval: int,
    check_period: float,
    rng: random.Random,
    worker: StageWorker | None = None,
) -> None:
    """Keep `copies` fresh until cancelled (on `worker`'s device); `stage0_peers` reads the swarm view."""
    while True:
        await refresh_edge_copies(copies, transport, stage0_peers(), interval, rng, worker=worker)
        await asyncio.sleep(check_period)

"""Moving a serving peer to a lost stage nobody joined (Petals-style rebalancing), and what a move
needs: leaving the old stage's record and handlers behind without restarting the process.

The rule (docs/recovery.md, "Rebuilding lost stages"): a newly joining `--stage auto` peer takes a
lost stage first (stage choice picks the lowest total throughput, and a lost stage has none). When
nobody has joined it `recovery.rebalance_wait` seconds after it was declared lost, one peer moves:
- the target is the lost stage (the lowest-numbered one if several), and only if the swarm can be
  recovered at all (checkfree.unrecoverable over the lost stages is None: a move cannot fix two
  adjacent lost stages and would only weaken another stage);
- the donor is the stage with the most online peers (ties: the higher summed throughput, then the
  lower stage), and it must keep at least one online peer: a move never empties a stage;
- it clearly improves the weakest stage: from zero throughput to some (Petals moves only on a
  clear gain; filling a lost stage is the clearest there is);
- exactly one peer moves: the donor's online peer with the lowest peer id, a rank every peer
  computes alike from the same DHT records;
- check twice: the same move must come out of two checks at least `confirm_after` seconds apart
  (one refresh later a joiner that has just claimed the stage shows up, and the move is dropped).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dht.records import PeerRecord, PeerState

logger = logging.getLogger(__name__)

__all__ = ["Move", "Rebalancer", "plan_move"]


@dataclass(frozen=True)
class Move:
    target: int
    donor: int
    peer_id: str  # the one peer that moves


def _online(peers: Sequence[PeerRecord]) -> list[PeerRecord]:
    return [peer for peer in peers if peer.state == PeerState.ONLINE]


def plan_move(
    peers_by_stage: Mapping[int, Sequence[PeerRecord]],
    num_stages: int,
    lost_for: Mapping[int, float],
    rebalance_wait: float,
    unrecoverable_reason: str | None,
) -> Move | None:
    """The move the swarm should make now, or None. `lost_for` maps a stage to the seconds it has
    been lost (0 or absent: not lost). Every peer computes the same answer from the same picture."""
    if unrecoverable_reason is not None:
        return None
    waiting = sorted(stage for stage, seconds in lost_for.items() if seconds >= rebalance_wait)
    # a joiner may already be on its way (joining or rebuilding): leave that stage to it
    waiting = [s for s in waiting if not any(p.state != PeerState.LEAVING for p in peers_by_stage.get(s, ()))]
    if not waiting:
        return None
    target = waiting[0]
    donors = []
    for stage in range(num_stages):
        online = _online(peers_by_stage.get(stage, ()))
        if stage != target and len(online) >= 2:
            donors.append((-len(online), -sum(p.throughput for p in online), stage, online))
    if not donors:
        return None
    _, _, donor, online = min(donors)
    mover = min(peer.peer_id for peer in online)
    return Move(target, donor, mover)


class Rebalancer:
    """Confirms a move seen twice before acting on it (explicit state: the pending move and since when)."""

    def __init__(self, confirm_after: float):
        self.confirm_after = confirm_after
        self.pending: Move | None = None
        self.pending_since = 0.0

    def check(self, move: Move | None, now: float) -> Move | None:
        """Feed the latest plan_move result; returns it once it has held for confirm_after seconds."""
        if move != self.pending:
            self.pending, self.pending_since = move, now
            return None
        if move is not None and now - self.pending_since >= self.confirm_after:
            return move
        return None

"""How a peer that starts serving a stage gets the stage's weights: one path for joiners and movers.

Reads beside docs/recovery.md ("Joining a stage"). Three outcomes, in order of preference:

- LIVE: an online peer holds the stage: download its state (node/recovery/state_transfer.py);
- SEED: nobody holds it and the swarm has not trained yet: the seed's weights are the stage;
- REBUILT: nobody holds it in a trained swarm: rebuild it from the neighbours (node/recovery/rebuild.py).

Under churn the picture a joiner reads changes while it works: the donors of a live stage die, the
neighbours a rebuild needs are themselves lost for a while (two adjacent stages struck together), a
fresh DHT node reads some stages empty at first. None of that is a reason to give up on a peer
that came to help, so a failed attempt is retried on a fresh picture, with a growing pause, until
one of the outcomes holds (or the daemon is stopped, which cancels the wait). Only a stage the
swarm's recovery strategy has no way to rebuild at all (`RebuildImpossible`, e.g. the only block
stage of a 2-stage swarm) ends the attempt: the daemon refuses the join in one line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum

from dht.records import PeerState
from dht.registry import SwarmRegistry
from node.p2p.transport import TransportError
from node.recovery.lost_stages import must_rebuild
from node.recovery.rebuild import RebuildFailed, RebuildImpossible, rebuild_into_service
from node.recovery.state_transfer import StageParts, join_live_stage
from node.runtime.byte_progress import ByteProgress

logger = logging.getLogger(__name__)

__all__ = ["EntryPatience", "StageEntry", "enter_stage"]


class StageEntry(StrEnum):
    """Where a peer's weights for its stage came from."""

    LIVE = "live"
    SEED = "seed"
    REBUILT = "rebuilt"


@dataclass(frozen=True)
class EntryPatience:
    """Pauses between attempts to enter a stage: `first` seconds, growing by `growth` up to `longest`
    (a lost neighbour comes back within a join and a rebuild, tens of seconds; a pause much longer
    than that would leave the stage empty after its neighbours are back)."""

    first: float = 2.0
    growth: float = 1.5
    longest: float = 15.0

    def pauses(self) -> Iterator[float]:
        pause = self.first
        while True:
            yield pause
            pause = min(pause * self.growth, self.longest)


async def enter_stage(
    service: StageParts,
    registry: SwarmRegistry,
    progress: ByteProgress | None = None,
    patience: EntryPatience = EntryPatience(),
) -> StageEntry:
    """Give `service.worker` this peer's stage's weights (the peer stays `joining` or `rebuilding`
    meanwhile, so nobody routes to it). Raises RebuildImpossible when the stage can never be rebuilt."""
    me = service.me
    pauses = patience.pauses()
    attempt = 0
    while True:  # ends by returning, RebuildImpossible, or cancellation (the daemon stops)
        attempt += 1
        try:
            if service.view.online(me.stage, exclude=me.peer_id):
                if await join_live_stage(service, progress=progress):
                    return StageEntry.LIVE
            if not must_rebuild(service.view.peers_by_stage, me.stage, me.peer_id):
                return StageEntry.SEED
            await rebuild_into_service(service, registry)
            return StageEntry.REBUILT
        except RebuildImpossible:  # nothing to wait for
            raise
        except TransportError as e:  # every live donor failed, several rounds
            failure = f"joining stage {me.stage} failed: {e}"
        except RebuildFailed as e:
            failure = f"rebuild of stage {me.stage} failed: {e}"
        # between attempts this peer holds nothing: `rebuilding` would count it as holding the stage, and
        # the rebalancer (node/recovery/rebalance.py) would never send a healthy peer to help
        me.set_state(PeerState.JOINING)
        pause = next(pauses)
        logger.warning(f"{failure} (attempt {attempt}); looking again in {pause:.0f} s")
        await asyncio.sleep(pause)
        await service.view.refresh()

"""How a peer that starts serving a stage gets the stage's weights: one path for joiners and movers.

Reads beside docs/recovery.md ("Entering a stage under churn"). Three outcomes, in order of preference:

- LIVE: an online peer holds the stage: download its state (node/recovery/state_transfer.py);
- SEED: nobody holds it and the swarm has not trained yet: the seed's weights are the stage;
- REBUILT: nobody holds it in a trained swarm: rebuild it from the neighbours (node/recovery/rebuild.py).

Under churn the picture a joiner reads changes while it works: the donors of a live stage die, the
neighbours a rebuild needs are themselves lost for a while (two adjacent stages struck together), a
fresh DHT node reads some stages empty at first. None of that is a reason to give up on a peer
that came to help, so a failed attempt is retried on a fresh picture, with a growing pause, until
one of the outcomes holds. Two things end it early, and the daemon then refuses the join in one
line: a stage the swarm's recovery strategy has no way to rebuild at all (`RebuildImpossible`,
e.g. the only block stage of a 2-stage swarm), and `EntryPatience.give_up` seconds without
success (`EntryGaveUp`): a peer stuck in `joining` (say, one that cannot reach any donor from its
network) would otherwise hold the stage forever, since the rebalancer leaves a stage with a
joiner on its way to that joiner.
"""

from __future__ import annotations

import asyncio
import logging
import time
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

__all__ = ["EntryGaveUp", "EntryPatience", "StageEntry", "enter_stage"]


class StageEntry(StrEnum):
    """Where a peer's weights for its stage came from."""

    LIVE = "live"
    SEED = "seed"
    REBUILT = "rebuilt"


class EntryGaveUp(RuntimeError):
    """The stage's weights could not be had within EntryPatience.give_up seconds (the last reason)."""


@dataclass(frozen=True)
class EntryPatience:
    """Pauses between attempts to enter a stage: `first` seconds, growing by `growth` up to `longest`
    (a lost neighbour comes back within a join and a rebuild, tens of seconds; a pause much longer
    than that would leave the stage empty after its neighbours are back). No attempt starts after
    `give_up` seconds: a few recoveries' worth (the chaos test's bound on one is 60 s)."""

    first: float = 2.0
    growth: float = 1.5
    longest: float = 15.0
    give_up: float = 180.0

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
    meanwhile, so nobody routes to it). Raises RebuildImpossible when the stage can never be rebuilt,
    EntryGaveUp when it could not be had within `patience.give_up` seconds."""
    me = service.me
    pauses = patience.pauses()
    started = time.monotonic()
    attempt = 0
    while True:  # ends by returning, raising, or cancellation (the daemon stops)
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
        # between attempts this peer holds nothing, and a `rebuilding` record says it holds the stage's
        # weights (lost_stages.live_peers): the stage would not count as lost while it waits
        me.set_state(PeerState.JOINING)
        pause = next(pauses)
        if time.monotonic() - started + pause > patience.give_up:
            raise EntryGaveUp(f"no success in {patience.give_up:.0f} s ({attempt} attempts); the last: {failure}")
        logger.warning(f"{failure} (attempt {attempt}); looking again in {pause:.0f} s")
        await asyncio.sleep(pause)
        await service.view.refresh()

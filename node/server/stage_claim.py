"""Claiming a stage on join: the explicit `--stage`, or the automatic choice with announce-and-recheck
(the rule itself is node/server/stage_choice.py)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Collection

from dht.announcer import PeerAnnouncer
from dht.records import PeerRecord
from dht.registry import SwarmRegistry
from node.server.stage_choice import choose_stage, needier_than, should_move, stage_loads

logger = logging.getLogger(__name__)


class StageOutOfRange(ValueError):
    """An explicit --stage the swarm does not have."""


async def claim_stage(
    me: PeerAnnouncer,
    registry: SwarmRegistry,
    num_stages: int,
    requested: str,
    *,
    rng: random.Random | None = None,
    jitter: float = 2.0,
    settle: float = 1.5,
    max_rounds: int = 4,
    allowed: Collection[int] | None = None,
) -> int:
    """Announce `me` as `joining` the requested stage ("auto" or a number) and return the stage.

    With "auto": after a random delay pick the stage that needs help most among the `allowed`
    (those this peer's device holds; None: any), announce it tentatively, then re-read up to
    `max_rounds` times and move while `should_move` says so (the tentative record on the old stage
    is withdrawn as `leaving`)."""
    if requested != "auto":
        stage = int(requested)
        if not 0 <= stage < num_stages:
            raise StageOutOfRange(f"--stage {stage} is outside this swarm's stages 0..{num_stages - 1}")
        await me.claim(stage)
        return stage
    rng = rng or random.Random()
    reader = _PeerReader(registry, num_stages)
    await asyncio.sleep(rng.uniform(0.0, jitter))
    loads = stage_loads(await reader.read(), num_stages)
    chosen = choose_stage(loads, rng, allowed)
    skipped = [stage for stage in needier_than(loads, chosen) if allowed is not None and stage not in allowed]
    if skipped:
        logger.info(f"stage(s) {skipped} need help more but do not fit this device: taking stage {chosen}")
    await me.claim(chosen)
    for _ in range(max_rounds):
        await asyncio.sleep(settle * rng.uniform(1.0, 2.0))
        peers = dict(await reader.read())
        mine = me.record()
        # our own announcement may not have propagated to every replica yet: count it regardless
        peers[mine.stage] = [p for p in peers.get(mine.stage, ()) if p.peer_id != mine.peer_id] + [mine]
        target = should_move(peers, num_stages, mine, rng, allowed)
        if target is None:
            break
        await me.claim(target)
    return me.stage


class _PeerReader:
    """A DHT node that just joined can read nothing for a few seconds: an empty first answer is
    confirmed twice before this peer believes the swarm has no peers at all."""

    def __init__(self, registry: SwarmRegistry, num_stages: int):
        self.registry, self.num_stages, self.first = registry, num_stages, True

    async def read(self) -> dict[int, list[PeerRecord]]:
        peers = await self.registry.all_peers(self.num_stages)
        for _ in range(2 if self.first else 0):
            if any(peers.values()):
                break
            await asyncio.sleep(1.0)
            peers = await self.registry.all_peers(self.num_stages)
        self.first = False
        return peers

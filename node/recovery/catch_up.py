"""Catching up: a replica that fell far behind its stage takes the stage's state again.

Reads beside docs/gossip.md ("Catching up"). Two honest replicas that did not meet for many inner
steps can fail each other's plausibility check: in a small model's first minutes, weights grow
several-fold in a few hundred steps, so one that got most of the work (the two started from the
seed together and routing favoured one) is 3x the other's norm with a cosine of 0.1. Averaging
them cannot help, and banning each other splits the stage for good. The gossip round that finds it
(RoundContext.reject, with plausibility.lagging_behind) sets `Gossip.behind` on the replica that is
behind; this task then downloads the stage's state the way a joiner does (state_transfer) and
continues from it. Nobody is banned for it.

Donors are the stage's online peers ahead of us. The partner that showed the gap is one only when
no other peer is ahead: it may be the odd one out after all. At most one catch-up per `cooldown`
seconds: the partner's word on its step count is not checked, and in a stage of two a stranger
could otherwise make us take its state again and again; once per cooldown it gets what it gets
from any joiner whose donor it is. A download that failed does not count: the next round that
finds us behind tries again.
"""

from __future__ import annotations

import logging
import random
import time

from dht.records import short_peer_id
from node.p2p.transport import TransportError
from node.recovery.state_transfer import StageParts, take_stage_state

logger = logging.getLogger(__name__)

__all__ = ["CATCH_UP_COOLDOWN", "run_catch_up"]

CATCH_UP_COOLDOWN = 300.0  # seconds between two catch-ups of one replica


async def run_catch_up(service: StageParts, cooldown: float = CATCH_UP_COOLDOWN) -> None:
    """Whenever the gossip finds this replica behind its stage, take the stage's state again (at
    most once per `cooldown` seconds). Runs until cancelled."""
    gossip = service.gossip
    if gossip is None:
        return
    me, worker = service.me, service.worker
    rng = random.Random()
    last: float | None = None
    while True:
        await gossip.behind.wait()
        gossip.behind.clear()
        now = time.monotonic()
        if last is not None and now - last < cooldown:
            logger.info(
                f"behind stage {me.stage} again {now - last:.0f} s after catching up: not before {cooldown:.0f} s"
            )
            continue
        own = worker.inner_step
        ahead = [p for p in service.view.online(me.stage, exclude=me.peer_id) if p.inner_step > own]
        others = [p for p in ahead if p.peer_id != gossip.behind_partner]
        donors = others or ahead
        if not donors:
            continue
        try:
            state = await take_stage_state(service, donors, rng)
        except TransportError as e:
            logger.warning(f"catching up with stage {me.stage} failed: {e}")
            continue
        finally:
            gossip.behind.clear()  # rounds rejected while the state was on its way showed the old gap
        last = now
        logger.info(
            f"caught up with stage {me.stage}: inner step {own} -> {state.inner_step}, outer round "
            f"{state.outer_round} (from one of {', '.join(short_peer_id(p.peer_id) for p in donors)})"
        )

"""Sending one hop of pipeline traffic, and the counters of a peer's pipeline.

`HopSender` sends to a given peer (the origin, the previous hop) or to a routed choice among a
stage's peers, with SWARM's rules: a peer whose send errors is banned until its record expires, one
that times out is only skipped (node/pipeline/traffic.py's module docstring says why); both within
bounded retries. It also tells an origin that its microbatch is lost.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from dht.records import short_peer_id
from node.p2p.transport import Transport, TransportError, timed_out
from node.pipeline.routing import Router
from node.pipeline.verifier import Verifier
from protocol import MessageKind

logger = logging.getLogger(__name__)


@dataclass
class PipelineStats:
    losses: deque = field(default_factory=lambda: deque(maxlen=32))
    completed: int = 0
    retried: int = 0
    dropped: int = 0
    forwarded: int = 0
    backwarded: int = 0
    busy_replies: int = 0
    timeouts: int = 0  # routed hops that timed out (retried elsewhere, never banned)
    rerouted: int = 0  # routed hops sent to another peer after a timeout, error or BUSY reply
    completions: deque = field(default_factory=lambda: deque(maxlen=64))  # monotonic times of completions

    @property
    def recent_loss(self) -> float | None:
        return sum(self.losses) / len(self.losses) if self.losses else None

    def rate(self, now: float) -> float:
        """Completed microbatches per second over the recent window."""
        recent = [t for t in self.completions if now - t < 30.0]
        if len(recent) < 2:
            return 0.0
        return (len(recent) - 1) / max(recent[-1] - recent[0], 1e-6)


class HopSender:
    """Sends one hop of pipeline traffic: to a given peer, or to a routed choice among a stage's peers
    with bans and bounded retries (SWARM: a peer that errors is banned until its record expires, a
    peer that times out is only skipped)."""

    def __init__(
        self,
        transport: Transport,
        router: Router,
        stats: PipelineStats,
        hop_timeout: float,
        max_retries: int,
        ban_until: Callable[[str], float],
        unreachable: Callable[[], set[str]] = set,
        verifier: Verifier | None = None,
    ):
        self.transport, self.router, self.stats = transport, router, stats
        self.verifier = verifier  # spot-checks some of the forward hops routed here (node/pipeline/verifier.py)
        self.hop_timeout, self.max_retries, self.ban_until = hop_timeout, max_retries, ban_until
        # peers we can reach only through a relay, which cannot carry a hop (node/p2p/reachability.py)
        self.unreachable = unreachable

    async def send_to(self, peer_id: str, service: str, kind: MessageKind, meta: dict, tensors: dict) -> bool:
        """Send to one specific peer (the origin or the previous hop): no alternative exists."""
        message = self.transport.message(kind, meta, tensors)
        try:
            reply = await self.transport.request(peer_id, service, message, self.hop_timeout)
        except TransportError as e:
            logger.info(f"{service} of microbatch {meta['microbatch_id']} lost: {e}")
            return False
        return reply.kind == MessageKind.ACK

    async def notify_abort(self, origin: str, service: str, microbatch_id: int, token: str, reason: str) -> None:
        """Tell a microbatch's origin it is lost here (best effort: a failure is only logged)."""
        notice = self.transport.message(
            MessageKind.ERROR, {"reason": reason[:200], "microbatch_id": microbatch_id, "token": token}
        )
        try:
            await self.transport.request(origin, service, notice, self.hop_timeout)
        except TransportError as e:
            logger.debug(f"could not tell {short_peer_id(origin)} about microbatch {microbatch_id}: {e}")

    async def send_routed(self, stage: int, service: str, kind: MessageKind, meta: dict, tensors: dict) -> str | None:
        """Send to a routed choice among `stage`'s peers; on an error ban it and try another, on a
        timeout just try another. Returns the peer that took it, None if none did."""
        message = self.transport.message(kind, meta, tensors)
        tried: set[str] = set()
        stage_router = self.router.for_stage(stage)
        avoid = {peer_id for peer_id in self.unreachable() if peer_id in stage_router}
        if len(avoid) == len(stage_router):  # only peers behind a relay serve the stage: a slim chance beats none
            avoid = set()
        for _ in range(self.max_retries + 1):
            peer_id = stage_router.choose(exclude=tried | avoid, bans=self.router.bans)
            if peer_id is None and not tried:
                # every peer of the stage is banned: after a transient error on a stage's only
                # peer, trying it again beats stalling the whole pipeline for the ban's length
                peer_id = stage_router.choose(exclude=tried, bans=None)
            if peer_id is None:
                break
            self.stats.rerouted += bool(tried)  # the second and later peers asked for this hop
            tried.add(peer_id)
            try:
                reply = await self.transport.request(peer_id, service, message, self.hop_timeout)
            except TransportError as e:
                if timed_out(e):
                    # SWARM's balancer leaves a timed-out expert unbanned and its charge in place
                    # (docs/algorithms.md, "What the authors report"): it may only be slow, and the
                    # kept charge steers the next tasks elsewhere while it catches up
                    self.stats.timeouts += 1
                    logger.info(f"{short_peer_id(peer_id)} (stage {stage}) timed out, trying another peer: {e}")
                    continue
                stage_router.release(peer_id, 1.0)
                self.router.bans.ban(peer_id, self.ban_until(peer_id), str(e))
                logger.info(f"banned {short_peer_id(peer_id)} (stage {stage}): {e}")
                continue
            if reply.kind == MessageKind.BUSY:
                stage_router.release(peer_id, 1.0)
                self.stats.busy_replies += 1
                continue
            # no observe(): the ACK comes before the compute, so its latency says nothing about the
            # peer's speed; the router follows the throughput the peer measures and announces
            if self.verifier is not None and kind == MessageKind.FORWARD:
                self.verifier.after_hop(stage, peer_id, tensors["hidden"])
            return peer_id
        logger.info(f"no peer of stage {stage} took microbatch {meta['microbatch_id']} (tried {len(tried)})")
        return None

"""Sending one hop of pipeline traffic, and the counters of a peer's pipeline.

`HopSender` sends to a given peer (the origin, the previous hop) or to a routed choice among a
stage's peers, with SWARM's rules: a peer whose send errors is banned until its record expires, one
that times out is only skipped (node/pipeline/traffic.py's module docstring says why); both within
bounded retries. It also tells an origin that its microbatch is lost.

Hops are *posted* (node/p2p/channels.py): the receiver answers only to refuse one (BUSY when its
queue is full, ERROR when it cannot take it), and a hop it takes costs one frame instead of two. So
a send returns once the hop is written, and what the old ACK decided on the spot is decided when the
hop's outcome settles: a BUSY or ERROR goes on to another peer of the stage in the background (the
receiver did not take it), a channel that closes before `refusal_window` passed loses the hop (the
receiver may have taken it, so sending it again could run it twice: the origin retries the whole
microbatch under a new id instead), and silence is a hop taken. A refusal that comes later than the
window (a receiver whose loop lagged) loses the hop, so its origin retries at once rather than at its
deadline. A receiver that hangs without closing is found by the origin's deadline rather than by a
hop's timeout. Between its attempts a hop keeps only its sealed payload, for the window's length.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from dht.records import short_peer_id
from node.p2p.swarm_peers import SwarmPeers
from node.p2p.transport import Transport, TransportError, timed_out
from node.pipeline.link_compression import LinkCompression
from node.pipeline.routing import Router
from node.pipeline.verifier import Verifier
from node.runtime.tasks import BackgroundTasks
from protocol import ANCHOR_IDS, BackwardHeader, ForwardHeader, Message, MessageKind, MicrobatchHeader, ProtocolError

logger = logging.getLogger(__name__)

# Seconds a posted hop's receiver has to refuse it before its silence counts as taken. A refusal
# leaves as soon as the request is decoded, so this is a round trip and a busy loop's lag with a
# margin; it bounds how long a sent hop's payload stays here for a reroute (at 90 microbatches/s,
# two hops each, ~11 MiB of fp16 activations for the default model).
REFUSAL_WINDOW = 1.0

OnLost = Callable[[], None]


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


@dataclass
class _RoutedHop:
    """A hop to some peer of `stage`, between its attempts: its sealed payload, not its tensors (the
    message is sealed for the link of the first peer chosen, then dropped)."""

    stage: int
    service: str
    request_id: int
    message: Message | None
    microbatch_id: int
    on_lost: OnLost
    # a training forward's input, origin and token for the verifier, until the first peer takes it
    checkable: tuple[Tensor, str, str, Tensor | None] | None = None
    tried: set[str] = field(default_factory=set)
    payload: bytes | None = None


class HopSender:
    """Sends one hop of pipeline traffic: to a given peer, or to a routed choice among a stage's peers
    with bans and bounded retries (SWARM: a peer that errors is banned until its record expires, a
    peer that times out is only skipped). Every send ends in exactly one of: taken, or `on_lost()`
    called (at once, or when a late refusal leaves no peer to try)."""

    def __init__(
        self,
        transport: Transport,
        router: Router,
        stats: PipelineStats,
        hop_timeout: float,
        max_retries: int,
        peers: SwarmPeers,
        verifier: Verifier | None = None,
        refusal_window: float = REFUSAL_WINDOW,
        compression: LinkCompression | None = None,
    ):
        self.transport, self.router, self.stats = transport, router, stats
        self.compression = compression  # each hop's encoding for its link (None: the transport's)
        self.verifier = verifier  # may check the forward hops routed here (node/pipeline/verifier.py)
        self.hop_timeout, self.max_retries = hop_timeout, max_retries
        self.refusal_window = min(refusal_window, hop_timeout)
        # how long to avoid a peer whose hop failed, and the peers only a relay reaches, which cannot
        # carry a hop (node/p2p/reachability.py)
        self.peers = peers
        self._reroutes = BackgroundTasks()  # hops refused after their send returned, going elsewhere
        self._closed = False  # outcomes settling after close (channels closing at shutdown) are ignored

    async def send_to(
        self, peer_id: str, service: str, header: MicrobatchHeader, tensors: dict, on_lost: OnLost
    ) -> str | None:
        """Send to one specific peer (the origin or the previous hop): no alternative exists, so a
        refusal, now or later, is `on_lost()`. Returns the peer if the hop was sent, else None."""
        message = self.transport.message(header.KIND, header.to_meta(), tensors)
        if self.verifier is not None and isinstance(header, BackwardHeader):  # the gradient of what peer_id sent here
            self.verifier.backward_sent(peer_id, header.origin, header.microbatch_id, tensors["grad"])
        late = self._late(None, peer_id, service, header.microbatch_id, on_lost)
        try:
            payload = self._seal(message, peer_id, service)
            outcome = await self.transport.post(
                peer_id, service, message.request_id, payload, self.hop_timeout, self.refusal_window, late
            )
        except TransportError as e:
            logger.info(f"{service} of microbatch {header.microbatch_id} lost: {e}")
            on_lost()
            return None

        def settled(done: asyncio.Future) -> None:
            refusal = _refusal(done)
            if refusal is not None and not self._closed:
                logger.info(f"{service} of microbatch {header.microbatch_id} lost: {refusal}")
                on_lost()

        outcome.add_done_callback(settled)
        return peer_id

    async def notify_abort(self, origin: str, service: str, microbatch_id: int, token: str, reason: str) -> None:
        """Tell a microbatch's origin it is lost here (best effort: a failure is only logged)."""
        notice = self.transport.message(
            MessageKind.ERROR, {"reason": reason[:200], "microbatch_id": microbatch_id, "token": token}
        )
        try:
            await self.transport.request(origin, service, notice, self.hop_timeout)
        except TransportError as e:
            logger.debug(f"could not tell {short_peer_id(origin)} about microbatch {microbatch_id}: {e}")

    async def send_routed(
        self, stage: int, service: str, header: MicrobatchHeader, tensors: dict, on_lost: OnLost
    ) -> str | None:
        """Send to a routed choice among `stage`'s peers; on an error ban it and try another, on a
        timeout just try another. Returns the peer the hop was sent to, None (and `on_lost()`) if
        none could be sent it; a later refusal tries the next peer, and `on_lost()` when none is left."""
        message = self.transport.message(header.KIND, header.to_meta(), tensors)
        checkable = None
        if self.verifier is not None and isinstance(header, ForwardHeader) and header.trains:
            checkable = (tensors["hidden"], header.origin, header.token, tensors.get(ANCHOR_IDS))
        hop = _RoutedHop(stage, service, message.request_id, message, header.microbatch_id, on_lost, checkable)
        peer_id = await self._send_routed(hop)
        if peer_id is None:
            on_lost()
        return peer_id

    async def _send_routed(self, hop: _RoutedHop) -> str | None:
        stage_router = self.router.for_stage(hop.stage)
        avoid = {peer_id for peer_id in self.peers.unreachable() if peer_id in stage_router}
        if len(avoid) == len(stage_router):  # only peers behind a relay serve the stage: a slim chance beats none
            avoid = set()
        while len(hop.tried) <= self.max_retries:
            peer_id = stage_router.choose(exclude=hop.tried | avoid, bans=self.router.bans)
            if peer_id is None and not hop.tried:
                # every peer of the stage is banned: after a transient error on a stage's only
                # peer, trying it again beats stalling the whole pipeline for the ban's length
                peer_id = stage_router.choose(exclude=hop.tried, bans=None)
            if peer_id is None:
                break
            self.stats.rerouted += bool(hop.tried)  # the second and later peers asked for this hop
            hop.tried.add(peer_id)
            if hop.message is not None:  # the first peer: seal for its link
                try:
                    hop.payload, hop.message = self._seal(hop.message, peer_id, hop.service), None
                except ProtocolError:  # nothing was sent: un-charge the peer, the caller hears why
                    stage_router.release(peer_id, 1.0)
                    raise
            late = self._late(hop.stage, peer_id, hop.service, hop.microbatch_id, hop.on_lost)
            try:
                outcome = await self.transport.post(
                    peer_id, hop.service, hop.request_id, hop.payload, self.hop_timeout, self.refusal_window, late
                )
            except TransportError as e:
                if timed_out(e):
                    # SWARM's balancer leaves a timed-out expert unbanned and its charge in place
                    # (docs/algorithms.md, "What the authors report"): it may only be slow, and the
                    # kept charge steers the next tasks elsewhere while it catches up
                    self.stats.timeouts += 1
                    logger.info(f"{short_peer_id(peer_id)} (stage {hop.stage}) timed out, trying another peer: {e}")
                    continue
                self._ban(hop.stage, peer_id, str(e))
                continue
            if outcome.done() and self._refused(hop.stage, peer_id, outcome):  # a peer that answers every request
                continue
            outcome.add_done_callback(lambda done, peer_id=peer_id: self._settled(hop, peer_id, done))
            # no observe(): a send's latency says nothing about the peer's speed; the router
            # follows the throughput the peer measures and announces
            if hop.checkable is not None and self.verifier is not None:
                hidden, origin, token, token_ids = hop.checkable
                self.verifier.forward_sent(hop.stage, peer_id, origin, hop.microbatch_id, token, hidden, token_ids)
                hop.checkable = None
            return peer_id
        logger.info(f"no peer of stage {hop.stage} took microbatch {hop.microbatch_id} (tried {len(hop.tried)})")
        return None

    def _seal(self, message: Message, peer_id: str, service: str) -> bytes:
        compression = self.compression.for_hop(peer_id, service, message.tensors) if self.compression else None
        return self.transport.seal_posted(message, compression)

    def _refused(self, stage: int, peer_id: str, outcome: asyncio.Future) -> bool:
        """Whether a settled outcome is a refusal the hop can go elsewhere after (BUSY; ERROR, which
        also bans); a channel that closed first loses the hop instead (the peer may have taken it)."""
        if outcome.cancelled() or outcome.exception() is not None:
            # no ban: the peer went away or moved stage, which its record says soon, and a new
            # channel to it fails (and bans) at once if it is gone
            return False
        reply = outcome.result()
        if reply is None or reply.kind == MessageKind.ACK:
            return False
        self._charge_refusal(stage, peer_id, reply)
        return True

    def _charge_refusal(self, stage: int, peer_id: str, reply: Message) -> None:
        """A peer of a routed stage refused a hop: un-charge it, and ban it if it said ERROR."""
        if reply.kind == MessageKind.BUSY:
            self.router.for_stage(stage).release(peer_id, 1.0)
            self.stats.busy_replies += 1
        else:
            self._ban(stage, peer_id, f"refused: {reply.meta.get('reason')}")

    def _settled(self, hop: _RoutedHop, peer_id: str, outcome: asyncio.Future) -> None:
        if not outcome.cancelled():
            outcome.exception()  # retrieved even when nothing follows from it (at shutdown)
        if self._closed:
            return
        if self._refused(hop.stage, peer_id, outcome):
            self._reroutes.spawn(self._reroute(hop), name=f"reroute to stage {hop.stage}")
            return
        refusal = _refusal(outcome)
        if refusal is not None:  # the channel closed before the refusal window passed
            logger.info(f"{hop.service} to {short_peer_id(peer_id)} lost: {refusal}")
            hop.on_lost()

    def _late(
        self, stage: int | None, peer_id: str, service: str, microbatch_id: int, on_lost: OnLost
    ) -> Callable[[Message], None]:
        """What a refusal after the window does (the payload is gone by then): lose the hop. It holds
        no payload, so it may outlive the window."""

        def refused_late(reply: Message) -> None:
            if self._closed:
                return
            if stage is not None:
                self._charge_refusal(stage, peer_id, reply)
            logger.info(
                f"{service} of microbatch {microbatch_id} refused late by {short_peer_id(peer_id)}: {reply.kind}"
            )
            on_lost()

        return refused_late

    async def _reroute(self, hop: _RoutedHop) -> None:
        if await self._send_routed(hop) is None:
            hop.on_lost()

    def _ban(self, stage: int, peer_id: str, reason: str) -> None:
        self.router.for_stage(stage).release(peer_id, 1.0)
        # a failed or refused hop is no evidence against the peer's own input: avoid it, admit it
        self.router.bans.ban(peer_id, self.peers.ban_until(peer_id), reason, evidence=False)
        logger.info(f"banned {short_peer_id(peer_id)} (stage {stage}): {reason}")

    async def close(self) -> None:
        self._closed = True
        await self._reroutes.close()


def _refusal(outcome: asyncio.Future) -> str | None:
    """Why a posted hop to a given peer was not taken, or None if it was."""
    if outcome.cancelled():
        return "cancelled"
    if outcome.exception() is not None:
        return repr(outcome.exception())
    reply = outcome.result()
    if reply is None or reply.kind == MessageKind.ACK:
        return None
    return f"{reply.kind.value}: {reply.meta.get('reason')}"

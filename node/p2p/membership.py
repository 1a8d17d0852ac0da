"""Who may send this node work: a signed record of the right stage, and an answer to our ping.

A record in the DHT costs one signature, so "has a record" turns away strangers but not a peer
that signs records for identities it never runs (docs/security.md, "Who is a member"). A member
must also be *live*: it answered a PING we sent it, on this swarm's protocol, over a stream we
opened (through the dialer, a direct link or a relay, as any hop to it would go), within the last
`LivenessSettings.ttl` seconds. That costs a running, reachable host per identity that speaks the
swarm's protocol (and, in a private swarm, holds its key), for as long as it wants to stay a member.

Checks run in the background: when an `online` record shows up in the swarm view (a peer routing
and keep_connected dial anyway), and when a peer with a record but no recent answer asks us for
something (over the connection it opened, so nothing new is dialed). They are bounded: a few at
once, a failed peer is asked again only after a growing pause, and only peers with a record are
ever pinged, so a stranger cannot make us dial anyone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from dht.records import PeerRecord, PeerState, short_peer_id
from dht.swarm_view import SwarmView
from node.p2p.request_contract import RequestContract
from node.p2p.transport import Transport, TransportError
from protocol import Message, MessageKind

__all__ = [
    "LIVENESS_CONTRACT",
    "LIVENESS_PENDING",
    "LIVENESS_SERVICE",
    "NOT_A_MEMBER",
    "LivenessChecks",
    "LivenessSettings",
    "Membership",
    "serve_liveness",
    "transport_ping",
]

logger = logging.getLogger(__name__)

LIVENESS_SERVICE = "liveness"
LIVENESS_CONTRACT = RequestContract(frozenset({MessageKind.PING}))
# refusal reasons (BUSY, not ERROR: an honest peer our view has not caught up with asks again)
NOT_A_MEMBER = "not a member of this swarm"
LIVENESS_PENDING = "liveness check pending: answer our ping and ask again"
MEMBER_STATES = (PeerState.JOINING, PeerState.ONLINE)  # joining: its record may lag its first hops


@dataclass(frozen=True)
class LivenessSettings:
    ttl: float = 600.0
    """Seconds an answered ping counts; then the peer is pinged again (in the background)."""
    timeout: float = 5.0
    """Seconds one ping may take, dial included."""
    first_retry: float = 2.0
    """Pause after a failed ping; it doubles with each failure in a row, up to `max_retry`."""
    max_retry: float = 60.0
    urgent_gap: float = 0.5
    """Least pause between pings of a peer that is asking us for something (a joiner's first
    requests may come a moment after a ping that found it still starting up)."""
    concurrent: int = 4
    """Pings in flight at once."""
    max_peers: int = 4096
    """Peers remembered (answered or failed); the oldest entry goes first beyond it."""


@dataclass
class _Standing:
    answered_at: float | None = None
    last_try: float = float("-inf")
    failures: int = 0


class LivenessChecks:
    """Pings peers and remembers who answered. `ping` (`transport_ping` in a node; tests pass
    their own) returns False or raises when a peer did not answer."""

    def __init__(
        self,
        ping: Callable[[str], Awaitable[bool]],
        settings: LivenessSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.settings = settings or LivenessSettings()
        self._ping = ping
        self._clock = clock
        self._standing: dict[str, _Standing] = {}
        self._running: dict[str, asyncio.Task[bool]] = {}
        self._slots = asyncio.Semaphore(self.settings.concurrent)
        self.sent = self.answered = 0  # pings sent / answered (status and tests)

    def passed(self, peer_id: str) -> bool:
        standing = self._standing.get(peer_id)
        return (
            standing is not None
            and standing.answered_at is not None
            and self._clock() - standing.answered_at < self.settings.ttl
        )

    def request(self, peer_id: str, urgent: bool = False) -> asyncio.Task[bool] | None:
        """Start a ping of `peer_id` unless it passed, one is running, or its pause is not over
        (`urgent`: the peer is asking us for something now, so only `urgent_gap` applies).
        Returns the running check, if any."""
        if peer_id in self._running:
            return self._running[peer_id]
        if self.passed(peer_id):
            return None
        standing = self._standing.get(peer_id) or _Standing()
        pause = self.settings.urgent_gap if urgent else self._pause(standing.failures)
        if self._clock() - standing.last_try < pause:
            return None
        standing.last_try = self._clock()
        self._remember(peer_id, standing)
        task = asyncio.get_running_loop().create_task(self._check(peer_id), name=f"liveness-{peer_id[-6:]}")
        self._running[peer_id] = task
        task.add_done_callback(lambda _: self._running.pop(peer_id, None))
        return task

    async def wait_for(self, peer_id: str, timeout: float) -> bool:
        """Ping `peer_id` now unless it passed, and wait up to `timeout` s for the answer."""
        task = self.request(peer_id, urgent=True)
        if task is not None:
            await asyncio.wait([task], timeout=timeout)
        return self.passed(peer_id)

    def forget_except(self, present: Iterable[str]) -> None:
        """Drop what we know of peers whose records left the view (bounded memory)."""
        keep = set(present)
        for peer_id in [p for p in self._standing if p not in keep and p not in self._running]:
            del self._standing[peer_id]

    def close(self) -> None:
        for task in list(self._running.values()):
            task.cancel()

    def _pause(self, failures: int) -> float:
        if failures == 0:
            return 0.0
        return min(self.settings.max_retry, self.settings.first_retry * 2 ** (failures - 1))

    def _remember(self, peer_id: str, standing: _Standing) -> None:
        self._standing.pop(peer_id, None)
        self._standing[peer_id] = standing  # newest last: the oldest goes first when full
        while len(self._standing) > self.settings.max_peers:
            del self._standing[next(iter(self._standing))]

    async def _check(self, peer_id: str) -> bool:
        async with self._slots:
            self.sent += 1
            try:
                answered = await asyncio.wait_for(self._ping(peer_id), self.settings.timeout)
            except (TimeoutError, TransportError, OSError, ConnectionError) as e:
                logger.debug(f"liveness: {short_peer_id(peer_id)} did not answer: {e!r:.200}")
                answered = False
        standing = self._standing.get(peer_id)
        if standing is None:  # forgotten meanwhile: its record left the view
            return False
        if answered:
            self.answered += 1
            standing.answered_at, standing.failures = self._clock(), 0
        else:
            standing.failures += 1
        return answered


def transport_ping(transport: Transport, timeout: float) -> Callable[[str], Awaitable[bool]]:
    """A PING over `transport`, answered by `serve_liveness` at the other end."""

    async def ping(peer_id: str) -> bool:
        reply = await transport.request(peer_id, LIVENESS_SERVICE, transport.message(MessageKind.PING), timeout)
        return reply.kind == MessageKind.PONG

    return ping


async def serve_liveness(transport: Transport) -> None:
    """Answer every PING with a PONG: what makes this peer a member in the eyes of others. Anyone
    may ask (a stranger's ping costs a token of its request rate and a few bytes back to it)."""

    def answer(sender: str, msg: Message) -> Message:
        return transport.message(MessageKind.PONG, request_id=msg.request_id)

    await transport.serve_requests(LIVENESS_SERVICE, answer, LIVENESS_CONTRACT, read_timeout=10.0)


class Membership:
    """The one rule every handler gates by: the peer's record in our view is `joining` or
    `online` (at `stage` when the request says which stage it must come from), and the peer
    answered our ping lately. The rule reads the view; the pings are `liveness`'s."""

    def __init__(self, view: SwarmView, liveness: LivenessChecks, me: str):
        self.view, self.liveness, self.me = view, liveness, me

    def refusal(self, peer_id: str, stage: int | None = None) -> str | None:
        """Why `peer_id` may not send us work now (None: it may). A peer with a right record but
        no recent answer is pinged in the background, so its next request may pass."""
        record = self.view.record_of(peer_id)
        problem = self._record_problem(record, stage)
        if problem is not None or peer_id == self.me:
            return problem
        if self.liveness.passed(peer_id):
            return None
        self.liveness.request(peer_id, urgent=True)
        return LIVENESS_PENDING

    def is_member(self, peer_id: str) -> bool:
        """Whether `peer_id` passes the rule at any stage now, without pinging anyone (stream
        admission asks this for every stream: node/p2p/peer_conduct.py's strangers' share)."""
        record = self.view.record_of(peer_id)
        return self._record_problem(record, None) is None and (peer_id == self.me or self.liveness.passed(peer_id))

    async def admit(self, peer_id: str, stage: int | None = None, wait: float = 3.0) -> str | None:
        """`refusal`, but a handler that may wait (a session, a spot-check) waits up to `wait`
        seconds for the ping's answer instead of refusing the peer's first request."""
        problem = self._record_problem(self.view.record_of(peer_id), stage)
        if problem is not None or peer_id == self.me:
            return problem
        return None if await self.liveness.wait_for(peer_id, wait) else LIVENESS_PENDING

    def on_refresh(self, peers_by_stage: dict[int, list[PeerRecord]]) -> None:
        """A new picture of the swarm: ping `online` peers we have not heard from, forget departed
        ones. Only `online` records: routing and keep_connected dial those anyway, while a
        `joining` record's addresses are never dialed for it (records are free to sign: pinging
        every one would let a stranger point the whole swarm's dials at someone else's host). A
        joiner is pinged when it asks us for something, over the connection it opened."""
        present = [r for records in peers_by_stage.values() for r in records]
        for record in present:
            if record.state == PeerState.ONLINE and record.peer_id != self.me:
                self.liveness.request(record.peer_id)
        self.liveness.forget_except(r.peer_id for r in present)

    @staticmethod
    def _record_problem(record: PeerRecord | None, stage: int | None) -> str | None:
        if record is None or record.state not in MEMBER_STATES:
            return f"{NOT_A_MEMBER}: no record of you here" if record is None else f"{NOT_A_MEMBER}: {record.state}"
        if stage is not None and record.stage != stage:
            return f"{NOT_A_MEMBER} at stage {stage}: your record is at stage {record.stage}"
        return None

"""This peer's record: its one owner, and the heartbeat that keeps it alive in the DHT.

Every change to what a peer announces (its stage, its state, the progress it measured) goes through
`PeerAnnouncer`; the rest of the node reads `peer_id`, `stage` and `state` from it and never holds
a mutable record of its own.

A peer that dies stops re-announcing and its record expires within the TTL; a peer that leaves
cleanly overwrites its record with state `leaving`. The DHT never accepts an entry that expires
earlier than the one it holds, so the farewell keeps the last expiration (plus a hair) and readers
simply treat `leaving` peers as gone.

The registry signs every announcement, expiration included, with this peer's identity key
(dht/signing.py): only this peer can write, overwrite or expire its record, and no announcement may
expire more than the swarm's TTL (+ clock slack) ahead, which `announce_now` never asks for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass

from hivemind.utils import get_dht_time

from dht.records import (
    CIRCUIT,
    MAX_ADDRS,
    MAX_RELAYS,
    PeerRecord,
    PeerState,
    Reachability,
    VerificationReport,
    reachability_of,
)
from dht.registry import SwarmRegistry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerProgress:
    """What a serving peer measured since its last announcement (the record's progress fields)."""

    inner_step: int
    microbatches: int
    throughput: float
    grad_norm: float | None
    loss: float | None
    val_loss: float | None
    val_step: int | None
    outer_round: int
    last_partner: str | None
    divergence: float | None
    fingerprint: list[float] | None
    verification: VerificationReport | None = None


class PeerAnnouncer:
    """Owns this peer's `PeerRecord` and re-announces it every `period` with expiration now + `ttl`."""

    def __init__(self, registry: SwarmRegistry, record: PeerRecord, period: float, ttl: float):
        self.registry = registry
        self.period = period
        self.ttl = ttl
        self.last_expiration = 0.0
        self._record = dataclasses.replace(record)
        self._wakeup = asyncio.Event()

    # -- reading ---------------------------------------------------------------------------------
    @property
    def peer_id(self) -> str:
        return self._record.peer_id

    @property
    def stage(self) -> int:
        return self._record.stage

    @property
    def state(self) -> PeerState:
        return self._record.state

    @property
    def outer_round(self) -> int:
        return self._record.outer_round

    @property
    def reachability(self) -> Reachability:
        return self._record.reachability

    def record(self) -> PeerRecord:
        """A copy of the record as it would be announced now."""
        return dataclasses.replace(self._record)

    # -- changing --------------------------------------------------------------------------------
    def set_state(self, state: PeerState) -> None:
        """Change the announced state and announce it soon."""
        if state != self._record.state:
            self._record.state = state
            self.poke()

    def report(self, progress: PeerProgress) -> None:
        """Copy measured progress into the record (announced at the next beat)."""
        for field in dataclasses.fields(progress):
            setattr(self._record, field.name, getattr(progress, field.name))

    def set_addresses(self, addrs: list[str]) -> None:
        """Where this peer can be dialed now (relay addresses come and go); announced at the next beat."""
        addrs = sorted(set(addrs), key=lambda addr: (CIRCUIT in addr, addr))[:MAX_ADDRS]  # direct ones first
        if addrs != self._record.addrs:
            self._record.addrs = addrs
            self._record.reachability = reachability_of(addrs)
            self.poke()

    def set_relays(self, relays: list[str]) -> None:
        """The relays this peer (behind a NAT) is registered with now: others reach it through them."""
        relays = sorted(relays)[:MAX_RELAYS]
        if relays != self._record.relays:
            self._record.relays = relays
            self.poke()

    def set_relay_budget(self, left: int) -> None:
        """What this peer, a relay, still carries (announced at the next beat)."""
        self._record.relay_budget = max(int(left), 0)

    def set_paths(self, paths: dict[str, str]) -> None:
        """How the last direct link to each peer behind a NAT went (announced at the next beat)."""
        self._record.paths = dict(paths)

    def restore_counters(self, inner_step: int, outer_round: int) -> None:
        """Counters taken over with a downloaded stage state (this peer continues that replica's count)."""
        self._record.inner_step, self._record.outer_round = inner_step, outer_round

    async def claim(self, stage: int) -> None:
        """Announce this peer as `joining` `stage` now; a claim on another stage is withdrawn first."""
        withdrawn = dataclasses.replace(self._record, state=PeerState.LEAVING)
        self._record.stage = stage
        self._record.state = PeerState.JOINING
        if stage != withdrawn.stage and self.last_expiration > 0:
            await self._announce_leaving(withdrawn)
        await self.announce_now()

    async def move_to(self, stage: int) -> None:
        """Leave the current stage (record overwritten as `leaving`) and join `stage` as `joining`.
        Progress fields describe the old stage, so they are cleared until the new stage reports."""
        old = self._record.stage
        withdrawn = dataclasses.replace(self._record, state=PeerState.LEAVING)
        # the record moves before the withdrawal is awaited: a heartbeat in between must not
        # re-announce the old stage as online over the `leaving` entry
        record = self._record
        record.stage, record.state = stage, PeerState.JOINING
        await self._announce_leaving(withdrawn)
        record.inner_step = record.microbatches = 0
        record.loss = record.grad_norm = record.divergence = record.last_partner = None
        record.val_loss = record.val_step = None
        await self.announce_now()
        logger.info(f"moved from stage {old} to stage {stage}")

    # -- announcing ------------------------------------------------------------------------------
    async def announce_now(self) -> None:
        self._record.updated = get_dht_time()
        expiration = max(self._record.updated + self.ttl, self.last_expiration + 1e-3)
        try:
            stored = await self.registry.announce(self.record(), expiration)
        except Exception as e:  # the DHT is best effort: a failed beat is retried next period
            logger.warning(f"heartbeat failed: {e!r}")
            return
        if stored:
            self.last_expiration = expiration
        else:
            logger.debug("heartbeat not stored by any DHT peer; retrying next period")

    def poke(self) -> None:
        """Announce soon instead of waiting for the period (state changed)."""
        self._wakeup.set()

    async def run(self) -> None:
        while True:
            await self.announce_now()
            self._wakeup.clear()
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow this task's cancellation
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.period):
                    await self._wakeup.wait()

    async def farewell(self) -> None:
        """Overwrite this peer's record with state `leaving` (clean shutdown)."""
        self._record.state = PeerState.LEAVING
        await self._announce_leaving(dataclasses.replace(self._record))

    async def _announce_leaving(self, leaving: PeerRecord) -> None:
        expiration = max(self.last_expiration + 1e-3, get_dht_time() + 1.0)
        try:
            async with asyncio.timeout(5.0):
                await self.registry.announce(leaving, expiration)
        except Exception as e:
            logger.warning(f"could not announce leaving: {e!r}")

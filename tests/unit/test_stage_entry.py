"""node/recovery/stage_entry.py: how a peer entering a stage gets its weights under churn.

The network steps (join_live_stage, rebuild_into_service) are replaced by scripted ones that read
the same swarm picture the real ones would; the picture changes between attempts as it does in a
churning swarm (tests/swarm/test_chaos.py runs the real thing).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from dht.records import PeerRecord, PeerState
from node.p2p.transport import TransportError
from node.recovery import stage_entry
from node.recovery.rebuild import RebuildFailed, RebuildImpossible
from node.recovery.stage_entry import EntryGaveUp, EntryPatience, StageEntry, enter_stage

FAST = EntryPatience(first=0.001, growth=2.0, longest=0.004)


@dataclass
class FakeMe:
    peer_id: str = "me"
    stage: int = 2
    states: list[PeerState] = field(default_factory=list)

    def set_state(self, state: PeerState) -> None:
        self.states.append(state)


@dataclass
class FakeView:
    """Each refresh shows the next picture of the script (the last one stays)."""

    pictures: list[dict[int, list[PeerRecord]]]
    refreshes: int = 0

    @property
    def peers_by_stage(self) -> dict[int, list[PeerRecord]]:
        return self.pictures[min(self.refreshes, len(self.pictures) - 1)]

    def online(self, stage: int, exclude: str | None = None) -> list[PeerRecord]:
        return [p for p in self.peers_by_stage.get(stage, []) if p.state == PeerState.ONLINE and p.peer_id != exclude]

    async def refresh(self) -> None:
        self.refreshes += 1


@dataclass
class FakeService:
    view: FakeView
    me: FakeMe = field(default_factory=FakeMe)


def trained(stage: int, pid: str) -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, state=PeerState.ONLINE, inner_step=50)


def fresh(stage: int, pid: str) -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, state=PeerState.ONLINE, inner_step=0)


LOST_TWO = {0: [trained(0, "a")], 1: [trained(1, "b")], 2: [], 3: [trained(3, "d")]}
SERVED_TWO = {**LOST_TWO, 2: [trained(2, "c")]}


def script(monkeypatch, join: Callable[[FakeService], bool], rebuild: Callable[[FakeService], None]) -> list[str]:
    calls: list[str] = []

    async def fake_join(service, progress=None):
        calls.append("join")
        return join(service)

    async def fake_rebuild(service, registry):
        calls.append("rebuild")
        service.me.set_state(PeerState.REBUILDING)
        rebuild(service)

    monkeypatch.setattr(stage_entry, "join_live_stage", fake_join)
    monkeypatch.setattr(stage_entry, "rebuild_into_service", fake_rebuild)
    return calls


def enter(service: FakeService) -> StageEntry:
    return asyncio.run(asyncio.wait_for(enter_stage(service, registry=None, patience=FAST), timeout=10))


def test_a_rebuild_that_lacks_its_sources_waits_and_joins_the_stage_once_it_is_served(monkeypatch):
    # the neighbours are gone for two looks; by the third another peer has rebuilt the stage
    service = FakeService(FakeView([LOST_TWO, LOST_TWO, SERVED_TWO]))

    def rebuild(service):
        raise RebuildFailed("stage 2 is rebuilt from stage 1's stage: no online donor")

    calls = script(monkeypatch, join=lambda s: True, rebuild=rebuild)
    assert enter(service) == StageEntry.LIVE
    assert calls == ["rebuild", "rebuild", "join"]
    # between attempts the peer is `joining`, not `rebuilding`: the rebalancer may send help meanwhile
    assert service.me.states == [PeerState.REBUILDING, PeerState.JOINING] * 2


def test_a_rebuild_is_retried_until_it_works(monkeypatch):
    service = FakeService(FakeView([LOST_TWO]))
    failures = iter([True, True, True, False])

    def rebuild(service):
        if next(failures):
            raise RebuildFailed("download failed")

    calls = script(monkeypatch, join=lambda s: True, rebuild=rebuild)
    assert enter(service) == StageEntry.REBUILT
    assert calls == ["rebuild"] * 4
    assert service.view.refreshes == 3  # each retry reads a fresh picture


def test_a_stage_that_can_never_be_rebuilt_is_refused_at_once(monkeypatch):
    service = FakeService(FakeView([LOST_TWO]))

    def rebuild(service):
        raise RebuildImpossible("stage 1 is the only block stage")

    calls = script(monkeypatch, join=lambda s: True, rebuild=rebuild)
    with pytest.raises(RebuildImpossible):
        enter(service)
    assert calls == ["rebuild"]


def test_failed_live_downloads_are_retried_and_vanished_donors_lead_to_a_rebuild(monkeypatch):
    service = FakeService(FakeView([SERVED_TWO, SERVED_TWO, LOST_TWO]))
    outcomes = iter(["error", "vanished"])

    def join(service):
        if next(outcomes) == "error":
            raise TransportError("every donor failed")
        service.view.refreshes += 1  # as the real one: it looks again between rounds,
        return False  # and says False once the picture holds no donor

    calls = script(monkeypatch, join=join, rebuild=lambda s: None)
    assert enter(service) == StageEntry.REBUILT
    assert calls == ["join", "join", "rebuild"]


def test_an_untrained_swarm_starts_from_the_seed_without_rebuilding(monkeypatch):
    service = FakeService(FakeView([{0: [fresh(0, "a")], 1: [fresh(1, "b")], 2: [], 3: [fresh(3, "d")]}]))
    calls = script(monkeypatch, join=lambda s: True, rebuild=lambda s: None)
    assert enter(service) == StageEntry.SEED
    assert calls == []


def test_a_peer_that_never_gets_the_weights_gives_up_after_its_patience(monkeypatch):
    # e.g. a peer whose network reaches no donor: waiting forever in `joining` would hold the stage,
    # since the rebalancer leaves a stage with a joiner on its way to that joiner
    service = FakeService(FakeView([SERVED_TWO]))

    def join(service):
        raise TransportError("every donor failed")

    calls = script(monkeypatch, join=join, rebuild=lambda s: None)
    patience = EntryPatience(first=0.01, growth=1.0, longest=0.01, give_up=0.1)
    with pytest.raises(EntryGaveUp, match="every donor failed"):
        asyncio.run(asyncio.wait_for(enter_stage(service, registry=None, patience=patience), timeout=10))
    assert 5 <= len(calls) <= 10 and set(calls) == {"join"}
    assert service.me.states[-1] == PeerState.JOINING


def test_pauses_grow_to_a_ceiling():
    pauses = EntryPatience(first=2.0, growth=1.5, longest=5.0).pauses()
    assert [next(pauses) for _ in range(5)] == [2.0, 3.0, 4.5, 5.0, 5.0]

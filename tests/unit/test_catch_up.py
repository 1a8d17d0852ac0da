"""node/recovery/catch_up.py: which donors a replica that fell behind takes the stage's state from,
that a failed download does not use up the cooldown, and that a second catch-up waits for it.
The download itself (take_stage_state, the joiner's path) is replaced here; tests/swarm/test_gossip.py
runs the whole thing between real peers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from node.p2p.transport import TransportError
from node.recovery import catch_up


@dataclass
class FakeView:
    steps: dict[str, int]

    def online(self, stage: int, exclude: str = "") -> list[SimpleNamespace]:
        return [SimpleNamespace(peer_id=p, inner_step=s) for p, s in self.steps.items() if p != exclude]


@dataclass
class FakeService:
    view: FakeView
    me: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(stage=1, peer_id="me"))
    worker: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(inner_step=100))
    gossip: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(behind=asyncio.Event(), behind_partner=None)
    )


async def signal_and_settle(service: FakeService, partner: str) -> None:
    service.gossip.behind_partner = partner
    service.gossip.behind.set()
    for _ in range(50):  # the task clears the signal once it has acted on it
        await asyncio.sleep(0.01)
        if not service.gossip.behind.is_set():
            break
    await asyncio.sleep(0.02)


def test_donors_cooldown_and_a_failed_download(monkeypatch, caplog):
    calls: list[list[str]] = []
    failures = [TransportError("donor vanished")]

    async def fake_take(service, donors, rng, attempts=3, progress=None):
        calls.append(sorted(p.peer_id for p in donors))
        if failures:
            raise failures.pop()
        return SimpleNamespace(inner_step=1000, outer_round=7)

    monkeypatch.setattr(catch_up, "take_stage_state", fake_take)

    async def scenario(cooldown: float) -> None:
        service = FakeService(FakeView({"me": 100, "a": 1000, "b": 900, "c": 10}))
        task = asyncio.create_task(catch_up.run_catch_up(service, cooldown=cooldown))
        try:
            # the partner that showed the gap is left out while another peer is ahead; c is behind us
            await signal_and_settle(service, "a")
            assert calls == [["b"]]
            # the download failed: no cooldown, the next signal tries again
            await signal_and_settle(service, "a")
            assert calls == [["b"], ["b"]]
            # it succeeded: within the cooldown a new signal is logged and left
            await signal_and_settle(service, "a")
            assert len(calls) == (2 if cooldown else 3)
            # only the partner is ahead: it is the donor
            service.view.steps = {"me": 100, "a": 1000}
            await signal_and_settle(service, "a")
            assert calls[-1] == (["b"] if cooldown else ["a"])
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    with caplog.at_level("INFO", logger="node.recovery.catch_up"):
        asyncio.run(asyncio.wait_for(scenario(cooldown=300.0), 10))
    assert "catching up with stage 1 failed: donor vanished" in caplog.text
    assert "caught up with stage 1: inner step 100 -> 1000, outer round 7" in caplog.text
    assert "behind stage 1 again" in caplog.text
    calls.clear()
    failures.append(TransportError("donor vanished"))
    asyncio.run(asyncio.wait_for(scenario(cooldown=0.0), 10))

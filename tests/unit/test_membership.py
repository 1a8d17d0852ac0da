"""Membership (node/p2p/membership.py): a record of the right stage and an answer to our ping.

The pings are a fake here (a set of peers that answer, a clock the test moves); the swarm tests
run the real PING over the transport (tests/swarm/test_hostile_peer.py, whose member identities
answer it, and every swarm test, whose peers must pass each other's checks to train).
"""

from __future__ import annotations

import asyncio

from dht.records import PeerRecord, PeerState
from node.p2p.membership import LIVENESS_PENDING, NOT_A_MEMBER, LivenessChecks, LivenessSettings, Membership
from tests.helpers.clock import FakeClock

ME, ORIGIN, BLOCK, SILENT = "me-peer", "origin-peer", "block-peer", "silent-peer"


class FakeView:
    def __init__(self, *records: PeerRecord):
        self.peers_by_stage: dict[int, list[PeerRecord]] = {}
        for record in records:
            self.peers_by_stage.setdefault(record.stage, []).append(record)

    def record_of(self, peer_id: str) -> PeerRecord | None:
        return next((r for rs in self.peers_by_stage.values() for r in rs if r.peer_id == peer_id), None)


class Pings:
    """Peers in `answering` answer at once; others fail. Counts every ping sent, per peer."""

    def __init__(self, *answering: str):
        self.answering = set(answering)
        self.sent: list[str] = []
        self.in_flight = self.most_in_flight = 0
        self.hold = 0.0

    async def __call__(self, peer_id: str) -> bool:
        self.sent.append(peer_id)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.hold)
            return peer_id in self.answering
        finally:
            self.in_flight -= 1


def checks(pings: Pings, clock: FakeClock, **settings) -> LivenessChecks:
    return LivenessChecks(pings, LivenessSettings(**settings), clock=clock)


def run(coroutine):
    return asyncio.run(coroutine)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_peer_passes_once_it_answered_and_again_after_the_ttl_only_when_pinged_anew():
    async def body():
        clock, pings = FakeClock(), Pings(ORIGIN)
        liveness = checks(pings, clock, ttl=600.0)
        assert not liveness.passed(ORIGIN)
        await liveness.request(ORIGIN)
        assert liveness.passed(ORIGIN) and pings.sent == [ORIGIN]
        assert liveness.request(ORIGIN) is None  # passed: no second ping
        clock.now += 601.0
        assert not liveness.passed(ORIGIN)
        await liveness.request(ORIGIN)
        assert liveness.passed(ORIGIN) and pings.sent == [ORIGIN, ORIGIN]

    run(body())


def test_a_silent_peer_is_pinged_after_pauses_that_double_and_an_urgent_request_waits_only_a_short_gap():
    async def body():
        clock, pings = FakeClock(), Pings()
        liveness = checks(pings, clock, first_retry=2.0, max_retry=8.0, urgent_gap=0.5)
        for expected_pause in (2.0, 4.0, 8.0, 8.0):
            await liveness.request(SILENT)
            sent = len(pings.sent)
            clock.now += expected_pause - 0.1
            assert liveness.request(SILENT) is None and len(pings.sent) == sent
            clock.now += 0.1
        await liveness.request(SILENT)  # the fifth failure
        clock.now += 2.0
        assert liveness.request(SILENT) is None  # the background pause is 8 s by now
        await liveness.request(SILENT, urgent=True)  # the peer is asking: only the short gap
        assert len(pings.sent) == 6 and not liveness.passed(SILENT)
        clock.now += 0.4
        assert liveness.request(SILENT, urgent=True) is None  # not again within the gap
        clock.now += 0.1
        await liveness.request(SILENT, urgent=True)
        assert len(pings.sent) == 7

    run(body())


def test_at_most_the_configured_pings_run_at_once_and_one_per_peer():
    async def body():
        clock, pings = FakeClock(), Pings(*(f"peer{i}" for i in range(10)))
        pings.hold = 0.01
        liveness = checks(pings, clock, concurrent=3)
        tasks = [liveness.request(f"peer{i}") for i in range(10)]
        assert liveness.request("peer0") is tasks[0]  # running: the same check
        await asyncio.gather(*tasks)
        assert pings.most_in_flight == 3 and len(pings.sent) == 10
        assert all(liveness.passed(f"peer{i}") for i in range(10))

    run(body())


def test_memory_is_bounded_and_departed_peers_are_forgotten():
    async def body():
        clock, pings = FakeClock(), Pings(*(f"peer{i}" for i in range(20)))
        liveness = checks(pings, clock, max_peers=8)
        await asyncio.gather(*(liveness.request(f"peer{i}") for i in range(20)))
        assert sum(liveness.passed(f"peer{i}") for i in range(20)) == 8
        assert all(liveness.passed(f"peer{i}") for i in range(12, 20))  # the newest stay
        liveness.forget_except(["peer19"])
        assert [p for p in (f"peer{i}" for i in range(20)) if liveness.passed(p)] == ["peer19"]

    run(body())


def test_a_ping_that_hangs_fails_at_the_timeout():
    async def body():
        clock, pings = FakeClock(), Pings(ORIGIN)
        pings.hold = 5.0
        liveness = checks(pings, clock, timeout=0.05)
        assert await liveness.request(ORIGIN) is False
        assert not liveness.passed(ORIGIN)

    run(body())


def membership(pings: Pings, *records: PeerRecord) -> tuple[Membership, LivenessChecks]:
    liveness = checks(pings, FakeClock())
    return Membership(FakeView(*records), liveness, ME), liveness  # type: ignore[arg-type]


def test_no_record_or_a_record_in_the_wrong_state_or_stage_is_refused_without_a_ping():
    async def body():
        pings = Pings(ORIGIN, BLOCK, SILENT)
        gate, _ = membership(
            pings,
            PeerRecord(ORIGIN, 0, PeerState.ONLINE),
            PeerRecord(BLOCK, 1, PeerState.LEAVING),
        )
        assert gate.refusal("stranger") == f"{NOT_A_MEMBER}: no record of you here"
        assert gate.refusal(BLOCK) == f"{NOT_A_MEMBER}: leaving"
        assert gate.refusal(ORIGIN, stage=1) == f"{NOT_A_MEMBER} at stage 1: your record is at stage 0"
        await settle()
        assert pings.sent == []  # a record is needed before we dial anyone

    run(body())


def test_a_right_record_is_refused_until_the_peer_answers_our_ping_and_then_admitted():
    async def body():
        pings = Pings(ORIGIN)
        gate, _ = membership(
            pings,
            PeerRecord(ORIGIN, 0, PeerState.JOINING),
            PeerRecord(SILENT, 0, PeerState.ONLINE),
            PeerRecord(ME, 1, PeerState.ONLINE),
        )
        assert gate.refusal(ORIGIN, stage=0) == LIVENESS_PENDING  # and a ping went out
        assert gate.refusal(SILENT, stage=0) == LIVENESS_PENDING
        await settle()
        assert sorted(pings.sent) == [ORIGIN, SILENT]
        assert gate.refusal(ORIGIN, stage=0) is None  # answered: joining or online, at its stage
        assert gate.refusal(SILENT, stage=0) == LIVENESS_PENDING  # never answers: never a member
        assert gate.refusal(ME) is None and ME not in pings.sent  # ourselves: our record is enough

    run(body())


def test_admit_waits_for_the_first_answer_instead_of_refusing_the_first_request():
    async def body():
        pings = Pings(BLOCK)
        pings.hold = 0.02
        gate, _ = membership(pings, PeerRecord(BLOCK, 1, PeerState.ONLINE), PeerRecord(SILENT, 1, PeerState.ONLINE))
        assert await gate.admit(BLOCK, stage=1, wait=1.0) is None
        assert await gate.admit(SILENT, stage=1, wait=1.0) == LIVENESS_PENDING
        assert await gate.admit("stranger", stage=1, wait=1.0) == f"{NOT_A_MEMBER}: no record of you here"

    run(body())


def test_a_view_refresh_pings_new_online_peers_only_and_forgets_departed_ones():
    """`joining` records are pinged only when their peer asks us something: a record is free to
    sign, and its addresses could be anyone's."""

    async def body():
        pings = Pings(ORIGIN, BLOCK)
        records = [
            PeerRecord(ORIGIN, 0, PeerState.ONLINE),
            PeerRecord(BLOCK, 1, PeerState.JOINING),
            PeerRecord("leaver", 1, PeerState.LEAVING),
            PeerRecord(ME, 1, PeerState.ONLINE),
        ]
        gate, liveness = membership(pings, *records)
        gate.on_refresh(gate.view.peers_by_stage)
        await settle()
        assert pings.sent == [ORIGIN]
        gate.on_refresh(gate.view.peers_by_stage)  # passed: not pinged again
        await settle()
        assert pings.sent == [ORIGIN]
        assert gate.refusal(BLOCK, stage=1) == LIVENESS_PENDING  # the joiner asks: now it is pinged
        await settle()
        assert pings.sent == [ORIGIN, BLOCK] and gate.refusal(BLOCK, stage=1) is None
        await settle()  # the finished check leaves the running set
        gate.on_refresh({0: [records[0]]})
        assert liveness.passed(ORIGIN) and not liveness.passed(BLOCK)

    run(body())

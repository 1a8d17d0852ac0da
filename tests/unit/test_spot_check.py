"""Spot-checks: the pure rules (node/pipeline/spot_check.py) and the verifier's decisions
(node/pipeline/verifier.py) with real stage workers behind an in-memory wire that encodes and
decodes every message as the network would."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
import torch

from dht.records import EventKind, PeerRecord, RecordError, VerificationReport
from node.config import SwarmConfig, VerificationConfig
from node.p2p.peer_conduct import PeerConduct
from node.p2p.transport import TransportError
from node.pipeline.admission import RejectedInput
from node.pipeline.routing import BanList
from node.pipeline.spot_check import (
    Answer,
    CheckRate,
    Limits,
    StrikeBook,
    Tolerance,
    Verdict,
    arbitrate,
    compare,
    direction_error,
    probe_direction,
    scale_error,
)
from node.pipeline.stage_worker import StageWorker
from node.pipeline.verifier import Verifier, answer_check
from protocol import Message, MessageKind, decode_message, encode_message
from tests.helpers.faulty_node import FaultKind, corrupt

SETTINGS = VerificationConfig()
TOLERANCE = Tolerance(
    SETTINGS.tolerance_floor,
    SETTINGS.tolerance_factor,
    SETTINGS.tolerance_ceiling,
    SETTINGS.gradient_tolerance,
    SETTINGS.gross_direction_tolerance,
    SETTINGS.gross_scale_tolerance,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the pure rules --------------------------------------------------------------------------


def test_the_measures_of_the_faults_checked_for() -> None:
    torch.manual_seed(0)  # noise of 256 elements is within 0.2 of orthogonal for this seed (4 sigma)
    x = torch.randn(2, 8, 16)
    assert direction_error(x, x.clone()) == pytest.approx(0.0, abs=1e-12) and scale_error(x, x.clone()) == 0.0
    assert direction_error(x, 1.5 * x) == pytest.approx(0.0, abs=1e-12)
    assert scale_error(x, 1.5 * x) == pytest.approx(0.405, abs=1e-3)  # a scaled computation: its scale
    assert direction_error(x, torch.randn_like(x)) == pytest.approx(1.0, abs=0.2)  # noise: unrelated
    assert scale_error(x, torch.zeros_like(x)) == float("inf")  # zeros
    assert direction_error(x, -x) == pytest.approx(2.0)  # a sign flip: opposite
    assert direction_error(torch.zeros(3), torch.zeros(3)) == 0.0 and scale_error(torch.zeros(3), torch.zeros(3)) == 0
    assert direction_error(x, x[:1]) == scale_error(x, x[:1]) == float("inf")  # a misshapen answer
    assert direction_error(x, 1e30 * torch.randn_like(x)) <= 2.0  # bounded whatever a replica sends


def test_tolerance_follows_the_published_divergence_within_its_bounds() -> None:
    tolerance = Tolerance(0.2, 4.0, 0.35, 0.9, 1.2, 4.0)
    assert tolerance.limits(None) == Limits(0.2, 0.2, 0.9, 0.9)
    assert tolerance.limits(0.07, settled=False) == Limits(1.2, 4.0, 1.2, 4.0)  # before a stage settles: gross faults
    assert tolerance.limits(0.001).output_scale == 0.2
    assert tolerance.limits(0.07).output_direction == pytest.approx(0.28)
    assert tolerance.limits(1.0).output_scale == 0.35
    assert tolerance.limits(float("nan")).output_direction == 0.2
    assert tolerance.ceiling < scale_error(torch.ones(3), 1.5 * torch.ones(3))  # the mildest fault stays caught


def test_the_arbiter_sides_with_exactly_one_or_nobody_is_struck() -> None:
    limits = Limits(0.1, 0.5, 0.1, 0.5)
    same = Answer(torch.ones(4), torch.ones(4))
    near, far = compare(same, same, limits), compare(same, Answer(torch.ones(4), -torch.ones(4)), limits)
    assert near.agree and not far.agree
    assert not compare(same, Answer(3 * torch.ones(4), torch.ones(4)), limits).agree  # outputs' scale
    assert not compare(same, Answer(torch.ones(4), torch.zeros(4)), limits).agree  # gradients' scale
    assert arbitrate(near, far) == Verdict.SECOND_WRONG
    assert arbitrate(far, near) == Verdict.FIRST_WRONG
    assert arbitrate(near, near) == Verdict.INCONCLUSIVE
    assert arbitrate(far, far) == Verdict.INCONCLUSIVE


def test_strikes_decay_so_rare_bad_luck_is_forgiven() -> None:
    clock = Clock()
    book = StrikeBook(strikes_to_ban=3, half_life=600.0, clock=clock)
    assert not book.strike("a") and not book.strike("a")
    assert book.strike("a")  # three in a row: banned, and the score starts again
    assert book.score("a") == 0.0
    for _ in range(10):  # one strike an hour never adds up to three
        assert not book.strike("b")
        clock.now += 3600.0
    assert book.score("b") < 0.05
    assert "b" not in book.scores()


def test_a_disagreement_without_arbiter_raises_the_rate_for_a_while() -> None:
    clock = Clock()
    rate = CheckRate(0.02, 0.25, 300.0, clock=clock)
    rate.raise_for("a", "b")
    assert rate.of("a") == rate.of("b") == 0.25 and rate.of("c") == 0.02
    clock.now += 301.0
    assert rate.of("a") == 0.02


def test_the_probe_is_a_unit_direction() -> None:
    probe = probe_direction(torch.Size([2, 3, 4]), torch.Generator().manual_seed(1))
    assert probe.shape == (2, 3, 4) and probe.norm().item() == pytest.approx(1.0)


def test_a_verification_report_is_validated_like_any_record_field() -> None:
    report = VerificationReport(checks=3, strikes={"peer-a": 1.5}, bans=["peer-b"])
    record = PeerRecord("me", 1, verification=report)
    assert PeerRecord.from_wire(record.to_wire()).verification == report
    for bad in (
        {"strikes": {f"p{i}": 1.0 for i in range(17)}},
        {"strikes": {"p": float("nan")}},
        {"bans": "peer"},
        {"checks": -1},
    ):
        with pytest.raises(RecordError):
            VerificationReport.from_wire(bad)


# ---- answers of real stage workers -----------------------------------------------------------

CONFIG = SwarmConfig()


def workers(count: int) -> list[StageWorker]:
    return [StageWorker(CONFIG, 1) for _ in range(count)]


def make_faulty(worker: StageWorker, kind: FaultKind) -> None:
    honest = worker.module.forward
    worker.module.forward = lambda hidden: corrupt(kind, honest(hidden))  # type: ignore[method-assign]


def an_input() -> tuple[torch.Tensor, torch.Tensor]:
    t = CONFIG.training
    hidden = torch.randn(t.microbatch_size, t.sequence_length, CONFIG.model.hidden_size)
    return hidden, probe_direction(hidden.shape, torch.Generator().manual_seed(0))


def test_identical_replicas_answer_alike_and_every_fault_is_far_beyond_the_tolerance() -> None:
    honest, other, faulty = workers(3)
    hidden, probe = an_input()
    reference = Answer(*answer_check(honest, hidden, probe))
    assert compare(reference, Answer(*answer_check(other, hidden, probe)), TOLERANCE.limits(None)).distance < 1e-6
    loosest = TOLERANCE.limits(1.0)
    for kind in FaultKind:
        make_faulty(faulty := StageWorker(CONFIG, 1), kind)
        answer = Answer(*answer_check(faulty, hidden, probe))
        comparison = compare(reference, answer, loosest)
        assert not comparison.agree, f"{kind}: {comparison.describe()}"
        # before the stage settles only gross faults count: all but a 1.5x scale
        gross = compare(reference, answer, TOLERANCE.limits(None, settled=False))
        assert gross.agree == (kind == FaultKind.SCALE), f"{kind}: {gross.describe()}"


@pytest.mark.parametrize("divergence", [0.002, 0.01, 0.05])
def test_drifted_honest_replicas_stay_within_the_tolerance_at_their_divergence(divergence: float) -> None:
    """Replicas whose weights differ by `divergence` (relative L2, what records publish) answer
    within the tolerance for that divergence (the measured margin is in docs/verification.md)."""
    a, b = workers(2)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in b.module.parameters():
            noise = torch.randn(p.shape, generator=generator)
            p.add_(noise * (divergence * p.norm() / noise.norm()))
    hidden, probe = an_input()
    comparison = compare(
        Answer(*answer_check(a, hidden, probe)), Answer(*answer_check(b, hidden, probe)), TOLERANCE.limits(divergence)
    )
    assert comparison.agree, comparison.describe()


def test_a_check_changes_nothing_on_the_replica_and_refuses_bad_input() -> None:
    (worker,) = workers(1)
    before = {k: v.clone() for k, v in worker.state_dict().items()}
    hidden, probe = an_input()
    answer_check(worker, hidden, probe)
    assert all(p.grad is None for p in worker.module.parameters())
    assert worker.num_stored == 0 and worker.microbatches_done == 0
    assert all(torch.equal(before[k], v) for k, v in worker.state_dict().items())
    with pytest.raises(RejectedInput):
        answer_check(worker, hidden, probe[:, :3])
    with pytest.raises(RejectedInput):
        answer_check(worker, hidden * float("nan"), probe)


# ---- the verifier's decisions, over an in-memory wire ---------------------------------------


class Wire:
    """Peers by id; a request is encoded, decoded, handled by the receiver's verifier, and its
    reply encoded and decoded again, as p2pd streams would carry them."""

    def __init__(self) -> None:
        self.verifiers: dict[str, Verifier] = {}
        self.requests = 0


class FakeTransport:
    def __init__(self, wire: Wire, peer_id: str, stage: int):
        self.wire, self.peer_id, self.stage = wire, peer_id, stage
        self.conduct = PeerConduct(ban_until=lambda peer: 0.0, on_ban=self._on_ban)
        self.bans = BanList()
        self._ids = itertools.count(1)

    def _on_ban(self, peer_id: str, until: float, reason: str) -> None:
        self.bans.ban(peer_id, until, reason)

    def message(self, kind, meta=None, tensors=None, request_id=None) -> Message:
        request_id = next(self._ids) if request_id is None else request_id
        return Message(kind, "unit", self.stage, request_id, meta or {}, tensors or {})

    def error(self, reason: str, request_id: int = 0) -> Message:
        return self.message(MessageKind.ERROR, {"reason": reason}, request_id=request_id)

    async def request(self, peer_id: str, service: str, message: Message, timeout: float) -> Message:
        receiver = self.wire.verifiers.get(peer_id)
        if receiver is None:
            raise TransportError(f"{peer_id} is unreachable")
        self.wire.requests += 1
        delivered = decode_message(encode_message(message, "fp16"), expected_swarm="unit")
        reply = await receiver.on_check(self.peer_id, delivered)
        reply = decode_message(encode_message(reply, "fp16"), expected_swarm="unit")
        if reply.kind == MessageKind.ERROR:
            raise TransportError(reply.meta["reason"])
        return reply


class Events:
    def __init__(self) -> None:
        self.published: list[tuple[EventKind, int | None, str, str]] = []

    def publish(self, kind: EventKind, stage: int | None, detail: str, peer_id: str | None = None) -> None:
        self.published.append((kind, stage, detail, peer_id or ""))

    async def close(self) -> None:
        pass


def swarm(
    stage1: dict[str, FaultKind | None],
    settings: VerificationConfig = SETTINGS,
    divergence: float | None = None,
    live_distance: float | None = None,
) -> tuple[Wire, Verifier, Events]:
    """A router (stage 0) and the replicas of stage 1 (some faulty), each with a verifier;
    `divergence` is what the stage publishes, `live_distance` what any two replicas' fingerprints say."""
    wire = Wire()
    events = Events()

    def make(peer_id: str, stage: int) -> Verifier:
        worker = StageWorker(CONFIG, stage)
        transport = FakeTransport(wire, peer_id, stage)
        verifier = Verifier(
            settings,
            transport,  # type: ignore[arg-type]
            worker,
            transport.bans,
            events,  # type: ignore[arg-type]
            peer_id=peer_id,
            replicas=lambda s: sorted(p for p, v in wire.verifiers.items() if v.worker.stage == s and p != peer_id),
            stage_divergence=lambda s: divergence,
            replica_distance=lambda a, b: live_distance,
            stage_steps=lambda s: settings.settle_steps,  # settled: the fine tolerances apply
            is_member=lambda peer: True,
            hop_timeout=10.0,
            rng=random.Random(peer_id),
        )
        wire.verifiers[peer_id] = verifier
        return verifier

    router = make("router", 0)
    for peer_id, fault in stage1.items():
        make(peer_id, 1)
        if fault is not None:
            make_faulty(wire.verifiers[peer_id].worker, fault)
    return wire, router, events


async def check_round_robin(router: Verifier, peers: list[str], rounds: int) -> list[Verdict | None]:
    verdicts = []
    for i in range(rounds):
        hidden, _ = an_input()
        verdicts.append(await router.check(1, peers[i % len(peers)], hidden))
    return verdicts


@pytest.mark.parametrize("kind", list(FaultKind))
def test_three_replicas_ban_the_faulty_one_after_the_strikes(kind: FaultKind) -> None:
    _wire, router, events = swarm({"honest-a": None, "honest-b": None, "faulty": kind})

    async def run() -> None:
        for _ in range(12):  # each check has the faulty peer first or second with probability 2/3
            hidden, _ = an_input()
            await router.check(1, "faulty" if not router.bans.is_banned("faulty") else "honest-a", hidden)
            if router.bans.is_banned("faulty"):
                break

    asyncio.run(run())
    assert router.bans.is_banned("faulty")
    assert not router.bans.is_banned("honest-a") and not router.bans.is_banned("honest-b")
    bans = [e for e in events.published if e[0] == EventKind.VERIFICATION and e[3] == "faulty"]
    assert bans and "banned" in bans[-1][2] and "arbiter" in bans[-1][2] and "tolerance" in bans[-1][2]
    report = router.report()
    assert report.bans == ["faulty"] and report.disagreements >= SETTINGS.strikes_to_ban


def test_a_stage_with_a_far_replica_is_checked_for_gross_faults_only() -> None:
    """A published divergence above settled_divergence (a replica just rebuilt by CheckFree) makes
    the stage unsettled: a 1.5x scale passes, zeros are still banned."""
    far = SETTINGS.settled_divergence * 2
    _, router, _ = swarm({"a": None, "b": None, "scaled": FaultKind.SCALE}, divergence=far)
    assert asyncio.run(check_round_robin(router, ["scaled"], 3)) == [Verdict.AGREED] * 3
    _, router, _ = swarm({"a": None, "b": None, "zeros": FaultKind.ZEROS}, divergence=far)
    asyncio.run(check_round_robin(router, ["zeros"], 3))
    assert router.bans.is_banned("zeros")


def drift(worker: StageWorker, factor: float) -> None:
    """A replica whose outputs are `factor` x another's: what honest replicas whose live weights
    drifted apart within a gossip round look like to a check (|ln norm ratio| ln(factor))."""
    honest = worker.module.forward
    worker.module.forward = lambda hidden: honest(hidden) * factor  # type: ignore[method-assign]


def test_replicas_drifted_within_a_round_are_judged_by_their_live_distance_up_to_the_ceiling() -> None:
    """Two replicas that paired at the last round publish a divergence of ~0, while their live
    weights drift apart until the next: their fingerprints' distance scales the tolerance, up to
    its ceiling, which a 1.5x scale still exceeds whatever distance the records claim."""
    verdicts = {}
    for live in (None, 0.9):
        wire, router, _ = swarm({"a": None, "b": None}, divergence=1e-8, live_distance=live)
        drift(wire.verifiers["b"].worker, 1.3)  # ln 1.3 = 0.26: between the floor and the ceiling
        verdicts[live] = asyncio.run(check_round_robin(router, ["a", "b"], 4))
        assert not any(router.bans.is_banned(p) for p in ("a", "b"))
    assert verdicts[None] == [Verdict.UNARBITRATED] * 4  # at the floor, 0.2: the drift is beyond it
    assert verdicts[0.9] == [Verdict.AGREED] * 4  # at the ceiling, 0.35
    _, router, _ = swarm({"a": None, "b": None, "scaled": FaultKind.SCALE}, divergence=1e-8, live_distance=5.0)
    assert router.tolerance.limits(5.0).output_scale == SETTINGS.tolerance_ceiling
    asyncio.run(check_round_robin(router, ["scaled"], 9))
    assert router.bans.is_banned("scaled")


def test_honest_replicas_agree_and_nobody_is_struck() -> None:
    _wire, router, events = swarm({"a": None, "b": None, "c": None})
    verdicts = asyncio.run(check_round_robin(router, ["a", "b", "c"], 9))
    assert verdicts == [Verdict.AGREED] * 9
    assert not events.published and router.report().strikes == {} and router.stats.checks == 9
    assert 0.0 <= router.stats.largest_agreeing < TOLERANCE.floor


def test_two_replicas_disagreeing_are_watched_closely_but_nobody_is_banned() -> None:
    _wire, router, events = swarm({"a": None, "faulty": FaultKind.SCALE})
    verdicts = asyncio.run(check_round_robin(router, ["a", "faulty"], 6))
    assert verdicts == [Verdict.UNARBITRATED] * 6
    assert not router.bans.is_banned("a") and not router.bans.is_banned("faulty")
    assert router.rate.of("a") == router.rate.of("faulty") == SETTINGS.raised_rate
    assert all(e[0] == EventKind.VERIFICATION and "no arbiter" in e[2] for e in events.published)


def test_a_replica_audit_bans_a_faulty_stage_mate_and_blames_nobody_when_it_is_the_odd_one() -> None:
    wire, _router, events = swarm({"a": None, "b": None, "faulty": FaultKind.SIGNFLIP})
    auditor = wire.verifiers["a"]

    async def audit_until_banned() -> None:
        hidden, _ = an_input()
        auditor.worker.forward("mb", hidden)  # a microbatch in flight: its input is what is audited
        for _ in range(30):
            await auditor.audit()
            if auditor.bans.is_banned("faulty"):
                return

    asyncio.run(audit_until_banned())
    assert auditor.bans.is_banned("faulty") and not auditor.bans.is_banned("b")

    faulty = wire.verifiers["faulty"]  # the faulty peer audits the honest ones: it blames only itself

    async def faulty_audits() -> None:
        hidden, _ = an_input()
        faulty.worker.forward("mb", hidden)
        for _ in range(6):
            await faulty.audit()

    asyncio.run(faulty_audits())
    assert not faulty.bans.is_banned("a") and not faulty.bans.is_banned("b")
    assert any("lost an audit" in e[2] and e[3] == "faulty" for e in events.published)


def test_a_replica_that_does_not_answer_is_not_struck() -> None:
    wire, router, _events = swarm({"a": None, "b": None})
    del wire.verifiers["b"]  # gone: its requests fail
    hidden, _ = an_input()
    router.replicas = lambda stage: ["a", "b"]
    assert asyncio.run(router.check(1, "a", hidden)) is None
    assert router.stats.unanswered == 1 and not router.report().strikes


def test_checks_are_served_for_the_own_stage_only_and_within_the_concurrency_limit() -> None:
    wire, router, _ = swarm({"a": None})
    replica = wire.verifiers["a"]
    hidden, probe = an_input()
    wrong_stage = router.transport.message(MessageKind.CHECK, {"stage": 2}, {"hidden": hidden, "probe": probe})
    assert asyncio.run(replica.on_check("router", wrong_stage)).kind == MessageKind.ERROR
    replica._serving = SETTINGS.max_concurrent
    busy = router.transport.message(MessageKind.CHECK, {"stage": 1}, {"hidden": hidden, "probe": probe})
    assert asyncio.run(replica.on_check("router", busy)).kind == MessageKind.BUSY


# ---- what status and the dashboard show --------------------------------------------------------


def test_status_sums_the_strikes_and_bans_that_records_report_against_each_peer() -> None:
    from node.monitor.dashboard.peer_table import strikes_cell
    from node.monitor.status import accusations, format_table, peer_view

    reporters = [
        PeerRecord("router", 0, verification=VerificationReport(checks=40, strikes={"bad": 1.5}, bans=["worse"])),
        PeerRecord("mate", 1, verification=VerificationReport(checks=3, strikes={"bad": 0.5}, bans=["worse"])),
        PeerRecord("bad", 1),
        PeerRecord("worse", 1),
    ]
    accused = accusations(reporters)
    assert accused == {"bad": {"strikes": 2.0, "banned_by": 0}, "worse": {"strikes": 0.0, "banned_by": 2}}
    views = {record.peer_id: peer_view(record, accused) for record in reporters}
    assert views["mate"]["strikes"] == 0.0 and views["mate"]["banned_by"] == 0
    assert strikes_cell(views["mate"]).plain == "-"
    assert strikes_cell(views["bad"]).plain == "2.0"
    assert strikes_cell(views["worse"]).plain == "0.0 ban x2"
    snapshot = {
        "swarm_id": "s",
        "num_stages": 2,
        "model_parameters": 1,
        "config_hash": "h",
        "stages": [
            {"stage": s, "status": "ok", "peers": [v for v in views.values() if v["stage"] == s], "throughput": 1.0,
             "parameters": 1, "memory": {"total": 1}}
            for s in (0, 1)
        ],
    }  # fmt: skip
    assert "strikes 0.0, banned by 2" in format_table(snapshot)


def test_strikes_a_few_seconds_apart_still_add_up_to_a_ban() -> None:
    clock = Clock()
    book = StrikeBook(strikes_to_ban=3, half_life=600.0, clock=clock)
    for _ in range(2):
        assert not book.strike("a")
        clock.now += 20.0
    assert book.strike("a")  # 3 strikes in 40 s: 2.93 after decay, within the margin

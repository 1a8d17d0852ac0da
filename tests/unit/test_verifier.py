"""Spot-checks over an in-memory wire that encodes and decodes every message as the network would:
real StageWorkers keep receipts of real microbatches (node/pipeline/receipts.py), answer checks
(node/pipeline/check_server.py), and a checker decides and strikes (node/pipeline/verifier.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from node.config import SwarmConfig
from node.pipeline.hop_observations import Observed
from node.pipeline.spot_check import Finding
from node.pipeline.verifier import Verifier
from protocol import Message, MessageKind
from tests.helpers.check_harness import CONFIG, SETTINGS, Swarm
from tests.helpers.faulty_node import FaultKind


def as_previous_peer(observed: Observed) -> Observed:
    """What the peer that sent the hop saw: the input it sent, the input gradient it received."""
    return dataclasses.replace(observed, received_output=None, sent_grad_output=None)


def as_next_peer(observed: Observed) -> Observed:
    """What the peer that received the hop's output saw when the output arrived."""
    return dataclasses.replace(observed, sent_input=None, received_grad_input=None, sent_grad_output=None)


def with_layers(layers: int) -> SwarmConfig:
    return dataclasses.replace(CONFIG, model=dataclasses.replace(CONFIG.model, layers_per_stage=layers))


# ---- honest replicas pass, however far they drifted ---------------------------------------------


@pytest.mark.parametrize("seen_by", [lambda o: o, as_previous_peer, as_next_peer])
def test_an_honest_replica_passes_from_wherever_its_hop_is_seen(seen_by) -> None:
    swarm = Swarm()
    swarm.add("honest")
    assert [swarm.check(seen_by(swarm.hop("honest"))) for _ in range(3)] == [Finding.PASSED] * 3
    report = swarm.checker.report()
    assert report.checks == 3 and report.failed == 0 and not report.strikes and not swarm.events.published
    assert 0.0 <= report.largest_error < SETTINGS.fp32_tolerance and swarm.replicas["honest"].server.served == 3
    assert report.check_seconds > 0.0


def test_replicas_drifted_far_apart_each_pass_at_their_own_weights() -> None:
    """Nothing compares one replica with another: a replica whose weights moved 50 % (far beyond
    any NoLoCo drift) passes exactly as its untouched mate does."""
    swarm = Swarm()
    swarm.add("a")
    drifted = swarm.add("b")
    with torch.no_grad():
        for p in drifted.worker.module.parameters():
            p.add_(0.5 * p.norm() / p.numel() ** 0.5 * torch.randn_like(p))
    assert [swarm.check(swarm.hop(peer)) for peer in ("a", "b", "a", "b")] == [Finding.PASSED] * 4


def test_a_microbatch_is_checked_at_the_weights_it_ran_on_after_the_replica_stepped() -> None:
    """The forward ran on a stash; the optimizer stepped before the check came: the receipt still
    holds that version, so the replay matches."""
    swarm = Swarm()
    replica = swarm.add("honest")
    early = [swarm.hop("honest") for _ in range(CONFIG.training.microbatches_per_step)]
    assert replica.worker.inner_step >= 1  # the weights the early microbatches ran on are gone from the module
    assert [swarm.check(observed) for observed in early] == [Finding.PASSED] * len(early)


def test_a_stage_of_several_layers_is_checked_one_layer_at_a_time() -> None:
    swarm = Swarm(with_layers(3))
    swarm.add("honest")
    swarm.add("faulty", FaultKind.SCALE)
    assert [swarm.check(swarm.hop("honest")) for _ in range(6)] == [Finding.PASSED] * 6
    assert {swarm.check(swarm.hop("faulty")) for _ in range(3)} <= {Finding.WRONG_FORWARD, Finding.WRONG_BACKWARD}


# ---- every fault is evidence, and three of them ban ---------------------------------------------


@pytest.mark.parametrize(
    ("kind", "seen_by", "finding"),
    [
        (FaultKind.SCALE, as_previous_peer, Finding.WRONG_FORWARD),
        (FaultKind.SCALE, as_next_peer, Finding.WRONG_FORWARD),
        (FaultKind.NOISE, as_next_peer, Finding.WRONG_FORWARD),
        (FaultKind.ZEROS, as_previous_peer, Finding.WRONG_FORWARD),
        (FaultKind.SIGNFLIP, as_previous_peer, Finding.WRONG_BACKWARD),
        (FaultKind.CHECKS_AWARE, as_previous_peer, Finding.NOT_WHAT_IT_SENT),
        (FaultKind.CHECKS_AWARE, as_next_peer, Finding.NOT_WHAT_IT_SENT),
        (FaultKind.WEIGHTS_LIE, lambda o: o, Finding.NOT_WHAT_IT_COMMITTED),
    ],
)
def test_a_faulty_replica_is_struck_on_evidence_and_banned_after_three(kind, seen_by, finding) -> None:
    swarm = Swarm()
    swarm.add("honest")
    swarm.add("faulty", kind)
    assert [swarm.check(seen_by(swarm.hop("faulty"))) for _ in range(3)] == [finding] * 3
    assert swarm.check(swarm.hop("honest")) == Finding.PASSED
    bans = swarm.checker.bans
    assert bans.is_banned("faulty") and not bans.is_banned("honest")
    assert list(swarm.checker.report().strikes) == [] and swarm.checker.report().bans == ["faulty"]
    details = [detail for detail, peer in swarm.events.published if peer == "faulty"]
    assert len(details) == 4 and all(str(finding) in detail for detail in details)  # 3 strikes, then the ban
    assert details[-1].startswith("banned") and all(peer == "faulty" for _, peer in swarm.events.published)


def test_a_fault_that_starts_later_is_caught_from_its_first_microbatch() -> None:
    swarm = Swarm()
    faulty = {"on": False}
    swarm.add("replica", FaultKind.SCALE, active=lambda: faulty["on"])
    assert [swarm.check(swarm.hop("replica")) for _ in range(3)] == [Finding.PASSED] * 3
    faulty["on"] = True
    assert swarm.check(swarm.hop("replica")) == Finding.WRONG_FORWARD


def auditing(swarm: Swarm, mate: str, fault: FaultKind) -> Verifier:
    """A replica "auditor" whose only stage mate is `mate` (with `fault`), with an input of its own
    still in flight to audit with."""
    swarm.add("auditor")
    swarm.add(mate, fault)
    auditor = swarm.verifier_for("auditor", swarm.replicas["auditor"].worker)
    auditor.replicas = lambda stage: [mate]
    swarm.hop("auditor", backward=False)
    return auditor


def test_a_replica_honest_on_checks_only_passes_audits_but_not_the_checks_of_its_traffic() -> None:
    swarm = Swarm()
    auditor = auditing(swarm, "liar", FaultKind.CHECKS_AWARE)
    assert asyncio.run(auditor.audit()) == Finding.PASSED  # an audit is a message it can tell from traffic
    assert swarm.check(as_previous_peer(swarm.hop("liar"))) == Finding.NOT_WHAT_IT_SENT


def test_stage_mates_audit_each_other_and_ban_one_that_computes_wrong() -> None:
    swarm = Swarm()
    auditor = auditing(swarm, "faulty", FaultKind.SIGNFLIP)
    assert [asyncio.run(auditor.audit()) for _ in range(3)] == [Finding.WRONG_BACKWARD] * 3
    assert auditor.bans.is_banned("faulty")
    assert asyncio.run(auditor.audit()) is None  # no mate left that is not banned


# ---- no answer is not evidence --------------------------------------------------------------------


def test_a_check_left_unanswered_strikes_nobody_and_raises_the_rate() -> None:
    swarm = Swarm(settings=dataclasses.replace(SETTINGS, max_receipts=1))
    swarm.add("replica")
    first = swarm.hop("replica")
    swarm.hop("replica")  # the only receipt kept now is the second's
    assert swarm.check(first) is None
    assert swarm.check(dataclasses.replace(swarm.hop("replica"), token="guessed")) is None
    del swarm.wire.servers["replica"]  # gone
    assert swarm.check(swarm.hop("replica")) is None
    report = swarm.checker.report()
    assert report.unanswered == 3 and report.checks == 0 and not report.strikes and not swarm.events.published
    assert swarm.checker.rate.of("replica") == SETTINGS.raised_rate


def test_a_microbatch_run_on_live_weights_cannot_be_checked_and_strikes_nobody() -> None:
    config = dataclasses.replace(CONFIG, training=dataclasses.replace(CONFIG.training, stashed_weights=0))
    swarm = Swarm(config)
    swarm.add("replica")
    assert swarm.check(swarm.hop("replica")) is None and swarm.checker.report().unanswered == 1


def test_the_replica_commits_for_its_own_stage_within_its_limit_and_opens_once_to_its_checker() -> None:
    swarm = Swarm()
    replica = swarm.add("replica")
    observed = swarm.hop("replica")
    meta = {"stage": 1, "origin": "checker", "microbatch_id": observed.microbatch_id, "token": observed.token}
    ask = replica.server.transport.message

    def answer(sender: str, kind: MessageKind, meta: dict) -> Message:
        return asyncio.run(replica.server.on_request(sender, ask(kind, meta)))

    assert answer("checker", MessageKind.CHECK, {**meta, "stage": 2}).kind == MessageKind.ERROR
    commitment = answer("checker", MessageKind.CHECK, meta)
    assert commitment.kind == MessageKind.COMMITMENT and commitment.meta["precision"] == "fp32"
    opening = {"stage": 1, "commitment": commitment.meta["commitment"], "layer": 0, "forward": [0], "backward": []}
    assert answer("someone else", MessageKind.OPEN, opening).kind == MessageKind.ERROR  # only its checker opens it
    assert answer("checker", MessageKind.OPEN, opening).kind == MessageKind.OPENING
    assert answer("checker", MessageKind.OPEN, opening).kind == MessageKind.ERROR  # and only once
    second = answer("checker", MessageKind.CHECK, meta)
    replica.server._serving = SETTINGS.max_concurrent
    assert answer("checker", MessageKind.CHECK, meta).kind == MessageKind.BUSY
    opening["commitment"] = second.meta["commitment"]  # a check already committed to is finished, busy or not
    assert answer("checker", MessageKind.OPEN, opening).kind == MessageKind.OPENING


def test_hops_seen_in_passing_are_drawn_and_the_origin_checks_its_own_hop_once() -> None:
    swarm = Swarm(settings=dataclasses.replace(SETTINGS, rate=1.0))
    swarm.add("replica")
    observed = swarm.hop("replica")
    checker, key = swarm.checker, (observed.origin, observed.microbatch_id)
    checker.forward_sent(1, "replica", *key, observed.token, observed.sent_input, None)
    checker.forward_received(1, "replica", *key, observed.token, observed.received_output, None)  # merged, not launched
    checker.backward_sent("replica", *key, observed.sent_grad_output)
    assert len(checker._tasks) == 0 and len(checker.pending) == 1

    async def complete() -> None:
        checker.backward_received("replica", *key, observed.received_grad_input)
        assert len(checker._tasks) == 1  # launched once its backward came back: everything in hand
        for _ in range(400):  # bounded: a check takes milliseconds here
            if len(checker._tasks) == 0:
                return
            await asyncio.sleep(0.05)

    asyncio.run(complete())
    assert checker.report().checks == 1 and len(checker.pending) == 0

"""The hostile peer's case table judges a refusal by the check that made it.

A case is `rejected` only when its evidence (the node's replies and notices, and the target's log
lines naming the case's own peer or microbatch ids) shows each check the case targets; refused by
anything else it is `refused-by-another-check`, which fails tests/swarm/test_hostile_peer.py.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers import hostile_cases
from tests.helpers.hostile_cases import CASES, OTHER_CHECK, REJECTED, Result, confirm_check

NAN_CASE = next(c for c in CASES if c.name == "nan_activations")
MEMBER = "QmMemberPeerIdOfTheCase0123456789abcdefghijklmn"


def rejected(detail: str = "", replies: list[dict] | None = None, notices: list[dict] | None = None) -> Result:
    res = Result(NAN_CASE.name, NAN_CASE.service, NAN_CASE.expected)
    res.set(REJECTED, detail)
    res.replies, res.notices = replies or [], notices or []
    res.peers.append(MEMBER)
    res.microbatches.append(123456789)
    return res


def test_every_case_names_the_checks_that_must_refuse_it():
    assert len(CASES) >= 37
    for case in CASES:
        assert case.refused_by, case.name
        for pattern in (*case.refused_by, *(case.refused_by_stage0 or ())):
            re.compile(pattern)


def test_a_case_without_a_target_check_cannot_be_registered():
    with pytest.raises(ValueError, match="names no check"):
        hostile_cases.Case("unchecked", "forward", "anything", "anything", hostile_cases.frames(list), refused_by=())


def test_the_membership_gate_is_not_the_nan_check():
    res = rejected(
        "BUSY",
        replies=[{"label": "nan hidden", "status": "message", "kind": "busy", "reason": "not a member of this swarm"}],
    )
    confirm_check(NAN_CASE, res, stage=1, log_text="")
    assert res.outcome == OTHER_CHECK
    assert "contains NaN or infinite values" in res.detail


def test_the_nan_check_named_in_an_abort_notice_confirms_the_case():
    notice = {
        "service": "abort",
        "kind": "error",
        "reason": "forward rejected: forward input: contains NaN or infinite values",
    }
    res = rejected("ACK, then an ABORT notice", notices=[notice])
    confirm_check(NAN_CASE, res, stage=1, log_text="")
    assert res.outcome == REJECTED


def test_log_lines_count_only_when_they_name_the_case():
    other = "13:00:00 INFO node.pipeline.block_relay: rejected forward from SomeOne1: contains NaN or infinite values"
    res = rejected("stream closed by the node")
    confirm_check(NAN_CASE, res, stage=1, log_text=other)
    assert res.outcome == OTHER_CHECK

    own = (
        f"13:00:00 INFO node.pipeline.block_relay: rejected forward from {MEMBER[-8:]}: contains NaN or infinite values"
    )
    res = rejected("stream closed by the node")
    confirm_check(NAN_CASE, res, stage=1, log_text=other + "\n" + own)
    assert res.outcome == REJECTED


def test_the_harness_own_words_are_no_evidence():
    res = rejected("the node said: contains NaN or infinite values")
    confirm_check(NAN_CASE, res, stage=1, log_text="")
    assert res.outcome == OTHER_CHECK


def test_a_stage0_target_is_judged_by_its_own_checks():
    res = rejected(
        "ERROR", replies=[{"label": "nan hidden", "status": "message", "kind": "error", "reason": "unknown microbatch"}]
    )
    confirm_check(NAN_CASE, res, stage=0, log_text="")
    assert res.outcome == REJECTED
    res = rejected(
        "ERROR", replies=[{"label": "nan hidden", "status": "message", "kind": "error", "reason": "unknown microbatch"}]
    )
    confirm_check(NAN_CASE, res, stage=1, log_text="")
    assert res.outcome == OTHER_CHECK


def test_every_targeted_check_must_show_not_just_one():
    case = next(c for c in CASES if c.name == "tensor_bad_dtype")
    res = Result(case.name, case.service, case.expected)
    res.set(REJECTED, "ERROR")
    res.replies = [
        {
            "label": "dtype complex128#1",
            "status": "message",
            "kind": "error",
            "reason": "bad request: tensor 'hidden': unsupported tensor dtype 'complex128'",
        }
    ]
    confirm_check(case, res, stage=1, log_text="")
    assert res.outcome == OTHER_CHECK and "unknown tensor codec" in res.detail


def test_other_outcomes_are_left_as_they_are():
    res = rejected()
    res.set(hostile_cases.ACCEPTED, "ACK and no rejection")
    confirm_check(NAN_CASE, res, stage=1, log_text="")
    assert res.outcome == hostile_cases.ACCEPTED


def test_the_harness_knows_the_nodes_liveness_refusal():
    """The hostile peer sends a request again after a BUSY asking it to answer the node's liveness
    ping first (as an honest peer does), recognising the BUSY by this text."""
    from node.p2p.membership import LIVENESS_PENDING

    assert LIVENESS_PENDING.startswith(hostile_cases.LIVENESS_PENDING)

"""A hop's typed header (protocol/microbatch_header.py): from the meta and back without a key's
difference, the next hop's header, and a header's meta as the wire and the services take it."""

from __future__ import annotations

import pytest
import torch

from node.pipeline.contracts import BACKWARD_CONTRACT, FORWARD_CONTRACT
from protocol import (
    POSTED_KEY,
    PURPOSE_KEY,
    BackwardHeader,
    ForwardHeader,
    Message,
    MicrobatchPurpose,
    ProtocolError,
    decode_message,
    encode_message,
)

ORIGIN, FIRST, SECOND = "origin-peer", "stage-1-peer", "stage-2-peer"
TOKEN = "0123456789abcdef"

# each as an origin sends it (node/pipeline/origin.py), then as it arrives from the transport
FORWARD_METAS = {
    "training": {"microbatch_id": 7, "origin": ORIGIN, "path": [ORIGIN], "order": [2, 1], "hop": 1, "token": TOKEN},
    "evaluation": {
        "microbatch_id": 8,
        "origin": ORIGIN,
        "path": [ORIGIN, FIRST],
        "order": [1, 2],
        "hop": 2,
        "token": TOKEN,
        PURPOSE_KEY: "eval",
    },
    "an older peer's, posted": {
        "microbatch_id": 9,
        "origin": ORIGIN,
        "path": [ORIGIN, FIRST, SECOND],
        "order": [1, 2],
        "hop": 3,
        POSTED_KEY: True,
    },
    "stating training, with a newer peer's key": {
        "microbatch_id": 10,
        "origin": ORIGIN,
        "path": [ORIGIN],
        "order": [1],
        "hop": 1,
        "token": "",
        PURPOSE_KEY: "train",
        "newer": [1, 2],
    },
}
BACKWARD_METAS = {
    "training": {"microbatch_id": 7, "path": [ORIGIN, FIRST, SECOND], "hop": 2, "token": TOKEN},
    "an older peer's, posted": {"microbatch_id": 9, "path": [ORIGIN, FIRST], "hop": 0, POSTED_KEY: True},
}


@pytest.mark.parametrize("meta", FORWARD_METAS.values(), ids=FORWARD_METAS)
def test_a_forward_meta_comes_back_from_its_header_key_for_key(meta: dict) -> None:
    header = ForwardHeader.from_meta(meta)
    assert header.to_meta() == meta
    assert list(header.to_meta()) == list(meta)  # the same order too: the same bytes on the wire


@pytest.mark.parametrize("meta", BACKWARD_METAS.values(), ids=BACKWARD_METAS)
def test_a_backward_meta_comes_back_from_its_header_key_for_key(meta: dict) -> None:
    header = BackwardHeader.from_meta(meta)
    assert header.to_meta() == meta
    assert list(header.to_meta()) == list(meta)


def test_a_header_reads_what_its_meta_says_and_what_it_leaves_out() -> None:
    training = ForwardHeader.from_meta(FORWARD_METAS["training"])
    assert (training.microbatch_id, training.origin, training.path, training.order, training.hop) == (
        7,
        ORIGIN,
        (ORIGIN,),
        (2, 1),
        1,
    )
    assert training.token == TOKEN and training.carries_token and training.purpose is None and training.trains
    evaluation = ForwardHeader.from_meta(FORWARD_METAS["evaluation"])
    assert evaluation.purpose is MicrobatchPurpose.EVAL and not evaluation.trains
    older = ForwardHeader.from_meta(FORWARD_METAS["an older peer's, posted"])
    assert older.token == "" and not older.carries_token and older.passed_on == ((POSTED_KEY, True),)
    stated = ForwardHeader.from_meta(FORWARD_METAS["stating training, with a newer peer's key"])
    assert stated.purpose is MicrobatchPurpose.TRAIN and stated.trains and stated.carries_token
    backward = BackwardHeader.from_meta(BACKWARD_METAS["training"])
    assert (backward.origin, backward.sender, backward.token) == (ORIGIN, ORIGIN, TOKEN)  # the origin starts it
    assert BackwardHeader.from_meta({**BACKWARD_METAS["training"], "hop": 1}).sender == SECOND


def test_an_unknown_purpose_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="purpose"):
        ForwardHeader.from_meta({**FORWARD_METAS["training"], PURPOSE_KEY: "backward"})


def test_a_header_built_by_an_origin_sends_what_origins_always_sent() -> None:
    built = ForwardHeader(7, ORIGIN, (ORIGIN,), (2, 1), 1, TOKEN)
    assert list(built.to_meta().items()) == list(FORWARD_METAS["training"].items())
    evaluation = ForwardHeader(8, ORIGIN, (ORIGIN, FIRST), (1, 2), 2, TOKEN, MicrobatchPurpose.EVAL)
    assert list(evaluation.to_meta().items()) == list(FORWARD_METAS["evaluation"].items())
    backward = BackwardHeader(7, (ORIGIN, FIRST, SECOND), 2, TOKEN)
    assert list(backward.to_meta().items()) == list(BACKWARD_METAS["training"].items())


def test_the_next_hop_extends_the_path_and_keeps_the_rest() -> None:
    received = ForwardHeader.from_meta({**FORWARD_METAS["evaluation"], POSTED_KEY: True})
    sent = received.next_hop(SECOND)
    assert (sent.hop, sent.path) == (3, (ORIGIN, FIRST, SECOND))
    # what a peer that copies the meta it received and changes two keys would send
    assert sent.to_meta() == {**received.to_meta(), "hop": 3, "path": [ORIGIN, FIRST, SECOND]}
    assert received.hop == 2 and received.path == (ORIGIN, FIRST)  # a header is never changed in place

    backward = BackwardHeader.from_meta({**BACKWARD_METAS["training"], POSTED_KEY: True})
    assert backward.next_hop().to_meta() == {**backward.to_meta(), "hop": 1}
    assert backward.next_hop().path == backward.path


@pytest.mark.parametrize(
    "header, contract, tensors",
    [
        *(
            (ForwardHeader.from_meta(meta), FORWARD_CONTRACT, {"hidden": torch.zeros(1, 2, 4)})
            for meta in FORWARD_METAS.values()
        ),
        *(
            (BackwardHeader.from_meta(meta), BACKWARD_CONTRACT, {"grad": torch.zeros(1, 2, 4)})
            for meta in BACKWARD_METAS.values()
        ),
        (
            ForwardHeader(1, ORIGIN, (ORIGIN,), (1,), 1).next_hop(FIRST),
            FORWARD_CONTRACT,
            {"hidden": torch.zeros(1, 2, 4)},
        ),
        (BackwardHeader(1, (ORIGIN, FIRST), 1).next_hop(), BACKWARD_CONTRACT, {"grad": torch.zeros(1, 2, 4)}),
    ],
)
def test_a_headers_meta_passes_the_message_checks_and_its_service_contract(header, contract, tensors) -> None:
    message = Message(header.KIND, "swarm", 0, 1, header.to_meta(), tensors)
    received = decode_message(encode_message(message))  # each validates the meta against its kind's schema
    contract.check(received)
    assert received.kind == header.KIND and type(header).from_meta(received.meta) == header

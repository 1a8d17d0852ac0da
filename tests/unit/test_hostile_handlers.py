"""Every request handler a node registers, driven with arbitrary envelopes from senders of every
standing, through the node's real stream path (tests/helpers/served_handlers.py): admission,
decoding, the service's contract, the handler, and the work it queued. Each request must end in
one clean reply (a reply or a refusal that decodes), no exception may escape, and nothing may be
logged with a traceback, whatever the kind, meta (missing keys, wrong types, non-ASCII strings,
huge ints, nested lists and maps, None) or tensors (any small shape and dtype, NaN, inf).

PIPESWARM_HYPOTHESIS_EXAMPLES sets how many envelopes (`make hostile` runs many more)."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.config import SwarmConfig
from node.p2p.membership import LIVENESS_CONTRACT, LIVENESS_SERVICE
from node.p2p.peer_conduct import ConductLimits
from node.pipeline.check_wire import CHECK_SERVICE
from node.pipeline.contracts import ABORT_CONTRACT, BACKWARD_CONTRACT, CHECK_CONTRACT, FORWARD_CONTRACT
from node.pipeline.in_flight import InFlight
from node.pipeline.traffic import ABORT, BACKWARD, FORWARD
from protocol import (
    DTYPES,
    KIND_SCHEMAS,
    KIND_TENSORS,
    PROTOCOL_VERSION,
    MessageKind,
    MicrobatchPurpose,
    encode_tensor,
    frame_header,
)
from tests.helpers.served_handlers import SWARM, ServedNode, served_node

EXAMPLES = int(os.environ.get("PIPESWARM_HYPOTHESIS_EXAMPLES", "200"))
CONFIG = SwarmConfig(num_stages=2)
HIDDEN = CONFIG.model.hidden_size
ORIGIN, BLOCK = "origin-peer", "block-peer"
MEMBER, STRANGER, BANNED = "member-peer", "stranger-peer", "banned-peer"
MICROBATCH_ID = 7  # the origin's attempt in flight during every example
CONTRACTS = {FORWARD: FORWARD_CONTRACT, BACKWARD: BACKWARD_CONTRACT, ABORT: ABORT_CONTRACT}
CONTRACTS[CHECK_SERVICE] = CHECK_CONTRACT
CONTRACTS[LIVENESS_SERVICE] = LIVENESS_CONTRACT
# strikes never ban here, so every example reaches the handlers; BANNED is banned from the start
UNBANNABLE = ConductLimits(strikes_to_ban=10**9, requests_per_second=1e9, request_burst=10**9)

META_KEYS = sorted({key for schema in KIND_SCHEMAS.values() for key in schema} | {"token", "purpose", "posted"})
PEERS = st.sampled_from([ORIGIN, BLOCK, MEMBER, STRANGER, BANNED])
HUGE_INTS = st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
SMALL_INTS = st.integers(min_value=-2, max_value=5)
TEXT = st.text(max_size=24)  # any code point but surrogates, which msgpack cannot carry
LEAVES = st.none() | st.booleans() | HUGE_INTS | SMALL_INTS | st.floats() | TEXT | st.binary(max_size=16) | PEERS
META_VALUES = st.recursive(
    LEAVES, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8
)
# values of the right type more often than not, so that checks past the first are reached too
TOKENS = st.sampled_from(["<the token>", "", "é" * 16, "0" * 16, "\x00\x7f"]) | TEXT | HUGE_INTS
SHAPED = {
    "microbatch_id": st.sampled_from([MICROBATCH_ID]) | HUGE_INTS,
    "origin": PEERS | TEXT,
    "path": st.lists(PEERS, max_size=4) | st.lists(META_VALUES, max_size=3),
    "order": st.lists(SMALL_INTS, max_size=4) | st.lists(HUGE_INTS, max_size=3),
    "hop": SMALL_INTS | HUGE_INTS,
    "stage": SMALL_INTS | HUGE_INTS,
    "token": TOKENS,
    "purpose": st.sampled_from([p.value for p in MicrobatchPurpose]) | TEXT | HUGE_INTS,
    "reason": TEXT,
    "layer": SMALL_INTS | HUGE_INTS,
    "forward": st.lists(SMALL_INTS, max_size=3) | st.lists(HUGE_INTS, max_size=2),
    "backward": st.lists(SMALL_INTS, max_size=3),
    "commitment": SMALL_INTS | HUGE_INTS,
}
WIRE_DTYPES = sorted(DTYPES.values(), key=str)  # every dtype the wire carries
TENSOR_NAMES = st.sampled_from(["hidden", "grad", "targets", "probe", "weights", "chunk"]) | st.text(
    min_size=1, max_size=6
)


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from([torch.float32] * len(WIRE_DTYPES) + WIRE_DTYPES))  # often what a hop carries
    if draw(st.booleans()):  # the shape a block stage takes: (batch, sequence, hidden)
        shape = [draw(st.integers(1, 2)), draw(st.integers(1, 4)), HIDDEN]
    else:
        shape = draw(st.lists(st.integers(0, 4), max_size=4))
    values = torch.randn(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 1000))))
    special = draw(st.sampled_from([None, float("nan"), float("inf"), 1e30]))
    if special is not None and values.numel():
        values.view(-1)[0] = special
    return values.to(dtype) if dtype.is_floating_point else values.clamp(-100, 100).to(dtype)


# a valid value of each type a kind's schema names (protocol/messages.py), for the aimed envelopes
VALID = {
    int: st.sampled_from([0, 1, 2, MICROBATCH_ID]) | st.integers(0, (1 << 64) - 1),
    str: PEERS | TEXT.filter(bool),
    list[str]: st.lists(PEERS, max_size=4),
    list[int]: st.lists(st.integers(0, 3), max_size=4),
    list[list[int]]: st.lists(st.lists(st.integers(0, 4), max_size=3), max_size=3),
}
# what each service takes, and a microbatch as it would really be addressed to the origin (stage 0)
# or to the block-stage peer (stage 1), by `sender`
AIMED_KINDS = {
    FORWARD: [MessageKind.FORWARD],
    BACKWARD: [MessageKind.BACKWARD],
    ABORT: [MessageKind.ERROR],
    CHECK_SERVICE: [MessageKind.CHECK, MessageKind.AUDIT, MessageKind.OPEN],
    LIVENESS_SERVICE: [MessageKind.PING],
}


def coherent(service: str, sender: str) -> list[dict]:
    token = {"microbatch_id": MICROBATCH_ID, "token": "<the token>"}
    return {
        FORWARD: [
            {"origin": sender, "path": [sender], "order": [1], "hop": 1, "microbatch_id": 3},
            {"origin": ORIGIN, "path": [ORIGIN, sender], "order": [1], "hop": 2, **token},
        ],
        BACKWARD: [
            {"path": [ORIGIN, BLOCK, sender], "hop": 1, "microbatch_id": 3},
            {"path": [ORIGIN, sender], "hop": 0, **token},
        ],
        ABORT: [{"reason": "gave up", **token}],
        CHECK_SERVICE: [{"stage": 1, "origin": ORIGIN, "microbatch_id": 3, "token": "0" * 16}],
        LIVENESS_SERVICE: [{}],
    }[service]


@st.composite
def aimed_meta(draw, service: str, kind: MessageKind, sender: str) -> dict:
    """A meta that passes the kind's schema, often a coherent microbatch, with some fields fuzzed."""
    meta = {key: draw(VALID[spec]) for key, spec in KIND_SCHEMAS[kind].items()}
    if draw(st.integers(0, 3)):
        meta.update(draw(st.sampled_from(coherent(service, sender))))
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        key = draw(st.sampled_from(sorted(SHAPED)))
        meta[key] = draw(SHAPED[key])
    return meta


@st.composite
def envelopes(draw) -> tuple[str, str, MessageKind | str, dict, dict]:
    service = draw(st.sampled_from([FORWARD, BACKWARD, ABORT, CHECK_SERVICE, LIVENESS_SERVICE]))
    sender = draw(PEERS)
    names = draw(st.lists(TENSOR_NAMES, max_size=2))
    if draw(st.integers(0, 3)):  # aimed: the service's kinds, the schema met, the tensors named
        kind = draw(st.sampled_from(AIMED_KINDS[service]))
        meta = draw(aimed_meta(service, kind, sender))
        names += sorted(KIND_TENSORS[kind])
    else:  # wild: any kind, any meta
        kind = draw(st.sampled_from(list(MessageKind)) | TEXT)
        meta = draw(st.dictionaries(st.sampled_from(META_KEYS) | TEXT, META_VALUES, max_size=8))
    return service, sender, kind, meta, {name: draw(tensors()) for name in names}


def frame_of(kind: MessageKind | str, meta: dict, tensors: dict[str, torch.Tensor], token: str) -> bytes:
    """A frame packed by hand, as a hostile peer would: none of encode_message's checks on the way out."""
    meta = {key: token if value == "<the token>" else value for key, value in meta.items()}
    body = {
        "kind": str(kind),
        "swarm_id": SWARM,
        "sender_stage": 1,
        "request_id": 3,
        "meta": meta,
        "tensors": {name: encode_tensor(t) for name, t in tensors.items()},
    }
    payload = msgpack.packb(PROTOCOL_VERSION) + msgpack.packb(body, use_bin_type=True)
    return frame_header(payload) + payload


@pytest.fixture(scope="module")
def nodes():
    """An origin (stage 0) and a block-stage peer that also answers spot-checks, on one loop."""
    loop = asyncio.new_event_loop()
    members = {ORIGIN, BLOCK, MEMBER, BANNED}
    torch.set_num_threads(1)
    origin = loop.run_until_complete(served_node(CONFIG, 0, ORIGIN, members, UNBANNABLE))
    block = loop.run_until_complete(served_node(CONFIG, 1, BLOCK, members, UNBANNABLE, with_checks=True))
    for node in (origin, block):
        node.bans.ban(BANNED, time.time() + 86400, "banned before the test")  # for longer than any run
    yield loop, origin, block
    for node in (origin, block):
        loop.run_until_complete(node.close())
    loop.close()


def test_every_handler_is_registered_with_its_contract(nodes):
    _, origin, block = nodes
    assert set(origin.transport.requests.services) == {FORWARD, BACKWARD, ABORT, LIVENESS_SERVICE}
    assert set(block.transport.requests.services) == {FORWARD, BACKWARD, ABORT, CHECK_SERVICE, LIVENESS_SERVICE}


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(envelope=envelopes(), to_origin=st.booleans())
def test_any_envelope_from_anyone_ends_in_one_clean_reply(nodes, caplog, envelope, to_origin):
    loop, origin, block = nodes
    service, sender, kind, meta, tensors = envelope
    node: ServedNode = origin if to_origin and service in origin.transport.requests.services else block

    async def one_request():
        ticket = InFlight.start(MICROBATCH_ID, torch.zeros(1, 4, dtype=torch.long), [1], MicrobatchPurpose.TRAIN)
        origin.pipeline.in_flight = {MICROBATCH_ID: ticket}
        reply, writer = await node.exchange(sender, service, frame_of(kind, meta, tensors, ticket.token))
        await node.settle()
        if ticket.done.done():  # as run_microbatch, which waits on it, would: an abort settles it
            ticket.done.exception()
        return reply, writer

    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        reply, writer = loop.run_until_complete(one_request())
    assert reply is not None and writer.closed
    if sender == BANNED:
        assert reply.kind == MessageKind.ERROR and "banned" in reply.meta["reason"]
    if kind not in CONTRACTS[service].kinds:
        assert reply.kind == MessageKind.ERROR
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
    assert tracebacks == []
    failed_tasks = [r.getMessage() for r in caplog.records if r.name == "node.runtime.tasks"]
    assert failed_tasks == []

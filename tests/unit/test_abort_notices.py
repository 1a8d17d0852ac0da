"""Pipeline.on_abort, the origin's handler for "a peer on the path gave up", reached as a peer's
stream reaches it (tests/helpers/served_handlers.py): a notice for one of its attempts fails that
attempt at once; anything else from anyone (a non-ASCII token, a PING carrying a valid id and token,
a wrong token, a token of the wrong type) is one ERROR reply, with no traceback in the log; what
broke the service's contract is a strike, and the sender is banned after three."""

from __future__ import annotations

import asyncio
import logging

import torch

from node.config import SwarmConfig
from node.pipeline.abort_notices import AbortNotices
from node.pipeline.in_flight import InFlight
from node.pipeline.traffic import ABORT, BACKWARD, FORWARD
from protocol import Message, MessageKind, MicrobatchPurpose, frame_header, seal_message
from tests.helpers.served_handlers import SWARM, served_node

ORIGIN, PEER, STRANGER = "origin-peer", "peer-on-the-path", "stranger"


def frame(kind: MessageKind, meta: dict) -> bytes:
    payload = seal_message(Message(kind, SWARM, 1, 5, meta))
    return frame_header(payload) + payload


def test_an_abort_notice_fails_its_attempt_and_anything_else_is_refused_cleanly(caplog):
    async def scenario() -> None:
        node = await served_node(SwarmConfig(num_stages=2), 0, ORIGIN, members={ORIGIN, PEER})
        try:
            ticket = InFlight.start(7, torch.zeros(1, 4, dtype=torch.long), [1], MicrobatchPurpose.TRAIN)
            node.pipeline.in_flight[7] = ticket
            refused = [
                frame(MessageKind.ERROR, {"reason": "x", "microbatch_id": 7, "token": "é" * 16}),  # not ASCII
                frame(MessageKind.ERROR, {"reason": "x", "microbatch_id": 7, "token": "0" * 16}),  # wrong token
                frame(MessageKind.ERROR, {"reason": "x", "microbatch_id": 7, "token": 12345}),  # not a string
                frame(MessageKind.ERROR, {"reason": "x", "token": ticket.token}),  # no microbatch named
                frame(MessageKind.PING, {"microbatch_id": 7, "token": ticket.token}),  # not an abort notice
            ]
            for request in refused:
                reply, writer = await node.exchange(STRANGER, ABORT, request)
                assert reply is not None and reply.kind == MessageKind.ERROR, reply
                assert writer.closed and not ticket.done.done()
            assert node.bans.is_banned(STRANGER) and not node.bans.is_banned(PEER)
            notice = frame(MessageKind.ERROR, {"reason": "busy", "microbatch_id": 7, "token": ticket.token})
            reply, _ = await node.exchange(PEER, ABORT, notice)
            assert reply is not None and reply.kind == MessageKind.ACK and ticket.done.done()
            assert "gave up: busy" in str(ticket.done.exception())
        finally:
            await node.close()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []


# ------------------------------------------------------------------------------------------------
# Who a block stage tells: never an origin that a request merely names (node/pipeline/abort_notices.py)

VICTIM, RELAY, BLOCK = "victim-named-by-a-request", "relay-of-stage-1", "block-of-stage-2"


def test_notices_go_to_origins_this_peer_handled_or_that_sent_the_request_else_back_to_the_sender() -> None:
    sent: list[tuple] = []

    async def notify(*notice) -> None:
        sent.append(notice)

    async def scenario() -> None:
        spawned: list = []
        notices = AbortNotices(notify, spawned.append, memory=2)
        assert not notices.tell_origin(VICTIM, 4, "t", "named only", sender=RELAY)
        assert notices.tell_origin(ORIGIN, 4, "t", "the origin sent it", sender=ORIGIN)
        notices.handled(VICTIM, 4)
        assert notices.tell_origin(VICTIM, 4, "t", "handled here", sender=RELAY)
        notices.handled(ORIGIN, 5)
        notices.handled(ORIGIN, 6)  # memory 2: (VICTIM, 4) is forgotten
        assert not notices.tell_origin(VICTIM, 4, "t", "forgotten", sender=RELAY)
        notices.handled(ORIGIN, 8, "secret")
        assert notices.relay({"microbatch_id": 8, "token": "secret"}, "lost further on")
        assert not notices.relay({"microbatch_id": 8, "token": "guessed"}, "a stranger's notice")
        await asyncio.gather(*spawned)
        assert (notices.withheld, notices.told, notices.relayed) == (2, 3, 1)
        assert sent == [
            (RELAY, 4, "t", "named only"),  # back to the sender, who relays it if it handled the microbatch
            (ORIGIN, 4, "t", "the origin sent it"),
            (VICTIM, 4, "t", "handled here"),
            (RELAY, 4, "t", "forgotten"),
            (ORIGIN, 8, "secret", "lost further on"),
        ]

    asyncio.run(scenario())


def hop(kind: MessageKind, meta: dict, tensors: dict) -> bytes:
    payload = seal_message(Message(kind, SWARM, 1, 9, meta, tensors))
    return frame_header(payload) + payload


def test_a_block_stage_reflects_nothing_to_an_origin_a_request_names(caplog) -> None:
    """A BACKWARD for a microbatch this stage never computed is refused before any work, and a
    FORWARD it rejects names a victim as its origin: the victim is told nothing. A forward it
    computed and could not pass on is told to its origin, and so is a notice from further on that
    names it by id and token; a gradient for it must name it by its origin, id and token too."""
    config = SwarmConfig(num_stages=4)
    width = config.model.hidden_size

    async def scenario() -> None:
        node = await served_node(config, 2, BLOCK, members={ORIGIN, RELAY, VICTIM})
        try:
            aborts = node.pipeline.aborts
            backward = {"path": [VICTIM, BLOCK, RELAY], "hop": 1, "microbatch_id": 11, "token": "a" * 16}
            reply, _ = await node.exchange(
                RELAY, BACKWARD, hop(MessageKind.BACKWARD, backward, {"grad": torch.zeros(1, 4, width)})
            )
            await node.settle()
            assert reply.kind == MessageKind.ERROR and reply.meta["reason"] == "unknown microbatch"
            assert (aborts.withheld, aborts.told) == (0, 0)  # no work, and nobody hears of it
            forward = {"origin": VICTIM, "path": [VICTIM, RELAY], "order": [1, 2, 3], "hop": 2, "microbatch_id": 12}
            misshapen = {"hidden": torch.zeros(1, 4, width + 1)}
            await node.exchange(RELAY, FORWARD, hop(MessageKind.FORWARD, {**forward, "token": "b" * 16}, misshapen))
            await node.settle()
            assert (aborts.withheld, aborts.told) == (1, 0)
            handled = {**forward, "origin": ORIGIN, "path": [ORIGIN, RELAY], "microbatch_id": 13, "token": "c" * 16}
            await node.exchange(RELAY, FORWARD, hop(MessageKind.FORWARD, handled, {"hidden": torch.zeros(1, 4, width)}))
            await node.settle()  # computed, then no peer of stage 3 to take it: the origin is told
            assert (aborts.withheld, aborts.told) == (1, 1)
            grad = {"grad": torch.zeros(1, 4, width)}
            for wrong in ({"token": "d" * 16}, {"path": [VICTIM, BLOCK, RELAY]}):  # a guessed token, another origin
                named = {"path": [ORIGIN, BLOCK, RELAY], "hop": 1, "microbatch_id": 13, "token": "c" * 16, **wrong}
                reply, _ = await node.exchange(RELAY, BACKWARD, hop(MessageKind.BACKWARD, named, grad))
                assert reply.kind == MessageKind.ERROR and reply.meta["reason"] == "unknown microbatch"
            named = {"path": [ORIGIN, BLOCK, RELAY], "hop": 1, "microbatch_id": 13, "token": "c" * 16}
            reply, _ = await node.exchange(RELAY, BACKWARD, hop(MessageKind.BACKWARD, named, grad))
            assert reply.kind == MessageKind.ACK  # its own origin, id and token: taken
            await node.settle()
            told = aborts.told  # however its backward went here, the notices so far went to ORIGIN only
            notice = frame(MessageKind.ERROR, {"reason": "lost", "microbatch_id": 13, "token": "c" * 16})
            reply, _ = await node.exchange(VICTIM, ABORT, notice)  # from further on: passed on to ORIGIN
            assert (
                reply is not None and reply.kind == MessageKind.ACK and (aborts.relayed, aborts.told) == (1, told + 1)
            )
            guessed = frame(MessageKind.ERROR, {"reason": "lost", "microbatch_id": 13, "token": "d" * 16})
            reply, _ = await node.exchange(VICTIM, ABORT, guessed)
            assert reply is not None and reply.kind == MessageKind.ERROR and aborts.relayed == 1
        finally:
            await node.close()

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())

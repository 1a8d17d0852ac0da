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
from node.pipeline.evaluation import MicrobatchPurpose
from node.pipeline.traffic import ABORT, InFlight
from protocol import Message, MessageKind, frame_header, seal_message
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

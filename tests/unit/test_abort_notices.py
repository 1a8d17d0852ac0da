"""Pipeline.on_abort, the origin's handler for "a peer on the path gave up": a notice for one of its
attempts fails that attempt at once; anything else from anyone is refused with one ERROR reply and
no exception (a non-ASCII token, a PING carrying a valid id and token, a wrong token)."""

from __future__ import annotations

import asyncio

import torch

from node.pipeline.evaluation import MicrobatchPurpose
from node.pipeline.traffic import InFlight, Pipeline
from protocol import Message, MessageKind


class Replies:
    """The two replies the handler builds (a stand-in for the Transport, which only builds messages here)."""

    def message(self, kind: MessageKind, meta: dict | None = None, tensors: dict | None = None, request_id: int = 0):
        return Message(kind, "s", 0, request_id, meta or {})

    def error(self, reason: str, request_id: int = 0) -> Message:
        return self.message(MessageKind.ERROR, {"reason": reason}, request_id=request_id)


def origin_with_one_attempt() -> tuple[Pipeline, InFlight]:
    pipeline = object.__new__(Pipeline)  # only the attempts in flight and the replies take part here
    pipeline.transport = Replies()
    ticket = InFlight.start(7, torch.zeros(1, 4, dtype=torch.long, device="cpu"), [1], MicrobatchPurpose.TRAIN)
    pipeline.in_flight = {7: ticket}
    return pipeline, ticket


def notice(kind: MessageKind, meta: dict) -> Message:
    return Message(kind, "s", 1, 5, meta)


def test_an_abort_notice_fails_its_attempt_and_anything_else_is_refused_cleanly():
    async def scenario() -> None:
        pipeline, ticket = origin_with_one_attempt()
        refused = [
            notice(MessageKind.ERROR, {"reason": "x", "microbatch_id": 7, "token": "é" * 16}),  # not ASCII
            notice(MessageKind.ERROR, {"reason": "x", "microbatch_id": 7, "token": "0" * 16}),  # wrong token
            notice(MessageKind.PING, {"microbatch_id": 7, "token": ticket.token}),  # not an abort notice
        ]
        for message in refused:
            reply = pipeline.on_abort("stranger", message)
            assert reply.kind == MessageKind.ERROR, (message, reply)
            assert not ticket.done.done()
        ok = pipeline.on_abort(
            "peer", notice(MessageKind.ERROR, {"reason": "busy", "microbatch_id": 7, "token": ticket.token})
        )
        assert ok.kind == MessageKind.ACK and ticket.done.done()
        assert "gave up: busy" in str(ticket.done.exception())

    asyncio.run(scenario())

"""Outcomes of posted hops (node/p2p/channels.py, Channel.post), and the fake transport that posts
them, for the unit tests of HopSender (node/pipeline/hops.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from protocol import ForwardHeader, MessageKind


def forward_header(microbatch_id: int = 1) -> ForwardHeader:
    """The header of a FORWARD leaving its origin for stage 1: what these tests send."""
    return ForwardHeader(microbatch_id, "origin", ("origin",), (1,), 1)


def outcome(kind: MessageKind | None = None, reason: str = "") -> asyncio.Future:
    """A settled outcome: None (taken in silence) or a reply of `kind` (call on a running loop)."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(None if kind is None else SimpleNamespace(kind=kind, meta={"reason": reason}))
    return future


def pending() -> asyncio.Future:
    """An outcome the test settles later (a refusal or a closed channel after the send returned)."""
    return asyncio.get_running_loop().create_future()


class PostingTransport:
    """What HopSender needs of a transport, faked: messages are plain namespaces sealed to a fixed
    payload, and every post is recorded (whom it went to, `sent_to`, and the late refusal each
    peer's last post was given, `late_refusals`). A post is taken in silence unless `settle` (a
    subclass's, or one a test sets) says otherwise."""

    def __init__(self) -> None:
        self.sent_to: list[str] = []
        self.late_refusals: dict[str, Callable[..., Any]] = {}

    def message(self, kind: MessageKind, meta: dict, tensors: dict) -> SimpleNamespace:
        return SimpleNamespace(kind=kind, meta=meta, tensors=tensors, request_id=1)

    def seal_posted(self, message: Any, compression: Any = None) -> bytes:
        return b"payload"

    async def post(
        self, peer_id, service, request_id, payload, timeout, refusal_window, on_late_refusal
    ) -> asyncio.Future:
        self.sent_to.append(peer_id)
        self.late_refusals[peer_id] = on_late_refusal
        return self.settle(peer_id, payload)

    def settle(self, peer_id: str, payload: bytes) -> asyncio.Future:
        """How the post of `payload` to `peer_id` turns out (raise for a send that fails)."""
        return outcome()

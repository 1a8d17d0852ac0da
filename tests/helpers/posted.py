"""Outcomes of posted hops (node/p2p/channels.py, Channel.post) for fake transports in unit tests."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from protocol import MessageKind


def outcome(kind: MessageKind | None = None, reason: str = "") -> asyncio.Future:
    """A settled outcome: None (taken in silence) or a reply of `kind` (call on a running loop)."""
    future = asyncio.get_running_loop().create_future()
    future.set_result(None if kind is None else SimpleNamespace(kind=kind, meta={"reason": reason}))
    return future


def pending() -> asyncio.Future:
    """An outcome the test settles later (a refusal or a closed channel after the send returned)."""
    return asyncio.get_running_loop().create_future()

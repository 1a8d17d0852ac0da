"""Bounded waits that never swallow a cancellation.

Python 3.11's `asyncio.wait_for` can lose a `cancel()` that arrives just as the awaited thing
finishes; a background loop built on it then keeps running after its task was cancelled, and
`asyncio.run` hangs at exit waiting for it. `asyncio.timeout` does not have that race.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout: float | None) -> T:
    """`await awaitable`, raising TimeoutError after `timeout` seconds (None: no limit)."""
    async with asyncio.timeout(timeout):
        return await awaitable

"""Admission of the streams and sessions peers open to us: each sender is admitted by its conduct
(node/p2p/peer_conduct.py: bans, strikes, a slot per sender) before its handler reads a byte, and
refused with one ERROR otherwise; its slot is released and the stream closed however the handler ends.
The transport (node/p2p/transport.py) runs every p2pd stream and direct-link session through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from dht.records import short_peer_id
from node.p2p.metered_stream import metered
from node.p2p.peer_conduct import PeerConduct
from node.runtime.meter import Meter
from node.runtime.timeouts import within

logger = logging.getLogger(__name__)

SessionHandler = Callable[[str, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
Refusal = Callable[[asyncio.StreamWriter, str], Awaitable[None]]  # sends one ERROR with the reason

# A refused stream is half-closed and left open this long (reading and dropping at most
# REFUSAL_DRAIN_BYTES) for its opener to read the ERROR: closed at once, p2pd resets the stream when
# the opener's request arrives after the close, and a reset drops the ERROR unread (the opener saw
# "stream closed" instead of the refusal). Past MAX_LINGERING_REFUSALS at once, streams close at once.
REFUSAL_LINGER = 2.0
REFUSAL_DRAIN_BYTES = 256 * 1024
MAX_LINGERING_REFUSALS = 64


class StreamRefusals:
    """Refused streams, each half-closed after its ERROR and left open for at most REFUSAL_LINGER
    (reading and dropping at most REFUSAL_DRAIN_BYTES) until its opener closes its side."""

    def __init__(self) -> None:
        self.lingering = 0

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, send: Awaitable[None]) -> None:
        with contextlib.suppress(Exception):
            await within(send, 1.0)  # bounded: a refused peer gets no time
            if self.lingering < MAX_LINGERING_REFUSALS and writer.can_write_eof():
                self.lingering += 1
                try:
                    writer.write_eof()
                    await within(_drop_until_eof(reader, REFUSAL_DRAIN_BYTES), REFUSAL_LINGER)
                finally:
                    self.lingering -= 1
        writer.close()


async def _drop_until_eof(reader: asyncio.StreamReader, budget: int) -> None:
    """Read and drop what the peer sends until it closes its side or `budget` bytes went by."""
    while budget > 0:
        chunk = await reader.read(min(budget, 64 * 1024))
        if not chunk:
            return
        budget -= len(chunk)


class StreamAdmission:
    """Admits senders' streams before their handlers run (one per transport)."""

    def __init__(self, conduct: PeerConduct, meter: Meter, refuse: Refusal):
        self.conduct, self.meter, self.refuse = conduct, meter, refuse
        self.refusals = StreamRefusals()

    def handler(self, service: str, body: SessionHandler):
        """A p2pd stream handler that runs `body` for an admitted sender."""

        async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await self.run(info.peer_id.to_base58(), service, reader, writer, body)
            except asyncio.CancelledError:
                # the stream's task must not end cancelled (work cut at shutdown, or the task
                # itself): Python 3.11's asyncio streams then call task.exception() on it, which
                # raises, and the loop logs a traceback. Nothing awaits this task.
                logger.debug(f"a {service} stream from {short_peer_id(info.peer_id.to_base58())} was cancelled")

        return on_stream

    async def run(
        self,
        sender: str,
        service: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        body: SessionHandler,
        metered_here: bool = True,
    ) -> None:
        """`body` on this stream if `sender` is admitted, else its refusal (`metered_here`: count its
        bytes under `service`; a direct link counts its own frames)."""
        if metered_here:
            reader, writer = metered(reader, writer, self.meter, service)
        refusal = self.conduct.admit(sender)
        if refusal is not None:
            logger.debug(f"refused a {service} stream from {short_peer_id(sender)}: {refusal}")
            await self.refusals.answer(reader, writer, self.refuse(writer, refusal))  # closes it once read
            return
        try:
            await body(sender, reader, writer)
        finally:
            self.conduct.release(sender)
            writer.close()

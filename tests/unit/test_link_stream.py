"""Sessions on direct links (node/p2p/link_stream.py): a byte stream in frames, paused while its
reader lags, whose last bytes arrive whole even when the sender closes right after writing them."""

from __future__ import annotations

import asyncio
import os

import pytest

from dht.identity_keys import Identity
from node.p2p.direct import DirectLinks
from node.p2p.link_stream import READ_LIMIT, link_stream
from node.p2p.sealed_link import SealedLink
from protocol import DEFAULT_LIMITS
from tests.unit.test_direct_links import SWARM, run

SERVICE = "gossip/session"


@pytest.fixture(scope="module")
def identities() -> list[Identity]:
    return [Identity.generate() for _ in range(2)]


def test_a_session_sent_and_closed_at_once_reaches_a_slow_reader_whole(identities):
    # more than the reader holds before it pauses the link (2 x READ_LIMIT), less than that plus what
    # the paused link then buffers before it stops reading its socket: the close arrives while paused
    payload = os.urandom(2 * READ_LIMIT + (1 << 20))

    async def main():
        server = DirectLinks(identities[0])

        async def send_all_and_close(sender: str, link: SealedLink) -> None:
            reader, writer = link_stream(link, DEFAULT_LIMITS)
            request = await reader.readexactly(5)
            for start in range(0, len(payload), 64 << 10):
                writer.write(payload[start : start + (64 << 10)])
                await writer.drain()
            writer.write(request)
            writer.close()  # at once: what was written is still the reader's

        server.serve(SWARM, SERVICE, send_all_and_close)
        port = await server.listen("127.0.0.1", 0)
        client = DirectLinks(identities[1])
        link = await client.open(identities[0].peer_id, [("127.0.0.1", port)], SWARM, SERVICE, 10.0)
        reader, writer = link_stream(link, DEFAULT_LIMITS)
        writer.write(b"hello")
        await asyncio.sleep(1.0)  # the sender is done and gone before we read a byte
        assert len(reader._buffer) <= 2 * READ_LIMIT + (1 << 20)  # paused: the rest waited in TCP and the link
        got = await asyncio.wait_for(reader.read(), 20.0)  # until EOF
        assert got == payload + b"hello"
        await server.close()

    run(main())


def test_a_session_whose_link_breaks_mid_record_is_an_error_not_an_end(identities):
    async def main():
        server = DirectLinks(identities[0])

        async def cut_short(sender: str, link: SealedLink) -> None:
            link.transport().write(b"\x00\x00\x10\x00garbage")  # a record's length, then far too little
            link.transport().close()

        server.serve(SWARM, SERVICE, cut_short)
        port = await server.listen("127.0.0.1", 0)
        client = DirectLinks(identities[1])
        link = await client.open(identities[0].peer_id, [("127.0.0.1", port)], SWARM, SERVICE, 10.0)
        reader, _ = link_stream(link, DEFAULT_LIMITS)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(reader.read(), 10.0)
        await server.close()

    run(main())

"""A session's byte stream on a direct link: what a libp2p stream is to the services that own a
whole stream (gossip rounds, state downloads: `Transport.serve_sessions` and `Transport.session`).

Sessions go through p2pd, except to a peer behind a NAT that announces relays: there they take a
direct link, punched or relayed (node/p2p/traversal.py). Two home replicas of one stage can average
only this way: p2pd's relayed circuits cannot be relied on past 128 KiB, a fraction of one round
(node/p2p/reachability.py). Every peer serves its sessions on direct links as well as on p2pd.

The link carries the stream as frames: each `write` is one frame (at most the transport's frame
limit), and each frame that arrives is fed, in order, to an `asyncio.StreamReader` the session
reads as it would a stream's. The reader pauses the link while more than twice its limit waits
unread, so a fast sender waits in TCP, not in our memory. A link that ends between frames is the
stream's end (EOF); one that breaks is the reader's error.
"""

from __future__ import annotations

import asyncio
from typing import Any

from node.p2p.sealed_link import SealedLink
from protocol import Limits

SESSION_SUFFIX = "/session"  # a session service's name on direct links (channels use the plain name)
READ_LIMIT = 1 << 20  # bytes the reader holds before it pauses the link (it pauses at twice this)


class _PausesLink:
    """What a StreamReader calls on its transport when its buffer fills and drains."""

    def __init__(self, link: SealedLink):
        self._link = link

    def pause_reading(self) -> None:
        self._link.pause_reading()

    def resume_reading(self) -> None:
        self._link.resume_reading()


class LinkWriter:
    """The writing half of a session on a direct link: the calls sessions make on a StreamWriter."""

    def __init__(self, link: SealedLink):
        self._link = link

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if memoryview(data).nbytes:
            self._link.send_frame(data)  # ConnectionResetError once the link closed, as a stream's write

    async def drain(self) -> None:
        await self._link.drain()

    def can_write_eof(self) -> bool:
        return False  # a link ends whole: a refusal is sent, then the link closes after it

    def close(self) -> None:
        self._link.close()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._link.get_extra_info(name, default)


def link_stream(link: SealedLink, limits: Limits) -> tuple[asyncio.StreamReader, LinkWriter]:
    """A reader and writer for a session on `link` (sealed, not started)."""
    reader = asyncio.StreamReader(limit=READ_LIMIT)
    reader.set_transport(_PausesLink(link))  # type: ignore[arg-type]

    def on_closed(error: BaseException | None) -> None:
        if error is None:
            reader.feed_eof()
        else:
            reader.set_exception(error if isinstance(error, Exception) else ConnectionResetError(str(error)))

    link.start(lambda frame: reader.feed_data(bytes(frame)), on_closed, limits)
    return reader, LinkWriter(link)

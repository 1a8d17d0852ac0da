"""What a channel (node/p2p/channels.py) runs on: a link that carries whole frames both ways.

A link hands each frame that arrives, whole, to its consumer's `on_frame` callback, and each frame
written goes out at once; `on_closed` hears once how the link ended. Two kinds exist:
- a direct link (node/p2p/sealed_link.py, `SealedLink`): frames are split from the decrypted
  records in the connection's `data_received`, with no task and no stream reader per frame;
- a libp2p stream through p2pd (`StreamFrameLink` below): a reader task reads frame after frame
  (protocol/framing.py) and hands each on the same way.
So the channel client and server have one code path, whichever link a peer is reached by.

`on_closed(error)`: None when the peer ended the link cleanly between frames; a ProtocolError when it
sent something a well-behaved peer never sends (a frame over the size limit, one cut short: the
channel server strikes it); any other exception when the connection broke. The consumer hears it
before the link closes, so it can still send a last frame (a channel server's refusal).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from protocol import Limits, ProtocolError, read_frame, write_frame_now

OnFrame = Callable[[bytes | memoryview], None]
OnClosed = Callable[[BaseException | None], None]


class FrameLink(Protocol):
    """Both directions of one link, frame by frame."""

    def start(self, on_frame: OnFrame, on_closed: OnClosed, limits: Limits) -> None:
        """Hand every frame (each at most `limits.max_frame_bytes`) to `on_frame` from now on."""

    def send_frame(self, payload: bytes | bytearray | memoryview) -> None:
        """Queue one frame for sending at once; ProtocolError over the size limit, ConnectionError when closed."""

    async def drain(self) -> None:
        """Wait until the link's send buffer is below its high-water mark."""

    def write_backlog(self) -> int:
        """Bytes written and not yet taken by the connection."""

    def pause_reading(self) -> None:
        """Hand on no frame until `resume_reading` (the peer's sends then wait in TCP)."""

    def resume_reading(self) -> None: ...

    def close(self) -> None: ...

    def get_extra_info(self, name: str, default: Any = None) -> Any: ...


class StreamFrameLink:
    """A libp2p stream (a reader and writer p2pd handed us) as a FrameLink."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader, self._writer = reader, writer
        self._limits: Limits | None = None
        self._task: asyncio.Task | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()

    def start(self, on_frame: OnFrame, on_closed: OnClosed, limits: Limits) -> None:
        self._limits = limits
        self._task = asyncio.create_task(self._read(on_frame, on_closed, limits), name="stream frame link")

    async def _read(self, on_frame: OnFrame, on_closed: OnClosed, limits: Limits) -> None:
        error: BaseException | None = ConnectionResetError("the stream was closed")
        try:
            while True:
                if not self._resumed.is_set():
                    await self._resumed.wait()
                on_frame(await read_frame(self._reader, limits))
        except EOFError:  # the peer is done, between two frames
            error = None
        except (ProtocolError, ConnectionError, OSError, asyncio.IncompleteReadError) as e:
            error = e
        finally:
            on_closed(error)
            self._writer.close()

    def send_frame(self, payload: bytes | bytearray | memoryview) -> None:
        assert self._limits is not None, "send_frame before start"
        write_frame_now(self._writer, payload, self._limits)

    async def drain(self) -> None:
        await self._writer.drain()

    def write_backlog(self) -> int:
        transport = self._writer.transport
        return transport.get_write_buffer_size() if transport is not None else 0

    def pause_reading(self) -> None:
        self._resumed.clear()

    def resume_reading(self) -> None:
        self._resumed.set()

    def close(self) -> None:
        self._writer.close()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._writer.get_extra_info(name, default)

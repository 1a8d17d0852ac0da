"""Byte counts per service: a stream's reader and writer wrapped so every byte is tallied.

The transport wraps both ends of every stream it opens or accepts, so request/reply traffic,
gossip sessions and state transfers are all counted by the same few lines, whatever code reads
or writes the stream. Only the calls our code makes are counted (readexactly, read, write; see
protocol/framing.py and node/p2p/tensor_stream.py); everything else passes through unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

from node.runtime.meter import Direction, Meter


class MeteredReader:
    def __init__(self, reader: asyncio.StreamReader, meter: Meter, service: str):
        self._reader, self._meter, self._service = reader, meter, service

    async def readexactly(self, n: int) -> bytes:
        try:
            data = await self._reader.readexactly(n)
        except asyncio.IncompleteReadError as e:  # what arrived still crossed the wire
            self._meter.traffic(Direction.RECEIVED, self._service, len(e.partial))
            raise
        self._meter.traffic(Direction.RECEIVED, self._service, len(data))
        return data

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        self._meter.traffic(Direction.RECEIVED, self._service, len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


class MeteredWriter:
    def __init__(self, writer: asyncio.StreamWriter, meter: Meter, service: str):
        self._writer, self._meter, self._service = writer, meter, service

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._writer.write(data)
        self._meter.traffic(Direction.SENT, self._service, memoryview(data).nbytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


def metered(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, meter: Meter, service: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Both ends of a stream, counting into `meter` under `service` (typed as the plain streams:
    callers use them exactly as they would the originals)."""
    return MeteredReader(reader, meter, service), MeteredWriter(writer, meter, service)  # type: ignore[return-value]

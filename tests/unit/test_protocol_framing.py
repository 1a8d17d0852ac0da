"""Framing: length checks before reading, clean vs mid-frame EOF, and a real loopback TCP round trip."""

from __future__ import annotations

import asyncio
import random
import struct

import pytest
import torch

from protocol import (
    COMPRESSIONS,
    FrameSplitter,
    Limits,
    Message,
    MessageKind,
    ProtocolError,
    decode_tensor,
    encode_message,
    encode_tensor,
    read_frame,
    recv_message,
    send_message,
    write_frame,
)
from protocol.tensors import SUBSPACE_BITS

SWARM = "swarm-a"


def header(length: int) -> bytes:
    return struct.pack(">Q", length)


def run(coro, timeout: float = 5.0):
    # every test bounds itself: a framing bug shows up as a hang, and this turns it into a failure
    return asyncio.run(asyncio.wait_for(coro, timeout))


def reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_oversized_declared_length_rejected_without_reading() -> None:
    async def go() -> None:
        # no EOF and no payload: if read_frame tried to read the payload it would hang
        reader = reader_with(header(2**62) + b"abc", eof=False)
        with pytest.raises(ProtocolError, match="max_frame_bytes"):
            await read_frame(reader)
        assert await reader.read(3) == b"abc"  # nothing past the header was consumed

    run(go())


def test_limit_is_inclusive() -> None:
    async def go() -> None:
        limits = Limits(max_frame_bytes=100)
        assert await read_frame(reader_with(header(100) + b"x" * 100), limits) == b"x" * 100
        with pytest.raises(ProtocolError, match="max_frame_bytes"):
            await read_frame(reader_with(header(101) + b"x" * 101), limits)

    run(go())


@pytest.mark.parametrize(
    "data", [header(10) + b"12345", header(10), b"\x00\x00\x00"], ids=["payload", "no-payload", "header"]
)
def test_truncated_frame_is_protocol_error(data: bytes) -> None:
    async def go() -> None:
        with pytest.raises(ProtocolError, match="stream closed mid-frame"):
            await read_frame(reader_with(data))

    run(go())


def test_eof_at_frame_boundary_is_eoferror() -> None:
    async def go() -> None:
        reader = reader_with(header(3) + b"abc" + header(0))
        assert await read_frame(reader) == b"abc"
        assert await read_frame(reader) == b""
        with pytest.raises(EOFError):
            await read_frame(reader)
        with pytest.raises(EOFError):
            await recv_message(reader_with(b""))

    run(go())


def test_garbage_frame_is_protocol_error() -> None:
    async def go() -> None:
        with pytest.raises(ProtocolError):
            await recv_message(reader_with(header(4) + b"\xc1\xc1\xc1\xc1"))

    run(go())


def sample_messages() -> list[tuple[Message, str]]:
    fwd = Message(
        MessageKind.FORWARD,
        SWARM,
        0,
        1,
        {"microbatch_id": 0, "origin": "p0", "path": ["p0"], "order": [0, 1], "hop": 0},
        {"hidden": torch.randn(4, 8, 16), "targets": torch.randint(0, 256, (4, 8))},
    )
    chunk = Message(
        MessageKind.GOSSIP_CHUNK,
        SWARM,
        1,
        2**64 - 1,
        {"round": 3, "index": 0, "offset": 0},
        {"chunk": torch.randn(300_000)},
    )  # > 1 MiB: exercises drain and multi-read
    return [(fwd, c) for c in COMPRESSIONS] + [(chunk, "none"), (Message(MessageKind.PING, SWARM, -1, 9), "none")]


def test_loopback_tcp_round_trip() -> None:
    async def go() -> None:
        received: list[Message] = []
        errors: list[Exception] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    msg = await recv_message(reader, expected_swarm=SWARM)
                    received.append(msg)
                    await send_message(writer, Message(MessageKind.ACK, SWARM, 1, msg.request_id))
            except EOFError:
                pass
            except ProtocolError as e:
                errors.append(e)
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            sent = sample_messages()
            for msg, compression in sent:
                await send_message(writer, msg, compression)
                ack = await recv_message(reader, expected_swarm=SWARM)
                assert ack.kind is MessageKind.ACK and ack.request_id == msg.request_id
            # a peer from another swarm is rejected on the server side
            await write_frame(writer, encode_message(Message(MessageKind.PING, "other", 0, 0)))
            with pytest.raises(EOFError):
                await recv_message(reader)
            writer.close()
            await writer.wait_closed()
        finally:
            server.close()
            await server.wait_closed()

        assert len(received) == len(sent) and len(errors) == 1 and "swarm" in str(errors[0])
        for (msg, compression), got in zip(sent, received):
            assert got.kind == msg.kind and got.meta == msg.meta and got.tensors.keys() == msg.tensors.keys()
            for name, t in msg.tensors.items():
                assert got.tensors[name].dtype == t.dtype and got.tensors[name].shape == t.shape
                if compression == "none" or not t.is_floating_point():
                    assert torch.equal(got.tensors[name], t)
                elif compression in SUBSPACE_BITS:  # the projection, which the codec's own tests bound
                    assert torch.equal(got.tensors[name], decode_tensor(encode_tensor(t, compression)))
                else:
                    assert torch.allclose(got.tensors[name], t, atol=0.1, rtol=0.02)

    run(go(), timeout=20)


def test_write_frame_refuses_oversize() -> None:
    class NullWriter:
        def write(self, data) -> None:
            raise AssertionError("nothing may be written")

        async def drain(self) -> None:
            pass

    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        run(write_frame(NullWriter(), b"x" * 11, Limits(max_frame_bytes=10)))  # type: ignore[arg-type]


def test_the_splitter_returns_every_frame_whatever_the_chunks_cut():
    """Frames of many sizes, cut into chunks at random places (inside headers, across several
    chunks, several frames to a chunk), come out whole and in order; a frame whole inside one chunk
    is a view of it, not a copy."""
    rng = random.Random(7)
    payloads = [bytes(rng.getrandbits(8) for _ in range(n)) for n in (0, 1, 7, 8, 9, 300, 5000, 0, 70000, 3)]
    stream = b"".join(struct.pack(">Q", len(p)) + p for p in payloads)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(stream)), 12))
        chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        splitter, out = FrameSplitter(), []
        for chunk in chunks:
            splitter.load(chunk)
            while (frame := splitter.next_frame()) is not None:
                out.append(bytes(frame))
            assert splitter.used_up()
        assert out == payloads and not splitter.has_partial_frame()
    whole = FrameSplitter()
    whole.load(stream)
    assert isinstance(whole.next_frame(), memoryview)


def test_the_splitter_refuses_an_oversized_frame_once_its_header_is_in():
    limits = Limits(max_frame_bytes=1000)
    header = struct.pack(">Q", 1001)
    splitter = FrameSplitter(limits)
    splitter.load(header[:3])  # a header cut in two: nothing to judge yet
    assert splitter.next_frame() is None and splitter.has_partial_frame()
    splitter.load(header[3:] + b"x" * 10)
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        splitter.next_frame()
    at_once = FrameSplitter(limits)
    at_once.load(header)
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        at_once.next_frame()

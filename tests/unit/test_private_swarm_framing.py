"""Private swarms: every frame carries a MAC under the swarm key; keys load with clear errors."""

from __future__ import annotations

import asyncio

import pytest
import torch

from node.p2p.swarm_key import SwarmKeyError, generate_swarm_key, key_fingerprint, load_swarm_key
from protocol import Message, MessageKind, ProtocolError, recv_message, send_message


class _Pipe:
    """A writer whose bytes feed a StreamReader: one in-memory stream."""

    def __init__(self) -> None:
        self.reader = asyncio.StreamReader()

    def write(self, data: bytes) -> None:
        self.reader.feed_data(bytes(data))

    async def drain(self) -> None:
        return None


def _message() -> Message:
    return Message(
        MessageKind.FORWARD,
        "s",
        0,
        7,
        {"microbatch_id": 1, "origin": "o", "path": ["o"], "order": [1], "hop": 1},
        {"hidden": torch.ones(1, 2, 4)},
    )


async def _roundtrip(send_key: bytes | None, recv_key: bytes | None, tamper: bool = False) -> Message:
    pipe = _Pipe()
    await send_message(pipe, _message(), "none", swarm_key=send_key)  # type: ignore[arg-type]
    if tamper:
        data = bytearray(pipe.reader._buffer)  # flip one payload bit
        data[20] ^= 1
        pipe.reader._buffer.clear()
        pipe.reader._buffer.extend(data)
    pipe.reader.feed_eof()
    return await recv_message(pipe.reader, swarm_key=recv_key)


def test_same_key_passes_and_every_other_combination_is_refused_before_decoding():
    key, other = b"k" * 32, b"o" * 32
    got = asyncio.run(_roundtrip(key, key))
    assert got.meta["microbatch_id"] == 1 and torch.equal(got.tensors["hidden"], torch.ones(1, 2, 4))
    for send_key, recv_key in ((other, key), (None, key)):
        with pytest.raises(ProtocolError, match=r"authentication|MAC"):
            asyncio.run(_roundtrip(send_key, recv_key))
    with pytest.raises(ProtocolError, match="authentication"):
        asyncio.run(_roundtrip(key, key, tamper=True))
    with pytest.raises(ProtocolError):  # a keyed sender to an open node: 32 trailing bytes break the frame
        asyncio.run(_roundtrip(key, None))


def test_keygen_writes_a_private_file_and_load_validates(tmp_path, monkeypatch):
    path = tmp_path / "swarm.key"
    key = generate_swarm_key(path)
    assert load_swarm_key(path) == key and (path.stat().st_mode & 0o777) == 0o600
    with pytest.raises(SwarmKeyError, match="exists"):
        generate_swarm_key(path)
    monkeypatch.setenv("PIPESWARM_SWARM_KEY_FILE", str(path))
    assert load_swarm_key() == key
    monkeypatch.delenv("PIPESWARM_SWARM_KEY_FILE")
    assert load_swarm_key() is None
    (tmp_path / "bad").write_text("not hex")
    with pytest.raises(SwarmKeyError, match="hex"):
        load_swarm_key(tmp_path / "bad")
    (tmp_path / "short").write_text("ab" * 8)
    with pytest.raises(SwarmKeyError, match="8 bytes"):
        load_swarm_key(tmp_path / "short")
    with pytest.raises(SwarmKeyError, match="cannot read"):
        load_swarm_key(tmp_path / "missing")
    assert key_fingerprint(key) != key_fingerprint(b"x" * 32) and key_fingerprint(None) == "open"
    assert key.hex() not in key_fingerprint(key)

"""node/model/shards.py: the manifest of a prepared directory (round trip, bounds, refusals),
reassembly into a directory load_prepared accepts; node/server/data_fetch.py's fetcher against
in-process fake holders (a corrupt one avoided, the shard fetched from another);
node/server/data_service.py's handler answering manifest and shard requests."""

from __future__ import annotations

import asyncio
import hashlib
import random
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from node.model.corpus import load_prepared, prepare_corpus
from node.model.shards import (
    MANIFEST_FORMAT,
    MAX_MANIFEST_BYTES,
    MAX_SHARDS,
    MIN_SHARD_BYTES,
    DataFile,
    Manifest,
    ManifestError,
    Shard,
    ShardDirectory,
    ShardError,
    build_manifest,
    load_cached,
    manifest_hash,
)
from node.p2p.transport import TransportError
from node.server.data_fetch import DataUnavailable, FetchPolicy, fetch_data
from node.server.data_service import CONTRACT, DataStore, serve_data
from protocol import Message, MessageKind, ProtocolError

pytest.importorskip("tokenizers")

WORDS = "the swarm trains a model while peers come and go every stage keeps its weights".split()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """~12 KB of train tokens, vocab 300: with 4 KiB shards, several train pieces."""
    root = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    (root / "corpus.txt").write_text("".join(" ".join(rng.choice(WORDS, 8)) + "\n" for _ in range(400)))
    prepare_corpus([root / "corpus.txt"], root / "prepared", 300, 0.1, progress=False)
    return root / "prepared"


@pytest.fixture(scope="module")
def manifest(prepared: Path) -> Manifest:
    return build_manifest(prepared, MIN_SHARD_BYTES)


def entries(manifest: Manifest) -> list[list]:
    return [[s.file.value, s.index, s.size, s.sha256] for s in manifest.shards]


def encode(shard_bytes: int, rows: list, fmt: str = MANIFEST_FORMAT) -> bytes:
    return msgpack.packb([fmt, shard_bytes, rows], use_bin_type=True)


# ------------------------------------------------------------------------------------------------
# The manifest


def test_manifest_round_trip_and_hash(prepared: Path, manifest: Manifest):
    files = [s.file for s in manifest.shards]
    assert files == sorted(files, key=list(DataFile).index)  # tokenizer, meta, val, train
    assert sum(s.file is DataFile.TRAIN for s in manifest.shards) >= 2
    for file in DataFile:
        assert manifest.file_size(file) == (prepared / file.value).stat().st_size
    encoded = manifest.encode()
    assert Manifest.decode(encoded) == manifest
    assert manifest.hash == hashlib.sha256(encoded).hexdigest() == manifest_hash(encoded)
    assert build_manifest(prepared, MIN_SHARD_BYTES).hash == manifest.hash  # deterministic
    assert build_manifest(prepared, 2 * MIN_SHARD_BYTES).hash != manifest.hash  # the size is part of it
    # a token file's pieces end at token boundaries: every full piece is whole tokens
    assert all(s.size % 4 == 0 for s in manifest.shards if s.file is DataFile.TRAIN and s.size == MIN_SHARD_BYTES)


def test_reassembled_shards_are_a_prepared_directory(prepared: Path, manifest: Manifest, tmp_path: Path):
    directory = ShardDirectory(tmp_path, manifest)
    assert directory.missing() == list(manifest.shards)
    for shard in reversed(manifest.shards):  # any order
        with open(prepared / shard.file.value, "rb") as f:
            f.seek(shard.offset)
            directory.write(shard, f.read(shard.size))
    done = directory.complete()
    assert done.directory == tmp_path / manifest.hash
    for file in DataFile:
        assert (done.directory / file.value).read_bytes() == (prepared / file.value).read_bytes()
    assert load_prepared(done.directory).tokenizer_hash == load_prepared(prepared).tokenizer_hash
    cached = load_cached(done.directory, manifest.hash)
    assert cached is not None and cached[0] == manifest
    assert load_cached(done.directory, "0" * 64) is None
    (done.directory / "train.bin").write_bytes(b"\0\0")  # damaged: not used
    assert load_cached(done.directory, manifest.hash) is None


def test_an_interrupted_download_keeps_its_good_pieces(prepared: Path, manifest: Manifest, tmp_path: Path):
    first = ShardDirectory(tmp_path, manifest)
    shard = manifest.shards[0]
    first.write(shard, (prepared / shard.file.value).read_bytes()[: shard.size])
    first.close()
    again = ShardDirectory(tmp_path, manifest)
    assert again.path == first.path and again.missing() == list(manifest.shards[1:])
    again.close()


def test_a_wrong_shard_is_refused(manifest: Manifest, prepared: Path, tmp_path: Path):
    directory = ShardDirectory(tmp_path, manifest)
    shard = manifest.shards[-1]
    good = (prepared / shard.file.value).read_bytes()[shard.offset : shard.offset + shard.size]
    with pytest.raises(ShardError, match="sha256"):
        directory.write(shard, bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(ShardError, match="bytes"):
        directory.write(shard, good + b"x")
    directory.close()


def too_many_entries(m: Manifest) -> bytes:
    """A header claiming more entries than any manifest may hold: refused before any is read."""
    header = b"\x93" + msgpack.packb(MANIFEST_FORMAT) + msgpack.packb(m.shard_bytes)
    return header + b"\xdd" + (MAX_SHARDS + 1).to_bytes(4, "big")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: b"\x93" + b"\xc1", "malformed"),  # msgpack's reserved byte
        (lambda m: msgpack.packb({"format": MANIFEST_FORMAT}), "malformed|not a"),
        (lambda m: encode(m.shard_bytes, entries(m), "other/1"), "not a"),
        (lambda m: encode(3, entries(m)), "shard size"),
        (lambda m: encode(1 << 30, entries(m)), "shard size"),
        (lambda m: encode(m.shard_bytes, []), "1..65536"),
        (lambda m: encode(m.shard_bytes, [["../../etc/passwd", 0, 1, b"x" * 32], *entries(m)]), "unknown file"),
        (lambda m: encode(m.shard_bytes, [[e[0], e[1], m.shard_bytes + 1, e[3]] for e in entries(m)]), "size"),
        (lambda m: encode(m.shard_bytes, [[e[0], e[1], e[2], e[3][:16]] for e in entries(m)]), "32 bytes"),
        (lambda m: encode(m.shard_bytes, [e for e in entries(m) if e[0] != "meta.json"]), "no meta.json"),
        (lambda m: encode(m.shard_bytes, entries(m)[::-1]), "in order"),
        (lambda m: encode(m.shard_bytes, [e for e in entries(m) if (e[0], e[1]) != ("train.bin", 1)]), "in order"),
        (lambda m: encode(m.shard_bytes, [*entries(m), entries(m)[-1]]), "in order"),
        (lambda m: b"\0" * (MAX_MANIFEST_BYTES + 1), "bytes >"),
        (too_many_entries, "malformed"),
    ],
)
def test_malformed_or_oversized_manifests_are_refused(manifest: Manifest, mutate, message: str):
    with pytest.raises(ManifestError, match=message):
        Manifest.decode(mutate(manifest))


def test_a_non_canonical_encoding_is_refused(manifest: Manifest):
    raw = msgpack.packb([MANIFEST_FORMAT, manifest.shard_bytes, entries(manifest)], use_bin_type=False)
    with pytest.raises(ManifestError):  # shas as str, not bin: another encoding, another hash
        Manifest.decode(raw)


# ------------------------------------------------------------------------------------------------
# The fetcher, against in-process holders


class FakeHolders:
    """Holders by peer id: 'good' serves the files, 'corrupt' flips a byte of every shard, 'liar'
    sends another manifest, 'gone' is unreachable. Counts what each was asked."""

    def __init__(self, prepared: Path, manifest: Manifest, other: Manifest) -> None:
        self.files = {file: (prepared / file.value).read_bytes() for file in DataFile}
        self.honest, self.other = manifest, other
        self.asked: dict[str, int] = {}

    async def manifest(self, peer_id: str) -> bytes:
        await asyncio.sleep(0)
        if peer_id.startswith("gone"):
            raise TransportError(f"cannot open data stream to {peer_id}")
        return (self.other if peer_id.startswith("liar") else self.honest).encode()

    async def shard(self, peer_id: str, shard: Shard) -> bytes:
        await asyncio.sleep(0)
        self.asked[peer_id] = self.asked.get(peer_id, 0) + 1
        if peer_id.startswith("gone"):
            raise TransportError(f"cannot open data stream to {peer_id}")
        data = self.files[shard.file][shard.offset : shard.offset + shard.size]
        return bytes([data[0] ^ 0xFF]) + data[1:] if peer_id.startswith("corrupt") else data


def run_fetch(prepared, manifest, holders: list[str], root: Path, give_up_after: float = 5.0):
    other = build_manifest(prepared, 2 * MIN_SHARD_BYTES)
    fake = FakeHolders(prepared, manifest, other)
    policy = FetchPolicy(parallel=3, give_up_after=give_up_after, pause=0.01)

    async def go():
        return await fetch_data(fake, manifest.hash, lambda: holders, root, policy=policy, rng=random.Random(0))

    return fake, asyncio.run(asyncio.wait_for(go(), 30))


def test_a_corrupt_holder_is_avoided_and_its_shards_come_from_another(prepared, manifest, tmp_path, caplog):
    fake, store = run_fetch(prepared, manifest, ["corrupt-1", "liar-1", "good-1"], tmp_path)
    assert store.directory == tmp_path / manifest.hash and store.manifest == manifest
    for file in DataFile:
        assert (store.directory / file.value).read_bytes() == (prepared / file.value).read_bytes()
    # avoided after its first wrong shard (3 in flight at most); every shard came from the others
    assert 1 <= fake.asked["corrupt-1"] <= 3
    assert fake.asked.get("good-1", 0) + fake.asked.get("liar-1", 0) == len(manifest.shards)
    assert "sent a wrong shard" in caplog.text
    # a second fetch finds the completed download: nobody is asked
    fake, again = run_fetch(prepared, manifest, ["good-1"], tmp_path)
    assert again.directory == store.directory and fake.asked == {}


def test_without_an_honest_holder_the_fetch_gives_up_in_one_error(prepared, manifest, tmp_path):
    with pytest.raises(DataUnavailable, match="no peer served the swarm's data for 0 s") as refused:
        run_fetch(prepared, manifest, ["corrupt-1", "gone-1"], tmp_path, give_up_after=0.2)
    assert "sent a wrong shard" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(DataUnavailable, match="none known"):
        run_fetch(prepared, manifest, [], tmp_path, give_up_after=0.2)


# ------------------------------------------------------------------------------------------------
# The service's handler


class FakeTransport:
    def __init__(self) -> None:
        self.handler = None

    async def serve_requests(self, service, handler, contract, read_timeout=30.0) -> None:
        self.handler = handler

    def message(self, kind, meta=None, tensors=None, request_id=None) -> Message:
        return Message(kind, "s", -1, request_id or 0, meta or {}, tensors or {})

    def error(self, reason: str, request_id: int = 0) -> Message:
        return self.message(MessageKind.ERROR, {"reason": reason}, request_id=request_id)


def test_the_service_answers_manifest_and_shards_and_refuses_the_rest(prepared, manifest):
    transport = FakeTransport()
    asyncio.run(serve_data(transport, DataStore(prepared, manifest)))  # type: ignore[arg-type]

    def ask(**meta) -> Message:
        request = Message(MessageKind.DATA_REQUEST, "s", 0, 7, meta)
        CONTRACT.check(request)
        return asyncio.run(transport.handler("peer", request))  # type: ignore[misc]

    reply = ask(manifest=manifest.hash)
    assert reply.kind == MessageKind.DATA_REPLY and reply.tensors["data"].numpy().tobytes() == manifest.encode()
    shard = manifest.shards[-1]
    data = ask(manifest=manifest.hash, shard=shard.digest).tensors["data"]
    assert data.dtype == torch.uint8 and hashlib.sha256(data.numpy().tobytes()).digest() == shard.sha256
    assert ask(manifest="0" * 64).kind == MessageKind.ERROR
    assert ask(manifest=manifest.hash, shard="0" * 64).kind == MessageKind.ERROR
    for bad in ({"manifest": "x"}, {"manifest": manifest.hash, "shard": 5}, {}):
        with pytest.raises(ProtocolError):
            CONTRACT.check(Message(MessageKind.DATA_REQUEST, "s", 0, 7, bad))


# ------------------------------------------------------------------------------------------------
# A stage-0 peer that cannot get the data refuses in one line


class FakeMe:
    stage, peer_id = 0, "me"


class FakeView:
    def online(self, stage: int, exclude: str | None = None) -> list:
        return []


def test_a_stage0_peer_that_cannot_fetch_the_data_refuses_to_join(monkeypatch, tmp_path):
    from node.config import SwarmConfig
    from node.server import data_fetch
    from node.server.daemon import JoinRefused

    closed = []

    class Closing(FakeTransport):
        async def close(self) -> None:
            closed.append(True)

    async def unavailable(*args, **kwargs):
        raise DataUnavailable("no peer served the swarm's data for 60 s (none known)")

    monkeypatch.setattr(data_fetch, "data_transport", lambda *args, **kwargs: Closing())
    monkeypatch.setattr(data_fetch, "fetch_data", unavailable)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = SwarmConfig().replace(data={"tokenizer_hash": "0123456789abcdef", "manifest_hash": "ab" * 32})

    async def join() -> None:
        async with data_fetch.stage0_data(None, config.swarm_id, config.data, FakeView(), FakeMe(), None):  # type: ignore[arg-type]
            raise AssertionError("trained without data")

    with pytest.raises(JoinRefused, match="stage 0 has no --data and cannot fetch the swarm's: no peer") as refused:
        asyncio.run(join())
    assert "\n" not in str(refused.value) and closed == [True]
    # a swarm without a manifest, or another stage: the peer's own --data, nothing served or fetched
    plain = SwarmConfig()

    async def plain_join() -> str | None:
        async with data_fetch.stage0_data(None, plain.swarm_id, plain.data, FakeView(), FakeMe(), "dir") as path:  # type: ignore[arg-type]
            return path

    assert asyncio.run(plain_join()) == "dir"

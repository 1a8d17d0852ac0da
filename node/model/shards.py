"""A prepared directory as a list of shards a stage-0 peer can fetch from others (no networking).

A swarm founded with `node bootstrap --data DIR` records `data.manifest_hash`: the sha256 of the
*manifest* of DIR, a canonical msgpack list

    ["pipeswarm-shards/1", shard_bytes, [[file, index, size, sha256], ...]]

where every file of the directory (tokenizer.json, meta.json, val.bin, train.bin, in that order)
is cut into pieces of shard_bytes (the last one of a file shorter; an empty val.bin has none).
shard_bytes is a multiple of 4, so a piece of a token file always ends at a token boundary
(uint16 or uint32). The founder's signature on the config covers the manifest hash, the manifest
covers every shard's sha256: a joiner that checks both trusts no serving peer.

A manifest from the network is bounded before anything is allocated for it: its encoded size,
the number of shards, each size (a piece is shard_bytes but the last of its file) and the file
names (a fixed set: nothing can name a path). Reassembly writes each verified piece at its offset
in a `.partial` directory and renames it once every piece is there (`ShardDirectory`).

Hashing and file I/O here are synchronous: callers on the event loop run them in a thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import msgpack

from node.model.corpus import META_FILE, TOKENIZER_FILE, TRAIN_FILE, VAL_FILE, PreparedData, load_prepared

MANIFEST_FORMAT = "pipeswarm-shards/1"
MiB = 1 << 20
DEFAULT_SHARD_BYTES = 4 * MiB
MIN_SHARD_BYTES = 4 * 1024  # small pieces only make sense in tests; a multiple of every token size
MAX_SHARD_BYTES = 16 * MiB  # one reply: far under protocol/limits.py's frame limit
MAX_SHARDS = 1 << 16  # 256 GiB of 4 MiB pieces
# an entry is ~55 bytes packed ([str, int, int, bin32]): MAX_SHARDS of them fit with room
MAX_MANIFEST_BYTES = 8 * MiB
MANIFEST_FILE = "manifest.msgpack"  # kept beside a downloaded directory: what it serves to others
HASH_HEX = 64


class DataFile(StrEnum):
    """The files of a prepared directory, in manifest order: the small ones first."""

    TOKENIZER = TOKENIZER_FILE
    META = META_FILE
    VAL = VAL_FILE
    TRAIN = TRAIN_FILE


_FILE_ORDER = {file: position for position, file in enumerate(DataFile)}
_REQUIRED = frozenset({DataFile.TOKENIZER, DataFile.META, DataFile.TRAIN})  # val.bin may be empty


class ManifestError(ValueError):
    """A manifest that is malformed, out of bounds, or not the one the swarm records."""


class ShardError(ValueError):
    """A shard whose bytes are not what the manifest says (size or sha256)."""


def is_hash_hex(text: Any) -> bool:
    """Whether `text` is a full sha256 in lowercase hex (how manifest and shard hashes are named)."""
    return type(text) is str and len(text) == HASH_HEX and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class Shard:
    """One piece of one file: bytes [offset, offset + size) of `file`."""

    file: DataFile
    index: int
    offset: int
    size: int
    sha256: bytes

    @property
    def name(self) -> str:
        return f"{self.file.value}.{self.index:06d}"

    @property
    def digest(self) -> str:
        return self.sha256.hex()

    def check(self, data: bytes | memoryview) -> None:
        """ShardError unless `data` is this shard's bytes (size first: no hashing of a wrong size)."""
        if len(data) != self.size:
            raise ShardError(f"shard {self.name}: {len(data)} bytes, the manifest says {self.size}")
        if hashlib.sha256(data).digest() != self.sha256:
            raise ShardError(f"shard {self.name}: its sha256 is not the manifest's")


@dataclass(frozen=True)
class Manifest:
    shard_bytes: int
    shards: tuple[Shard, ...]

    def encode(self) -> bytes:
        """The canonical msgpack encoding its hash is taken of."""
        entries = [[shard.file.value, shard.index, shard.size, shard.sha256] for shard in self.shards]
        return msgpack.packb([MANIFEST_FORMAT, self.shard_bytes, entries], use_bin_type=True)

    @property
    def hash(self) -> str:
        return manifest_hash(self.encode())

    @property
    def total_bytes(self) -> int:
        return sum(shard.size for shard in self.shards)

    def file_size(self, file: DataFile) -> int:
        return sum(shard.size for shard in self.shards if shard.file is file)

    def by_digest(self) -> dict[str, Shard]:
        """Shards by sha256 hex (identical pieces share one entry: either one's bytes serve both)."""
        return {shard.digest: shard for shard in self.shards}

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> Manifest:
        """A manifest from the network, refused (ManifestError) unless it is well-formed, within
        bounds and canonical; sizes and count are checked before any list of shards is built."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {len(data)} bytes > {MAX_MANIFEST_BYTES}")
        try:
            raw = msgpack.unpackb(
                data,
                raw=False,
                use_list=True,
                strict_map_key=True,
                max_str_len=64,
                max_bin_len=32,
                max_array_len=MAX_SHARDS,
                max_map_len=0,
                max_ext_len=0,
            )
        except (msgpack.UnpackException, ValueError, TypeError, OverflowError, RecursionError) as e:
            raise ManifestError(f"malformed manifest: {e}") from None
        if not (isinstance(raw, list) and len(raw) == 3 and raw[0] == MANIFEST_FORMAT):
            raise ManifestError(f"not a {MANIFEST_FORMAT} manifest")
        shard_bytes, entries = raw[1], raw[2]
        check_shard_bytes(shard_bytes, ManifestError)
        if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_SHARDS:
            raise ManifestError(f"a manifest lists 1..{MAX_SHARDS} shards")
        manifest = cls(shard_bytes, tuple(_shards_of(entries, shard_bytes)))
        if manifest.encode() != bytes(data):  # one manifest, one encoding, one hash
            raise ManifestError("manifest is not in canonical form")
        return manifest


def check_shard_bytes(value: Any, error: type[Exception] = ValueError) -> int:
    if type(value) is not int or not MIN_SHARD_BYTES <= value <= MAX_SHARD_BYTES or value % 4:
        raise error(f"shard size must be a multiple of 4 in {MIN_SHARD_BYTES}..{MAX_SHARD_BYTES} bytes, not {value!r}")
    return value


def _shards_of(entries: list[Any], shard_bytes: int) -> Iterator[Shard]:
    """Each entry checked against the one before it: files in order, indices from 0 without a gap,
    every piece full but the last of its file."""
    previous: Shard | None = None
    seen: set[DataFile] = set()
    for position, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 4):
            raise ManifestError(f"shard {position}: not [file, index, size, sha256]")
        name, index, size, digest = entry
        try:
            file = DataFile(name)
        except ValueError:
            raise ManifestError(f"shard {position}: unknown file {name!r:.40}") from None
        if type(index) is not int or type(size) is not int or not 1 <= size <= shard_bytes:
            raise ManifestError(f"shard {position}: index and size must be ints, size in 1..{shard_bytes}")
        if type(digest) is not bytes or len(digest) != 32:
            raise ManifestError(f"shard {position}: sha256 must be 32 bytes")
        same_file = previous is not None and previous.file is file
        if same_file:
            if index != previous.index + 1 or previous.size != shard_bytes:  # type: ignore[union-attr]
                raise ManifestError(f"shard {position}: {file} pieces must be full and numbered in order")
        elif index != 0 or file in seen or (previous is not None and _FILE_ORDER[file] < _FILE_ORDER[previous.file]):
            raise ManifestError(f"shard {position}: files must come once each, in order, from piece 0")
        seen.add(file)
        previous = Shard(file, index, index * shard_bytes, size, digest)
        yield previous
    missing = _REQUIRED - seen
    if missing:
        raise ManifestError(f"the manifest has no {', '.join(sorted(missing))}")


def manifest_hash(encoded: bytes | bytearray | memoryview) -> str:
    """The hash the swarm config records (data.manifest_hash): sha256 hex of the encoded manifest."""
    return hashlib.sha256(encoded).hexdigest()


def build_manifest(directory: str | Path, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Manifest:
    """The manifest of a prepared directory (checked by load_prepared first); reads every byte."""
    check_shard_bytes(shard_bytes)
    prepared = load_prepared(directory)
    shards = []
    for file in DataFile:
        with open(prepared.directory / file.value, "rb") as f:
            for index in range(MAX_SHARDS + 1):
                piece = f.read(shard_bytes)
                if not piece:
                    break
                shards.append(Shard(file, index, index * shard_bytes, len(piece), hashlib.sha256(piece).digest()))
    if len(shards) > MAX_SHARDS:
        raise ManifestError(f"{directory} needs more than {MAX_SHARDS} shards of {shard_bytes} bytes: use larger ones")
    return Manifest(shard_bytes, tuple(shards))


def read_shard(directory: Path, shard: Shard) -> bytes:
    """A shard's bytes from a prepared directory, checked against the manifest (a disk that went bad
    is not served to others)."""
    with open(directory / shard.file.value, "rb") as f:
        f.seek(shard.offset)
        data = f.read(shard.size)
    shard.check(data)
    return data


# ------------------------------------------------------------------------------------------------
# The cache of downloaded data


def data_cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """`$XDG_CACHE_HOME/pipeswarm/data`, or `~/.cache/pipeswarm/data` (a relative XDG_CACHE_HOME
    is ignored, as the XDG rule says). Downloads are cache: deleting them costs a new download."""
    base = environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".cache"
    return root / "pipeswarm" / "data"


def load_cached(directory: Path, expected_hash: str) -> tuple[Manifest, PreparedData] | None:
    """A completed download of the manifest `expected_hash`: its manifest and prepared data, or None
    when there is none (or it is damaged: sizes, tokenizer or manifest no longer agree)."""
    try:
        encoded = (directory / MANIFEST_FILE).read_bytes()
        if manifest_hash(encoded) != expected_hash:
            return None
        manifest = Manifest.decode(encoded)
        prepared = load_prepared(directory)
    except (OSError, ValueError):
        return None
    for file in DataFile:
        if (directory / file.value).stat().st_size != manifest.file_size(file):
            return None
    return manifest, prepared


class ShardDirectory:
    """A download in progress: `<root>/<hash>.partial`, locked by this process (another process of
    this machine fetching the same data takes a directory of its own), each file of its final size
    from the start, every verified piece written at its offset. Pieces already there from an
    interrupted download are kept if they still hash right (`missing`)."""

    def __init__(self, root: Path, manifest: Manifest) -> None:
        self.manifest = manifest
        self.final = root / manifest.hash
        root.mkdir(parents=True, exist_ok=True)
        self._lock = open(root / f"{manifest.hash}.lock", "a+b")  # held (locked) until close
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.path = root / f"{manifest.hash}.partial"
        except BlockingIOError:
            self.path = root / f"{manifest.hash}.partial-{os.getpid()}"
        free = shutil.disk_usage(root).free
        if manifest.total_bytes > free:
            self.close()
            raise OSError(f"{manifest.total_bytes:,} bytes of data do not fit in {root} ({free:,} bytes free)")
        self.resumed = self.path.is_dir()  # pieces of an interrupted download may be there
        self.path.mkdir(exist_ok=True)
        for file in DataFile:
            with open(self.path / file.value, "ab") as f:
                f.truncate(manifest.file_size(file))

    def missing(self) -> list[Shard]:
        """The shards not yet on disk with their manifest's hash (hashes what is there)."""
        if not self.resumed:
            return list(self.manifest.shards)
        missing = []
        for shard in self.manifest.shards:
            try:
                read_shard(self.path, shard)
            except ShardError:
                missing.append(shard)
        return missing

    def write(self, shard: Shard, data: bytes) -> None:
        shard.check(data)
        with open(self.path / shard.file.value, "r+b") as f:
            f.seek(shard.offset)
            f.write(data)

    def complete(self) -> PreparedData:
        """Check the whole directory, move it to `<root>/<hash>` and return it (a directory another
        process completed first is used as it is)."""
        (self.path / MANIFEST_FILE).write_bytes(self.manifest.encode())
        prepared = load_prepared(self.path)  # what a peer given --data would check
        try:
            os.rename(self.path, self.final)
        except OSError:  # someone else's complete copy is there already
            if load_cached(self.final, self.manifest.hash) is None:
                raise
            shutil.rmtree(self.path, ignore_errors=True)
        self.close()
        return load_prepared(self.final) if self.final.is_dir() else prepared

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._lock.close()

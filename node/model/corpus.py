"""`node prepare-data`: text files -> a byte-level BPE tokenizer and nanoGPT-style token files.

A prepared directory holds

    tokenizer.json   the tokenizer (Hugging Face `tokenizers` format), trained here on the train part
    train.bin        flat token ids, little-endian, no header (nanoGPT's format)
    val.bin          the held-out part, same format (empty when --val-fraction is 0)
    meta.json        what a reader needs: format, dtype (uint16, or uint32 above 65,536 tokens),
                     vocab size, token counts and the tokenizer's hash

The held-out part is the tail of every input file (cut at a line end), so several files all
contribute to validation. Each file's train and val parts end with the end-of-text token (id 0).
The tokenizer hash (tokenizer_hash) is what the swarm config records as data.tokenizer_hash: token
id 1234 means the same string on every stage-0 peer only if all of them use one tokenizer.

`tokenizers` is imported only while preparing: peers that merely read a prepared directory (and
the monitor) do not need it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from node.runtime.byte_progress import ByteProgress

FORMAT = "pipeswarm-tokens/1"
META_FILE = "meta.json"
TRAIN_FILE = "train.bin"
VAL_FILE = "val.bin"
TOKENIZER_FILE = "tokenizer.json"
END_OF_TEXT = "<|endoftext|>"  # GPT-2's separator; id 0 (the first special token)
MIN_VOCAB = 257  # 256 byte tokens + end-of-text: byte-level BPE cannot go lower
MAX_VOCAB = 1 << 24  # well past any LLaMA-style vocabulary; bounds the trainer's memory
BLOCK_BYTES = 1 << 20  # text read, trained on and encoded this much at a time (cut at a line end)
DEFAULT_VAL_FRACTION = 0.05
MAX_VAL_FRACTION = 0.5


class TokenDtype(StrEnum):
    """How token ids are stored: nanoGPT's uint16 while every id fits, uint32 beyond."""

    UINT16 = "uint16"
    UINT32 = "uint32"

    @property
    def numpy(self) -> np.dtype:
        return np.dtype("<u2") if self is TokenDtype.UINT16 else np.dtype("<u4")

    @classmethod
    def for_vocab(cls, vocab_size: int) -> TokenDtype:
        return cls.UINT16 if vocab_size <= 1 << 16 else cls.UINT32


class PreparedDataError(ValueError):
    """Input that cannot be prepared, or a directory that is not (or no longer) prepared data."""


def tokenizer_hash(path: str | Path) -> str:
    """16 hex digits of sha256 over the tokenizer's JSON in canonical form (sorted keys, no
    whitespace): a copy re-saved with other formatting keeps its hash, any change to the
    vocabulary, merges or normalisation changes it."""
    try:
        content = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PreparedDataError(f"cannot read tokenizer {path}: {e}") from None
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PreparedData:
    """A prepared directory, as its meta.json describes it (checked against the files)."""

    directory: Path
    vocab_size: int
    dtype: TokenDtype
    tokenizer_hash: str
    train_tokens: int
    val_tokens: int

    @property
    def train_path(self) -> Path:
        return self.directory / TRAIN_FILE

    @property
    def val_path(self) -> Path:
        return self.directory / VAL_FILE

    @property
    def tokenizer_path(self) -> Path:
        return self.directory / TOKENIZER_FILE


def _field(meta: dict[str, Any], name: str, kind: type, where: Path) -> Any:
    value = meta.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise PreparedDataError(f"{where}: field {name!r} missing or not a {kind.__name__}")
    return value


def load_prepared(directory: str | Path) -> PreparedData:
    """Read and check a prepared directory: meta.json parses, the tokenizer still has the hash it
    was prepared with, and each .bin file holds exactly the tokens meta.json counts."""
    directory = Path(directory)
    meta_path = directory / META_FILE
    if not meta_path.is_file():
        raise PreparedDataError(f"{directory} holds no {META_FILE}: not a directory written by `node prepare-data`")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PreparedDataError(f"cannot read {meta_path}: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PreparedDataError(f"{meta_path}: not in format {FORMAT}")
    try:
        dtype = TokenDtype(meta.get("dtype"))
    except ValueError:
        raise PreparedDataError(f"{meta_path}: dtype {meta.get('dtype')!r} is not uint16 or uint32") from None
    prepared = PreparedData(
        directory=directory,
        vocab_size=_field(meta, "vocab_size", int, meta_path),
        dtype=dtype,
        tokenizer_hash=_field(meta, "tokenizer_hash", str, meta_path),
        train_tokens=_field(meta, "train_tokens", int, meta_path),
        val_tokens=_field(meta, "val_tokens", int, meta_path),
    )
    if not MIN_VOCAB <= prepared.vocab_size <= MAX_VOCAB or TokenDtype.for_vocab(prepared.vocab_size) != dtype:
        raise PreparedDataError(f"{meta_path}: vocab_size {prepared.vocab_size} does not fit dtype {dtype}")
    actual_hash = tokenizer_hash(prepared.tokenizer_path)
    if actual_hash != prepared.tokenizer_hash:
        raise PreparedDataError(
            f"{prepared.tokenizer_path} has hash {actual_hash}, but the tokens were made with {prepared.tokenizer_hash}"
        )
    for path, count in ((prepared.train_path, prepared.train_tokens), (prepared.val_path, prepared.val_tokens)):
        size = path.stat().st_size if path.is_file() else -1
        if size != count * dtype.numpy.itemsize:
            raise PreparedDataError(f"{path}: expected {count} {dtype} tokens, found {max(size, 0)} bytes")
    return prepared


# ------------------------------------------------------------------------------------------------
# Reading the text


@dataclass(frozen=True)
class _Split:
    """One input file: bytes [0, cut) train, [cut, size) held out."""

    path: Path
    size: int
    cut: int


def _is_continuation(byte: int) -> bool:
    return (byte & 0xC0) == 0x80  # 10xxxxxx: inside a multi-byte UTF-8 sequence


def _split_file(path: Path, val_fraction: float) -> _Split:
    size = path.stat().st_size
    cut = size - int(size * val_fraction)
    if cut < size:  # move the cut to just after the next line end, so no line is split
        with open(path, "rb") as f:
            f.seek(cut)
            window = f.read(BLOCK_BYTES)
        newline = window.find(b"\n")
        if newline >= 0:
            cut += newline + 1
        else:  # one very long line: at least do not cut a character
            skip = 0
            while skip < len(window) and _is_continuation(window[skip]):
                skip += 1
            cut += skip
    return _Split(path, size, min(cut, size))


def _text_blocks(path: Path, start: int, end: int, on_bytes: Callable[[int], None]) -> Iterator[str]:
    """The text of bytes [start, end) in blocks of about BLOCK_BYTES, each cut after a line end
    (or, in a line longer than a block, at a character boundary). Raises PreparedDataError on
    bytes that are not UTF-8."""
    with open(path, "rb") as f:
        f.seek(start)
        position, carry = start, b""
        while position < end:
            chunk = f.read(min(BLOCK_BYTES, end - position))
            if not chunk:
                raise PreparedDataError(f"{path} shrank while it was being read")
            data_start = position - len(carry)
            position += len(chunk)
            data = carry + chunk
            carry = b""
            if position < end:  # keep the unfinished last line (or character) for the next block
                keep = data.rfind(b"\n") + 1
                if keep == 0:
                    keep = len(data) - 1
                    while keep > 0 and _is_continuation(data[keep]):
                        keep -= 1
                data, carry = data[:keep], data[keep:]
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise PreparedDataError(f"{path} is not UTF-8 text (byte {data_start + e.start})") from None
            on_bytes(len(data))
            if text:
                yield text


# ------------------------------------------------------------------------------------------------
# Preparing


def check_inputs(files: Sequence[str | Path], vocab_size: int, val_fraction: float) -> list[Path]:
    """The input files, after refusing what cannot work (one reason, as a PreparedDataError)."""
    if not files:
        raise PreparedDataError("no text files given")
    if not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise PreparedDataError(
            f"--vocab-size {vocab_size} is out of range {MIN_VOCAB}..{MAX_VOCAB:,} "
            f"(byte-level BPE starts from 256 byte tokens + end-of-text)"
        )
    if not 0.0 <= val_fraction <= MAX_VAL_FRACTION:
        raise PreparedDataError(f"--val-fraction {val_fraction} is out of range 0..{MAX_VAL_FRACTION}")
    paths = [Path(f) for f in files]
    for path in paths:
        if not path.is_file():
            raise PreparedDataError(f"{path} does not exist or is not a file")
        if path.stat().st_size == 0:
            raise PreparedDataError(f"{path} is empty")
    return paths


def prepare_corpus(
    files: Sequence[str | Path],
    out: str | Path,
    vocab_size: int,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    *,
    force: bool = False,
    progress: bool | None = None,
) -> PreparedData:
    """Train the tokenizer on the train part of `files`, encode every file into train.bin/val.bin
    and write meta.json last (a directory interrupted mid-way has none, so nobody reads it).
    `progress` None or True: a byte bar when stderr is a terminal (log lines otherwise); False: log lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    paths = check_inputs(files, vocab_size, val_fraction)
    out = Path(out)
    if (out / META_FILE).exists() and not force:
        raise PreparedDataError(f"{out} already holds prepared data (pass --force to replace it)")
    out.mkdir(parents=True, exist_ok=True)
    splits = [_split_file(path, val_fraction) for path in paths]

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is a token: nothing is unknown
        show_progress=False,
    )
    with ByteProgress(bar=progress is not False) as bytes_done:
        advance = bytes_done.advancer("training tokenizer", sum(s.cut for s in splits))
        texts = itertools.chain.from_iterable(_text_blocks(s.path, 0, s.cut, advance) for s in splits)
        tokenizer.train_from_iterator(texts, trainer=trainer)
        actual_vocab = tokenizer.get_vocab_size()
        dtype = TokenDtype.for_vocab(actual_vocab)
        end_of_text = tokenizer.token_to_id(END_OF_TEXT)
        tokenizer.save(str(out / TOKENIZER_FILE))
        advance = bytes_done.advancer("encoding", sum(s.size for s in splits))
        counts = {}
        for name, ranges in (
            (TRAIN_FILE, [(s, 0, s.cut) for s in splits]),
            (VAL_FILE, [(s, s.cut, s.size) for s in splits]),
        ):
            counts[name] = _encode_to(out / name, ranges, tokenizer, dtype, end_of_text, advance)
    prepared = PreparedData(
        directory=out,
        vocab_size=actual_vocab,
        dtype=dtype,
        tokenizer_hash=tokenizer_hash(out / TOKENIZER_FILE),
        train_tokens=counts[TRAIN_FILE],
        val_tokens=counts[VAL_FILE],
    )
    if prepared.train_tokens < 2:
        raise PreparedDataError(f"the train part holds {prepared.train_tokens} tokens: the input is too small")
    meta = {
        "format": FORMAT,
        "dtype": str(dtype),
        "vocab_size": actual_vocab,
        "requested_vocab_size": vocab_size,
        "tokenizer_hash": prepared.tokenizer_hash,
        "end_of_text_id": end_of_text,
        "train_tokens": prepared.train_tokens,
        "val_tokens": prepared.val_tokens,
        "val_fraction": val_fraction,
        "sources": [{"file": s.path.name, "bytes": s.size, "train_bytes": s.cut} for s in splits],
    }
    temporary = out / (META_FILE + ".tmp")
    temporary.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, out / META_FILE)
    return prepared


def _encode_to(
    target: Path,
    ranges: Sequence[tuple[_Split, int, int]],
    tokenizer: Any,
    dtype: TokenDtype,
    end_of_text: int,
    advance: Callable[[int], None],
) -> int:
    """Encode the byte ranges into `target` (each non-empty range followed by end-of-text); the
    number of tokens written."""
    written = 0
    temporary = target.with_suffix(target.suffix + ".tmp")
    with open(temporary, "wb") as f:
        for split, start, end in ranges:
            if start >= end:
                continue
            for text in _text_blocks(split.path, start, end, advance):
                # encode_batch spreads the lines over the tokenizer's threads
                encodings = tokenizer.encode_batch(text.splitlines(keepends=True), add_special_tokens=False)
                ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64)
                f.write(ids.astype(dtype.numpy).tobytes())
                written += len(ids)
            f.write(np.array([end_of_text], dtype=dtype.numpy).tobytes())
            written += 1
    os.replace(temporary, target)
    return written

"""node/model/corpus.py and `node prepare-data`: tokenizer, token files, the val split, refusals;
node/model/data.py reading a prepared directory only with the swarm's tokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from node.config import SwarmConfig
from node.model.corpus import (
    META_FILE,
    PreparedDataError,
    TokenDtype,
    load_prepared,
    prepare_corpus,
    tokenizer_hash,
)
from node.model.data import DataError, TokenFileSource, open_source

pytest.importorskip("tokenizers")
from tokenizers import Tokenizer

WORDS = "the swarm trains a model while peers come and go ; données 日本 naïve".split()


def write_text(path: Path, lines: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    text = "".join(" ".join(rng.choice(WORDS, size=int(rng.integers(2, 10)))) + "\n" for _ in range(lines))
    path.write_text(text, encoding="utf-8")
    return text


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str], Path]:
    root = tmp_path_factory.mktemp("corpus")
    texts = [write_text(root / "a.txt", 3000, 0), write_text(root / "b.txt", 1000, 1)]
    out = root / "prepared"
    prepare_corpus([root / "a.txt", root / "b.txt"], out, vocab_size=300, val_fraction=0.1, progress=False)
    return out, texts, root


def test_files_counts_dtype_and_split(corpus) -> None:
    out, texts, _ = corpus
    meta = json.loads((out / META_FILE).read_text())
    prepared = load_prepared(out)
    assert prepared.dtype == TokenDtype.UINT16 and meta["dtype"] == "uint16"
    assert 257 <= prepared.vocab_size <= 300
    assert prepared.tokenizer_hash == tokenizer_hash(out / "tokenizer.json") == meta["tokenizer_hash"]
    train = np.fromfile(out / "train.bin", dtype="<u2")
    val = np.fromfile(out / "val.bin", dtype="<u2")
    assert len(train) == prepared.train_tokens and len(val) == prepared.val_tokens
    assert int(train.max()) < prepared.vocab_size and int(val.max()) < prepared.vocab_size
    # each file's train and val parts end with end-of-text (id 0): two files, two of each
    assert (train == 0).sum() == 2 and (val == 0).sum() == 2 and train[-1] == 0 and val[-1] == 0
    fraction = len(val) / (len(train) + len(val))
    assert 0.07 < fraction < 0.13, fraction
    assert len(train) < sum(len(t.encode()) for t in texts) * 0.8  # BPE merged something


def test_tokens_decode_to_the_text(corpus) -> None:
    """train.bin + val.bin decode to the input files: head of each file in train, tail in val."""
    out, texts, _ = corpus
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    train = np.fromfile(out / "train.bin", dtype="<u2").tolist()
    val = np.fromfile(out / "val.bin", dtype="<u2").tolist()

    def documents(ids: list[int]) -> list[str]:
        cuts = [i for i, t in enumerate(ids) if t == 0]
        starts = [0, *(c + 1 for c in cuts[:-1])]
        return [tokenizer.decode(ids[s:c]) for s, c in zip(starts, cuts)]

    heads, tails = documents(train), documents(val)
    for text, head, tail in zip(texts, heads, tails):
        assert head + tail == text
        assert head.endswith("\n") and tail  # cut at a line end
    sample = "peers come and go ; données 日本\n"
    assert tokenizer.decode(tokenizer.encode(sample).ids) == sample


def test_open_source_needs_the_swarms_tokenizer(corpus) -> None:
    out, _, _ = corpus
    prepared = load_prepared(out)
    config = SwarmConfig().replace(
        model={"vocab_size": prepared.vocab_size}, data={"tokenizer_hash": prepared.tokenizer_hash}
    )
    source = open_source(config, str(out), stream_id=1)
    assert isinstance(source, TokenFileSource) and source.path.name == "train.bin"
    x, y = source.next_batch(4, 16)
    assert x.shape == (4, 16) and int(x.max()) < prepared.vocab_size and (x[:, 1:] == y[:, :-1]).all()

    other = config.replace(data={"tokenizer_hash": "0123456789abcdef"})
    with pytest.raises(DataError, match="prepared with tokenizer"):
        open_source(other, str(out), 1)
    with pytest.raises(DataError, match="records no tokenizer"):
        open_source(config.replace(data={"tokenizer_hash": ""}), str(out), 1)
    with pytest.raises(DataError, match="need --data DIR"):
        open_source(config, None, 1)  # the synthetic source in a swarm of prepared data
    with pytest.raises(DataError, match="only 256"):
        open_source(config.replace(model={"vocab_size": 256}), str(out), 1)


def test_changed_tokenizer_or_truncated_tokens_are_refused(corpus, tmp_path) -> None:
    out, _, _ = corpus
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    tokenizer = json.loads((copy / "tokenizer.json").read_text())
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer, indent=4))  # reformatted: same hash
    assert load_prepared(copy).tokenizer_hash == load_prepared(out).tokenizer_hash
    tokenizer["model"]["merges"] = tokenizer["model"]["merges"][:-1]
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(PreparedDataError, match="but the tokens were made with"):
        load_prepared(copy)
    shutil.copy(out / "tokenizer.json", copy / "tokenizer.json")
    with open(copy / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(PreparedDataError, match="expected"):
        load_prepared(copy)


def test_uint32_tokens_above_65536(corpus, tmp_path) -> None:
    """A vocabulary over 65,536 stores uint32 ids, and a reader takes the dtype from meta.json."""
    out, _, _ = corpus
    big = tmp_path / "big"
    big.mkdir()
    shutil.copy(out / "tokenizer.json", big / "tokenizer.json")
    vocab = 70_000
    ids = (65_600 + np.arange(1000) * 67 % 4000).astype("<u4")  # none of them fits uint16
    ids.tofile(big / "train.bin")
    (big / "val.bin").write_bytes(b"")
    meta = json.loads((out / META_FILE).read_text())
    meta.update(dtype="uint32", vocab_size=vocab, train_tokens=len(ids), val_tokens=0)
    (big / META_FILE).write_text(json.dumps(meta))
    assert TokenDtype.for_vocab(65_536) == TokenDtype.UINT16 and TokenDtype.for_vocab(65_537) == TokenDtype.UINT32
    config = SwarmConfig().replace(model={"vocab_size": vocab}, data={"tokenizer_hash": meta["tokenizer_hash"]})
    x, _ = open_source(config, str(big), 0).next_batch(8, 32)
    assert int(x.min()) >= 65_600 and int(x.max()) < vocab


@pytest.mark.parametrize(
    "case, match",
    [
        ("missing", "does not exist"),
        ("empty", "is empty"),
        ("binary", "is not UTF-8 text"),
        ("small-vocab", "out of range 257"),
        ("val-fraction", "--val-fraction"),
    ],
)
def test_bad_input_is_refused(tmp_path, case: str, match: str) -> None:
    good = tmp_path / "good.txt"
    write_text(good, 50, 2)
    files, vocab, fraction = [good], 300, 0.1
    if case == "missing":
        files = [tmp_path / "nope.txt"]
    elif case == "empty":
        (tmp_path / "empty.txt").write_bytes(b"")
        files = [good, tmp_path / "empty.txt"]
    elif case == "binary":
        (tmp_path / "bin.txt").write_bytes(b"fine text\n" * 10 + b"\xff\xfe\x00broken\n")
        files = [tmp_path / "bin.txt"]
    elif case == "small-vocab":
        vocab = 100
    else:
        fraction = 0.9
    with pytest.raises(PreparedDataError, match=match):
        prepare_corpus(files, tmp_path / "out", vocab, fraction, progress=False)
    assert not (tmp_path / "out" / META_FILE).exists()


def test_cli_refuses_in_one_line(tmp_path) -> None:
    """`node prepare-data` on a missing file: exit code 2, one log line, no traceback; then a run
    that works, and a second run into the same directory refused without --force."""
    text = tmp_path / "t.txt"
    write_text(text, 200, 3)
    run = [sys.executable, "-m", "node", "prepare-data", "--out", str(tmp_path / "out"), "--vocab-size", "280"]
    bad = subprocess.run([*run, str(tmp_path / "missing.txt")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "does not exist" in bad.stderr
    good = subprocess.run([*run, str(text)], capture_output=True, text=True, timeout=60)
    assert good.returncode == 0, good.stderr
    assert "tokenizer" in good.stdout and load_prepared(tmp_path / "out").train_tokens > 0
    again = subprocess.run([*run, str(text)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "--force" in again.stderr


def test_bootstrap_data_sets_the_tokenizer_hash_and_vocabulary(corpus, monkeypatch) -> None:
    import node.cli as cli
    from node.config import ConfigError

    out, _, _ = corpus
    prepared = load_prepared(out)
    seen: list[dict] = []

    def fake_load_config(path, **overrides):
        seen.append(overrides)
        raise ConfigError("stop before starting a node")

    monkeypatch.setattr(cli, "load_config", fake_load_config)
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    assert cli.main(["bootstrap", "--data", str(out)]) == 2
    assert seen[-1]["data.tokenizer_hash"] == prepared.tokenizer_hash
    assert seen[-1]["model.vocab_size"] == prepared.vocab_size
    assert cli.main(["bootstrap", "--data", str(out.parent)]) == 2  # not prepared: refused before the config
    assert len(seen) == 1
    with pytest.raises(ConfigError, match="16 lowercase hex"):
        SwarmConfig().replace(data={"tokenizer_hash": "not-a-hash"})

"""node/model/data.py: the synthetic Markov source's loss floor, batch layout, streams and file sources."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from node.config import SwarmConfig
from node.model.data import (
    DataError,
    SyntheticMarkovSource,
    TokenFileSource,
    TokenSource,
    open_source,
    stream_id_from_peer,
)

CFG = SwarmConfig()


def test_stationary_distribution_and_entropy_rate_match_samples() -> None:
    src = SyntheticMarkovSource(64, seed=3, branching=4)
    P = src.transition_matrix()
    assert np.allclose(P.sum(axis=1), 1.0)
    assert np.allclose(src.stationary @ P, src.stationary, atol=1e-12)
    assert (np.count_nonzero(P, axis=1) == 4).all()

    seq = src.sample(400, 500, rng=np.random.default_rng(0))
    prev, nxt = seq[:, :-1].ravel(), seq[:, 1:].ravel()
    p = P[prev, nxt]
    assert (p > 0).all(), "samples only follow edges of the chain"
    empirical = float(-np.log(p).mean())
    assert abs(empirical - src.entropy_rate()) < 0.02, (empirical, src.entropy_rate())
    assert src.loss_floor == src.entropy_rate()
    # sequences start (and so stay) in the stationary distribution
    assert np.abs(np.bincount(seq[:, 0], minlength=64) / 400 - src.stationary).sum() < 0.5
    assert np.abs(np.bincount(seq.ravel(), minlength=64) / seq.size - src.stationary).sum() < 0.05


def test_chain_is_a_function_of_seed_and_degenerate_branching() -> None:
    a, b = SyntheticMarkovSource(32, 0, 3), SyntheticMarkovSource(32, 0, 3, stream_id=9)
    assert np.array_equal(a.transition_matrix(), b.transition_matrix())
    assert not np.array_equal(a.transition_matrix(), SyntheticMarkovSource(32, 1, 3).transition_matrix())
    ring = SyntheticMarkovSource(8, 0, 1)  # a deterministic ring: periodic, floor 0
    assert ring.entropy_rate() == pytest.approx(0.0, abs=1e-12)
    assert np.allclose(ring.stationary, 1 / 8)
    full = SyntheticMarkovSource(4, 0, 99)  # branching clipped to the vocabulary
    assert full.branching == 4 and 0 < full.entropy_rate() < np.log(4)


def test_batches_layout_and_streams() -> None:
    src = open_source(CFG, None, stream_id=1)
    assert isinstance(src, TokenSource) and isinstance(src, SyntheticMarkovSource)
    x, y = src.next_batch(5, 17)
    assert x.shape == y.shape == (5, 17) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert 0 <= int(x.min()) and int(torch.cat([x, y]).max()) < CFG.model.vocab_size

    again = open_source(CFG, None, stream_id=1)
    other = open_source(CFG, None, stream_id=2)
    first = [again.next_batch(5, 17) for _ in range(2)]
    assert torch.equal(first[0][0], x) and torch.equal(first[0][1], y)
    assert not torch.equal(first[0][0], first[1][0]), "successive batches differ"
    assert not torch.equal(other.next_batch(5, 17)[0], x), "different streams differ"
    assert other.loss_floor == src.loss_floor


def test_stream_id_from_peer_is_stable() -> None:
    assert stream_id_from_peer("QmPeerA") == stream_id_from_peer(b"QmPeerA")
    assert stream_id_from_peer("QmPeerA") != stream_id_from_peer("QmPeerB")
    assert 0 <= stream_id_from_peer("QmPeerA") < 2**63


def test_text_file_source(tmp_path) -> None:
    text = "héllo wörld, the quick brown fox jumps over the lazy dog. " * 20
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    src = open_source(CFG, str(path), stream_id=4)
    assert isinstance(src, TokenFileSource) and src.loss_floor is None
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    x, y = src.next_batch(6, 32)
    assert x.shape == (6, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x.numpy(), y.numpy()):  # each row is a window of the file
        starts = [i for i in range(len(data) - 32) if np.array_equal(data[i : i + 32], row_x)]
        assert starts and any(data[s + 32] == row_y[-1] for s in starts)
    x2, _ = open_source(CFG, str(path), stream_id=4).next_batch(6, 32)
    x3, _ = open_source(CFG, str(path), stream_id=5).next_batch(6, 32)
    assert torch.equal(x, x2) and not torch.equal(x, x3)


def test_bin_file_source(tmp_path) -> None:
    config = CFG.replace(model={"vocab_size": 1000})
    tokens = (np.arange(5000) * 7 % 1000).astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    src = open_source(config, str(path), stream_id=0)
    x, y = src.next_batch(4, 64)
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, (x + 7) % 1000)
    assert int(x.max()) >= 256  # read as uint16, not bytes


def test_bin_file_out_of_vocab_is_rejected(tmp_path) -> None:
    tokens = np.zeros(3000, dtype=np.uint16)
    tokens[2345] = 300
    path = tmp_path / "bad.bin"
    tokens.tofile(path)
    with pytest.raises(DataError, match=r"token id 300 at position 2345.*vocab_size=256"):
        open_source(CFG, str(path), stream_id=0)


def test_bad_files_are_rejected(tmp_path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        open_source(CFG, str(tmp_path / "missing.txt"), stream_id=0)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        open_source(CFG, str(tmp_path / "empty.txt"), stream_id=0)
    (tmp_path / "short.txt").write_text("too short")
    with pytest.raises(DataError, match="fewer than"):
        open_source(CFG, str(tmp_path / "short.txt"), stream_id=0)
    (tmp_path / "odd.bin").write_bytes(b"\x00" * 301)
    with pytest.raises(DataError, match="whole number"):
        open_source(CFG, str(tmp_path / "odd.bin"), stream_id=0)
    ascii_model = CFG.replace(model={"vocab_size": 128})
    (tmp_path / "utf8.txt").write_text("ünïcödé " * 20, encoding="utf-8")
    with pytest.raises(DataError, match="vocab_size 256"):
        open_source(ascii_model, str(tmp_path / "utf8.txt"), stream_id=0)

"""The hop-codec benchmark on real text (tests/benchmarks/bench_hop_codec.py --data), at a toy size:
`make bench-hop-codec-text` runs it at full size. Here: a directory of the project's own prepare
machinery is what it trains and measures on (the data's vocabulary and tokenizer, its bounds), every
codec's loss is a finite number paired against fp16's, and the page renders the summary it writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from node.model.corpus import PreparedData, prepare_corpus
from node.simulate.report import render
from protocol import Compression
from protocol.subspace import anchors
from tests.benchmarks import bench_hop_codec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> PreparedData:
    """A few KB of Python (two of the project's modules, as the real run reads the stdlib's) prepared
    as `node prepare-data` does, with a val.bin long enough for held-out sequences."""
    root = tmp_path_factory.mktemp("text")
    files = [ROOT / "node" / "simulate" / name for name in ("sources.py", "hop_codec_report.py")]
    return prepare_corpus(files, root / "prepared", vocab_size=300, val_fraction=0.2, progress=False)


def test_the_benchmark_trains_every_codec_on_the_prepared_text_and_the_page_renders_it(prepared, tmp_path) -> None:
    sizes = ["--microbatches", "4", "--width", "32", "--layers", "1", "--eval-batches", "2"]
    args = bench_hop_codec.parse_args(
        ["--data", str(prepared.directory), "--variants", "fp16", "subspace8", "fp16+anchors", "--seeds", "0", *sizes]
    )
    config = bench_hop_codec.bench_config(32, 1, 0, Compression.SUBSPACE8, 4, args.data)
    assert config.model.vocab_size == prepared.vocab_size  # the tokenizer's, not the chain's 256
    assert config.data.tokenizer_hash == prepared.tokenizer_hash
    summary = bench_hop_codec.measure(args)
    corpus = summary["corpus"]
    assert (corpus["vocab_size"], corpus["train_tokens"]) == (prepared.vocab_size, prepared.train_tokens)
    assert 0 < corpus["bigram_nats"] < corpus["unigram_nats"] < math.log(prepared.vocab_size) + 1
    assert list(summary["results"]) == ["fp16", "subspace8", "fp16+anchors"]
    for r in summary["results"].values():
        (loss,) = r["losses"]
        assert math.isfinite(loss) and 0 < loss < 2 * math.log(prepared.vocab_size)
        assert (r["mean"], r["spread"]) == (loss, 0.0) and len(r["cost_percent"]) == 1
        assert "floor" not in r["runs"][0]  # the chain's floors: the text has its bounds instead
    assert summary["results"]["fp16"]["cost_percent"] == [0.0]
    assert summary["args"]["data"] == str(prepared.directory)

    results = tmp_path / "results"
    results.mkdir()
    (results / "hop_codec_real_text.json").write_text(json.dumps(summary))
    page = render(results, tmp_path / "results.md")
    assert "## Hop codecs on real text" in page and "| `subspace8` | 16.5x |" in page
    assert f"{corpus['bigram_nats']:.3f} bigram" in page
    assert "- Against `fp16+anchors`" in page  # the projection's own cost, beside the anchors' model
    assert "width 32 on real text, not at a preset's width" in page
    assert "at the 15m preset's width" not in page  # that section only once its run has been recorded

    at_15m = {**summary, "args": {**summary["args"], "width": 288}}
    (results / "hop_codec_real_text_15m.json").write_text(json.dumps(at_15m))
    page = render(results, tmp_path / "results.md")
    assert "## Hop codecs on real text at the 15m preset's width" in page
    assert "`make bench-hop-codec-text-15m`" in page and "width 288 on real text, the 15m preset's width" in page


def test_fp16_plus_anchors_adds_each_tokens_anchor_to_a_forward_hop_and_leaves_a_gradient_alone() -> None:
    variant = bench_hop_codec.VARIANTS["fp16+anchors"]
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[1, 2, 3], [3, 2, 1]], dtype=torch.int16)
    expected = x.half().float() + anchors(ids, 32).reshape(x.shape)
    assert torch.equal(bench_hop_codec.hop(x, variant, ids), expected)
    assert torch.equal(bench_hop_codec.hop(x, variant), x.half().float())
    # the projecting codec with the same anchors is a different hop: rank 2 of 32 loses most of x
    projected = bench_hop_codec.hop(x, bench_hop_codec.VARIANTS["subspace8"], ids)
    assert (projected - expected).norm() > 0.5 * x.norm()


def test_unset_sizes_are_the_chains_recorded_ones_or_the_texts() -> None:
    chain = bench_hop_codec.parse_args([])
    assert {name: getattr(chain, name) for name in bench_hop_codec.CHAIN_SIZES} == bench_hop_codec.CHAIN_SIZES
    assert chain.data is None
    text = bench_hop_codec.parse_args(["--data", "build/corpus/stdlib", "--microbatches", "7"])
    assert text.microbatches == 7 and text.eval_batches == bench_hop_codec.TEXT_SIZES["eval_batches"]
    with pytest.raises(SystemExit):
        bench_hop_codec.parse_args(["--prepare-stdlib"])  # where would the corpus go


def test_runs_in_parallel_processes_measure_what_one_process_measures() -> None:
    sizes = ["--microbatches", "3", "--width", "32", "--layers", "1", "--eval-batches", "1"]
    args = bench_hop_codec.parse_args(["--variants", "fp16", "subspace8", "--seeds", "0", "1", *sizes])
    alone = bench_hop_codec.run_all(args)
    args.processes = 2
    parallel = bench_hop_codec.run_all(args)
    assert list(parallel) == list(alone) == [("fp16", 0), ("fp16", 1), ("subspace8", 0), ("subspace8", 1)]
    assert {k: r["held_out_loss"] for k, r in parallel.items()} == {k: r["held_out_loss"] for k, r in alone.items()}

"""`make experiments QUICK=1`: the real-text experiments end to end at their short size
(node/simulate/real_text.py), and the claims over seeds (node/simulate/seeds.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from node.simulate import real_text
from node.simulate.real_text_report import _against_bigram
from node.simulate.report import render
from node.simulate.seeds import Spread, recovery_claims

RECOVERY_VARIANTS = {"no_failures", "checkfree", "checkfree_plus", "copy", "random", "zero", "checkpoint", "redundant"}


def test_quick_experiments_run_on_real_text_and_every_claim_gets_its_seeds(tmp_path) -> None:
    # two seeds in two processes (--jobs 2), then read back by this one
    out = tmp_path / "results" / "real_text"
    assert (
        real_text.main(
            [
                "--quick",
                "--out",
                str(out),
                "--corpus-dir",
                str(tmp_path / "corpus"),
                "--seeds",
                "0",
                "1",
                "--jobs",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    summary = json.loads((out / "real_text.json").read_text())
    corpus = summary["corpus"]
    assert corpus["train_tokens"] > 100_000 and corpus["val_tokens"] > 1_000
    # the text has structure a bigram sees: its bound is well below the unigram one, which is below ln V
    assert 0 < corpus["bigram_nats"] < corpus["unigram_nats"] - 0.5 < math.log(corpus["vocab_size"])
    assert set(summary["recovery"]) == RECOVERY_VARIANTS
    assert all(v["final_loss"]["seeds"] == 2 for v in summary["recovery"].values())
    assert {
        f"{mode}/{routing}"
        for mode in ("noloco", "diloco", "allreduce")
        for routing in ("random", "load_aware", "fixed")
    } == set(summary["gossip"])
    # every run trained: below ln V on held-out text, and the seeds differ (their data and model do)
    losses = [v["final_loss"] for v in summary["recovery"].values()]
    assert all(loss["high"] < math.log(corpus["vocab_size"]) for loss in losses)
    assert any(loss["high"] > loss["low"] for loss in losses)
    claims = summary["claims"]
    assert len(claims) == 13 and all(c["seeds"] in (1, 2) for c in claims[:4])
    # with --resume a second run reads the finished seeds back instead of training them again
    kept = (out / "seed0" / "recovery" / "recovery.json").stat().st_mtime_ns
    again = ["--quick", "--out", str(out), "--corpus-dir", str(tmp_path / "corpus"), "--seeds", "0", "1"]
    assert real_text.main([*again, "--no-progress", "--resume"]) == 0
    assert (out / "seed0" / "recovery" / "recovery.json").stat().st_mtime_ns == kept
    assert json.loads((out / "real_text.json").read_text())["claims"] == claims
    page = render(tmp_path / "results", tmp_path / "results.md")
    assert "## Real text: the claims over seeds" in page and page.count("| final perplexity:") == 4
    assert "token embedding initialised at std 1," in page and "learning rate 0.01," in page
    assert summary["device"] == "cpu" and "Real text on a GPU" not in page
    # a GPU run's summary (real_text_cuda/, `make experiments DEVICE=cuda`) renders as a section of its own
    on_gpu = tmp_path / "results" / "real_text_cuda"
    on_gpu.mkdir()
    gpu_summary = {**summary, "device": "cuda", "scale": {**summary["scale"], "model": "125m"}}
    (on_gpu / "real_text.json").write_text(json.dumps(gpu_summary))
    page = render(tmp_path / "results", tmp_path / "results.md")
    assert "## Real text on a GPU: the claims over seeds" in page and "the 125m preset's shape" in page
    assert "## Real text: the claims over seeds" in page and "on one GPU (cuda)" in page


@pytest.mark.parametrize("device", ["cuda", "abacus"])
def test_an_unusable_device_is_refused_in_one_line_before_the_corpus_is_prepared(device, tmp_path, capsys) -> None:
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: cuda is usable")
    corpus, out = tmp_path / "corpus", tmp_path / "out"
    assert real_text.main(["--device", device, "--corpus-dir", str(corpus), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"real_text: --device {device}: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not list(tmp_path.iterdir())  # no corpus prepared, no results written


def test_the_gpu_scale_is_the_125m_models_shape_and_writes_apart_from_the_cpu_figures() -> None:
    from node.model.presets import PRESETS, PresetName, width_scaled_lr

    preset = PRESETS[PresetName.MOBILELLM_125M]
    gpu = real_text.GPU
    assert (gpu.hidden, gpu.learning_rate, gpu.sequence) == (preset.hidden_size, width_scaled_lr(576), 256)
    recovery = real_text.model_values(gpu, gpu.recovery_stages)
    assert recovery == {"heads": 9, "kv_heads": 3, "intermediate": 1536, "layers_per_stage": 6}
    assert real_text.model_values(gpu, 3)["layers_per_stage"] == 15  # the outer steps' 2 block stages
    assert real_text.model_values(real_text.FULL, 5) == {}  # the CPU scales keep the simulator's small model
    # a CPU seed finished before the GPU fields existed is still recognised by --resume
    assert "model" not in real_text.scale_record(real_text.FULL)


def recovery_summary(checkfree: float, copy: float, seconds: tuple[float | None, float | None]) -> dict:
    variant = {"seconds_to_target": None, "iterations_to_target": None}
    return {
        "variants": {
            "checkfree": {**variant, "final_loss": checkfree},
            "copy": {**variant, "final_loss": copy},
            "checkfree_plus": {**variant, "final_loss": checkfree, "seconds_to_target": seconds[0]},
            "checkpoint": {**variant, "final_loss": copy, "seconds_to_target": seconds[1]},
        }
    }


def test_a_claim_holds_only_on_the_seeds_where_its_ordering_does() -> None:
    summaries = [recovery_summary(2.0, 2.5, (100.0, 160.0)), recovery_summary(2.6, 2.5, (100.0, None))]
    checks = recovery_claims(summaries)
    against_copy = next(c for c in checks if "below copying a neighbour" in c.claim)
    assert (against_copy.holding, against_copy.seeds, against_copy.holds) == (1, 2, False)
    faster = next(c for c in checks if "faster than checkpointing" in c.claim)
    # a checkpoint run that never reached the target is slower; the ratio is over the seeds where both did
    assert (faster.holding, faster.seeds, faster.holds) == (2, 2, True)
    assert "1.60" in faster.measured and "never reached the target on 1" in faster.measured


@pytest.mark.parametrize("values, expected", [([1.0, 3.0], (2.0, 1.0, 3.0, 2)), ([None, math.inf], None)])
def test_a_spread_is_the_mean_and_range_of_the_finite_values(values, expected) -> None:
    spread = Spread.of(values)
    assert (spread and (spread.mean, spread.low, spread.high, spread.seeds)) == expected


def test_the_page_says_how_many_variants_needed_their_blocks() -> None:
    def summary(losses: list[float]) -> dict:
        runs = {f"v{i}": {"final_loss": {"mean": loss, "low": loss - 0.01}} for i, loss in enumerate(losses)}
        return {"corpus": {"bigram_nats": 3.0}, "recovery": runs, "gossip": {"none": {}}}

    assert (
        "Every run here ended above the bigram bound (lowest final loss 3.090"
        in _against_bigram(summary([3.1, 3.2]))[0]
    )
    assert _against_bigram(summary([2.9, 3.1, 2.95]))[0].startswith("2 of 3 variants end below the bigram bound")

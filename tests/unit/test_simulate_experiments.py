"""The experiments of `node simulate` at their tiny preset: outputs exist, robust orderings hold.

Asserted only what holds by construction of the charged costs or at every size tried; the loss
orderings of the recovery strategies move with the seed at this size and are reported in
docs/results.md (the default preset), not asserted here.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import pytest
import torch

from node.cli import main
from node.simulate import experiments, gossip, recovery, swarm, sync_scaling
from node.simulate.experiments import run_experiment
from node.simulate.names import ExperimentName, FailingStages, SimPreset
from node.simulate.recovery import RecoveryVariant
from node.simulate.report import record_commit, render
from node.stage.stage_worker import StageWorker

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sync_scaling_noloco_beats_a_tree_allreduce_from_64_replicas(tmp_path):
    summary = run_experiment(ExperimentName.SYNC_SCALING, tmp_path, SimPreset.TINY, progress=False)
    assert (tmp_path / "sync_scaling.csv").exists() and (tmp_path / "sync_scaling.json").exists()
    assert (tmp_path / "sync_scaling.png").exists()
    rows = {row["replicas"]: row for row in summary["rows"]}
    assert sorted(rows) == [2**k for k in range(1, 11)]
    for n, row in rows.items():
        if n >= 64:
            assert row["noloco_seconds"] < row["tree_seconds"], n
    # the NoLoCo paper's ~10x at ~1000 replicas (payload-bound: 2 log2 N hops vs one exchange of two)
    assert 8.0 < rows[1024]["tree_over_noloco"] < 12.0
    assert rows[1024]["ring_seconds"] > rows[1024]["noloco_seconds"]  # 2046 latencies
    # docs/results.md is rendered from the summaries; missing experiments are named, not invented
    page = render(tmp_path, tmp_path / "results.md")
    assert f"{rows[1024]['tree_over_noloco']:.1f}x (reproduced)" in page
    assert "Not run: no recovery.json" in page and "Not run: no gossip.json" in page


def test_recovery_outputs_and_charged_costs(tmp_path):
    variants = (
        RecoveryVariant.NO_FAILURES,
        RecoveryVariant.CHECKFREE,
        RecoveryVariant.CHECKPOINT,
        RecoveryVariant.REDUNDANT,
    )
    summary = run_experiment(ExperimentName.RECOVERY, tmp_path, SimPreset.TINY, {"variants": variants}, progress=False)
    for name in ("recovery.csv", "recovery.json", "recovery_loss_vs_iteration.png", "recovery_loss_vs_sim_seconds.png"):
        assert (tmp_path / name).exists(), name
    assert json.loads((tmp_path / "recovery.json").read_text())["variants"].keys() == {v.value for v in variants}
    failures = len(summary["schedule"])
    assert failures >= 2  # the tiny preset's seeded schedule: the run exercises repeated rebuilds
    v = summary["variants"]
    assert v["no_failures"]["failures"] == 0
    for name in ("checkfree", "checkpoint", "redundant"):
        assert v[name]["failures"] == failures, name
        assert v[name]["sim_seconds"] > v["no_failures"]["sim_seconds"], name  # detection at least
    # checkpointing pays rollbacks and restarts: it loses wall-clock to CheckFree at this failure rate
    assert v["checkpoint"]["lost_iterations"] > 0
    assert v["checkpoint"]["sim_seconds"] > v["checkfree"]["sim_seconds"]
    # the redundant forward costs every iteration; CheckFree only pays at failures
    assert v["redundant"]["sim_seconds"] > v["checkfree"]["sim_seconds"]


def test_edge_stage_failures_are_rebuilt_by_checkfree_plus_and_refused_by_checkfree(tmp_path):
    variants = (RecoveryVariant.CHECKFREE, RecoveryVariant.CHECKFREE_PLUS, RecoveryVariant.COPY)
    overrides = {"variants": variants, "failing": FailingStages.BLOCKS}
    summary = run_experiment(ExperimentName.RECOVERY, tmp_path, SimPreset.TINY, overrides, progress=False)
    stages = {stage for _, stage in summary["schedule"]}
    assert stages & {1, 3}, summary["schedule"]  # the tiny preset's block stages 1..3: an edge one fails
    assert stages <= {1, 2, 3}  # stage 0 (data, head) never fails
    # plain CheckFree has no rebuild for an edge block stage: not run, and the summary says why
    assert set(summary["variants"]) == {"checkfree_plus", "copy"}
    assert "CheckFree+" in summary["skipped"]["checkfree"]
    for name in ("checkfree_plus", "copy"):
        assert summary["variants"][name]["failures"] == len(summary["schedule"]), name
    page = render(tmp_path, tmp_path / "results.md")
    assert "| checkfree | not run: stage" in page
    # the middle-stage schedule of the same preset never refuses a variant
    middle = run_experiment(ExperimentName.RECOVERY, tmp_path / "middle", SimPreset.TINY, {"variants": variants})
    assert middle["skipped"] == {} and {stage for _, stage in middle["schedule"]} == {2}


def test_gossip_outputs_and_averaging_every_step_keeps_replicas_together(tmp_path):
    summary = run_experiment(ExperimentName.GOSSIP, tmp_path, SimPreset.TINY, progress=False)
    for name in ("gossip.csv", "gossip.json", "gossip_eval_loss.png", "gossip_divergence.png"):
        assert (tmp_path / name).exists(), name
    v = summary["variants"]
    routings = ("random", "shuffled", "load_aware")
    assert set(v) == {f"{m}/{r}" for m in ("noloco", "diloco", "allreduce") for r in routings}
    for routing in routings:
        assert v[f"allreduce/{routing}"]["final_divergence"] < 1e-5
        assert v[f"noloco/{routing}"]["final_divergence"] > v[f"allreduce/{routing}"]["final_divergence"]
        # a ring all-reduce every step costs more time than a NoLoCo round every H steps
        assert v[f"allreduce/{routing}"]["sync_seconds"] > v[f"noloco/{routing}"]["sync_seconds"] > 0


def test_cli_runs_an_experiment_and_says_when_plots_are_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sync_scaling, "have_matplotlib", lambda: False)
    monkeypatch.setattr(experiments, "have_matplotlib", lambda: False)
    argv = ["simulate", "sync-scaling", "--out", str(tmp_path), "--no-progress", "--max-replicas", "64"]
    assert main([*argv, "--latency-ms", "10", "--model-preset", "15m"]) == 0
    summary = json.loads((tmp_path / "sync_scaling.json").read_text())
    assert summary["largest"]["replicas"] == 64 and summary["model_preset"] == "15m"
    assert summary["link"].startswith("10 ms")
    assert not list(tmp_path.glob("*.png"))
    assert "plots skipped" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, reason",
    [
        (["--embedding-init-std", "0"], "embedding_init_std must be in (0, 10]"),
        (["--hidden", "30"], "hidden_size must be divisible by num_attention_heads"),
        (["--stages", "3"], "needs a middle stage"),
    ],
)
def test_cli_refuses_settings_out_of_range_in_one_line(tmp_path, caplog, capsys, flags, reason):
    argv = ["simulate", "recovery", "--preset", "tiny", "--out", str(tmp_path), "--no-progress", *flags]
    with caplog.at_level(logging.ERROR):
        assert main(argv) == 2
    refusals = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(refusals) == 1 and refusals[0].startswith("cannot simulate: ") and reason in refusals[0]
    assert "Traceback" not in capsys.readouterr().err


def test_the_device_reaches_every_stage_worker_the_experiments_build(tmp_path, monkeypatch):
    """`node simulate --device` (SimSettings.device) is handed to every simulated swarm a run builds,
    the outer steps' and recovery's alike, and by each swarm to every StageWorker. Spies read the
    arguments given (a default counts as not given): without a GPU, where a tensor lives cannot
    tell a forgotten device from the default CPU (tests/unit/test_device_paths.py runs a simulated
    swarm on the GPU where there is one)."""
    swarms: list[object] = []
    workers: list[object] = []
    not_given = "not given"

    class SpiedSwarm(swarm.SimulatedSwarm):
        def __init__(self, *args, **kwargs) -> None:
            given = inspect.signature(swarm.SimulatedSwarm).bind(*args, **kwargs).arguments
            swarms.append(given.get("device", not_given))
            super().__init__(*args, **kwargs)

    def spied_worker(config, stage, device=not_given, **kwargs):
        workers.append(device)
        return StageWorker(config, stage, "cpu", **kwargs)

    monkeypatch.setattr(gossip, "SimulatedSwarm", SpiedSwarm)
    monkeypatch.setattr(recovery, "SimulatedSwarm", SpiedSwarm)
    monkeypatch.setattr(swarm, "StageWorker", spied_worker)
    out = tmp_path / "gossip"
    argv = ["simulate", "gossip", "--preset", "tiny", "--steps", "2", "--device", "cpu", "--no-progress"]
    assert main([*argv, "--out", str(out)]) == 0
    assert json.loads((out / "gossip.json").read_text())["settings"]["device"] == "cpu"
    by_gossip = len(swarms)
    overrides = {"device": "cpu", "variants": (RecoveryVariant.CHECKFREE,)}
    summary = run_experiment(ExperimentName.RECOVERY, tmp_path / "recovery", SimPreset.TINY, overrides, progress=False)
    assert summary["variants"]["checkfree"]["failures"] > 0  # rebuilt stages kept their workers' device
    assert by_gossip > 0 and len(swarms) > by_gossip and set(swarms) == {"cpu"}
    assert len(workers) >= 6 * len(swarms) and set(workers) == {"cpu"}  # 3 stages x 2 replicas at the least


@pytest.mark.parametrize("device", ["cuda", "abacus"])
def test_an_unusable_device_is_refused_in_one_line_before_anything_runs(device, tmp_path, caplog, capsys):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("torch sees a GPU here: cuda is usable")
    out = tmp_path / "out"
    with caplog.at_level(logging.ERROR, logger="node"):
        assert main(["simulate", "gossip", "--device", device, "--out", str(out)]) == 2
    [message] = [record.getMessage() for record in caplog.records]
    assert message.startswith(f"cannot simulate: --device {device}: ") and "\n" not in message
    assert "Traceback" not in capsys.readouterr().err and not out.exists()


def test_docs_results_md_is_what_its_summaries_render():
    """docs/results.md is generated (`make results`, `make experiments`): edited by hand or left
    behind by a change to the report, it fails here; regenerate it with
    `python -m node.simulate.report docs/results docs/results.md`."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    assert (docs / "results.md").read_text() == render(docs / "results", docs / "results.md")


def test_each_summary_names_the_commit_it_was_measured_at(tmp_path):
    """`make results` records HEAD for the summaries it wrote (docs/results/commits.json), and the
    page names it: a figure names its command and its commit."""
    record_commit(tmp_path, ["gossip", "edges/recovery"])
    record_commit(tmp_path, ["gossip"])
    commits = json.loads((tmp_path / "commits.json").read_text())
    assert set(commits) == {"gossip", "edges/recovery"} and len(commits["gossip"]) == 7
    assert f"Measured: edges/recovery at {commits['gossip']}, gossip at {commits['gossip']}" in render(
        tmp_path, tmp_path / "results.md"
    )

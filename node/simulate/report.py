"""docs/results.md from the JSON summaries `node simulate` wrote: `make results` runs the default
presets into docs/results/ and then `python -m node.simulate.report docs/results docs/results.md`.

Every figure comes from the summaries; the papers' claims (docs/algorithms.md, "What the authors
report") stand beside them, and each comparison says whether this run reproduces the claim's
direction. The notes on why a small run can differ are fixed text about the setting, not results.
Which commit each summary was measured at is docs/results/commits.json, which the make targets
write after a run (`python -m node.simulate.report --record docs/results NAME...`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from node.simulate.hop_codec_report import HOP_CODEC_TEXT, HOP_CODEC_TEXT_15M, hop_codec_section, hop_codec_text_section
from node.simulate.real_text_report import REAL_TEXT, REAL_TEXT_CUDA, real_text_section
from node.simulate.recovery import TARGET_FRACTION
from node.simulate.seeds import verdict

EDGES = "edges"  # the subdirectory `make results` writes the recovery run with edge-stage failures into
COMMITS = "commits"  # commits.json: summary name -> the commit it was measured at


def _load(directory: Path, name: str) -> dict[str, Any] | None:
    path = directory / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "not reached"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.0f} s"


def _image(directory: Path, docs: Path, name: str) -> str:
    path = directory / name
    return f"![{name}]({path.relative_to(docs.parent)})" if path.exists() else f"({name}: plots skipped)"


def sync_section(s: dict[str, Any], directory: Path, docs: Path) -> list[str]:
    big = s["largest"]
    lines = [
        "## sync-scaling: one NoLoCo round vs all-reduce",
        "",
        f"Payload: the whole `{s['model_preset']}` preset, {s['parameters'] / 1e6:.0f}M parameters in fp32 "
        f"({s['payload_bytes'] / 1e6:.0f} MB); link {s['link']}. Formulas: node/simulate/collectives.py.",
        "",
        "| N | NoLoCo round (s) | tree all-reduce (s) | ring all-reduce (s) | tree / NoLoCo | ring / NoLoCo |",
        "|---|---|---|---|---|---|",
    ]
    for row in s["rows"]:
        lines.append(
            f"| {row['replicas']} | {row['noloco_seconds']:.1f} | {row['tree_seconds']:.1f} | {row['ring_seconds']:.1f} "
            f"| {row['tree_over_noloco']:.1f} | {row['ring_over_noloco']:.1f} |"
        )
    ratio = big["tree_over_noloco"]
    lines += [
        "",
        _image(directory, docs, "sync_scaling.png"),
        "",
        f"Paper (NoLoCo): about 10x faster than a tree all-reduce at ~1000 replicas. Here, N = {big['replicas']}: "
        f"{ratio:.1f}x ({verdict(ratio >= 5)}). The ratio is 2 log2(N) hops of one payload against one "
        "exchange of two (phi and Delta): it is 10 at N = 1024 whenever bandwidth dominates, and larger when "
        "latency does (small payloads). A ring all-reduce moves about as many bytes as one NoLoCo round, "
        "but pays 2 (N - 1) latencies, so it loses only once N x latency outweighs the payload time.",
        "",
    ]
    return lines + live_sync_lines(_load(directory, "sync_scaling_live"))


def live_sync_lines(live: dict[str, Any] | None) -> list[str]:
    """The N <= 8 points measured by the live gossip code (tests/benchmarks/bench_gossip_round.py)."""
    if live is None:
        return ["Not measured: no sync_scaling_live.json (tests/benchmarks/bench_gossip_round.py writes it).", ""]
    rows = live["rows"]
    lines = [
        "### Measured live on loopback, N <= 8",
        "",
        f"The project's gossip code (node/averaging/) between N real peers of one stage, each with its own p2pd "
        f"and DHT node, in one process on {live['cpus']} CPUs (load {live['loadavg'][0]:.1f} at the start): a stage "
        f"of {live['payload_bytes'] / 1e6:.1f} MB fp32, every replica starts its round at the same moment. "
        "'swarm round' is until every replica has stepped, collisions included (a replica whose partners are "
        "all exchanging retries after the round loop's random pause); 'exchange' is one initiated round, "
        "request to outer step; 'solo exchange' is one replica's round while the others idle (one pair on the "
        "host). The model columns are collectives.py under the link measured between two of the "
        "peers (small-message round trip, and phi + Delta swapped both ways with the gossip's chunked stream).",
        "",
        "| N | live swarm round, median (min-max) s | live exchange, median s | solo exchange, median s "
        "| model NoLoCo s | model tree s | link measured | busy retries | lone steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['replicas']} | {row['live_seconds_median']:.2f} ({row['live_seconds_min']:.2f}-"
            f"{row['live_seconds_max']:.2f}) | {row['exchange_seconds_median']:.2f} "
            f"| {row['solo_exchange_seconds_median']:.2f} "
            f"| {row['model_noloco_seconds']:.2f} | {row['model_tree_seconds']:.2f} | {row['link']} "
            f"| {row['busy_retries']} | {row['lone_steps']} |"
        )
    first, last = rows[0], rows[-1]
    overhead = first["exchange_seconds_median"] / first["model_noloco_seconds"]
    growth = last["exchange_seconds_median"] / first["exchange_seconds_median"]
    solo_growth = last["solo_exchange_seconds_median"] / first["solo_exchange_seconds_median"]
    solo_ratios = [row["solo_exchange_seconds_median"] / row["model_noloco_seconds"] for row in rows]
    lines += [
        "",
        f"- At N = {first['replicas']} one live exchange takes {overhead:.1f}x the model's transfer time: the "
        "rest is the handshake, both partners' checks of the tensors they received and the outer step.",
        f"- From N = {first['replicas']} to N = {last['replicas']} the live exchange grows {growth:.1f}x, where the "
        "model says a NoLoCo round does not grow at all: here all N peers share one host's cores, one event loop "
        f"and its loopback, so {last['replicas'] // 2} exchanges at once each get a fraction of the machine; "
        "in a swarm of N homes each pair has its own links and CPUs. The message count per replica (one "
        "request, one swap, one DONE each way) does not depend on N, which is what the model's N-independence "
        f"rests on: with one pair on the host (solo) the exchange grows {solo_growth:.1f}x from N = "
        f"{first['replicas']} to N = {last['replicas']}, and against the model under the link measured at the "
        f"same N it stays between {min(solo_ratios):.1f}x and {max(solo_ratios):.1f}x: what grows is the idle "
        "peers' background work (DHT, heartbeats, their daemons) slowing the host's loopback, not the round.",
        "",
    ]
    return lines


def recovery_section(s: dict[str, Any], directory: Path, docs: Path) -> list[str]:
    v = s["variants"]
    settings = s["settings"]
    edges = settings.get("failing", "middle") == "blocks"
    title = "every block stage failing, edge stages too" if edges else "one failure schedule, every strategy"
    failing = "block stage (1..S)" if edges else "middle stage"
    lines = [
        f"## recovery: {title}",
        "",
        f"{settings['stages']} stages (stage 0 + {settings['stages'] - 1} block stages) x {settings['replicas']} "
        f"replicas, hidden {settings['hidden']}, {settings['steps']} iterations; clock: "
        f"{s['compute_seconds_per_microbatch_stage']:.1f} s per microbatch-stage, link {s['link']}, a "
        f"failure-free iteration {s['failure_free_iteration_seconds']:.0f} s. Failures: "
        f"{settings['failure_percent_per_hour']:g} %/h per {failing} = "
        f"{s['failure_probability_per_iteration']:.4f} per iteration, from iteration {settings['failures_from']}: "
        f"{len(s['schedule'])} failures (iteration, stage): {s['schedule']}. Checkpoint every "
        f"{settings['checkpoint_every']} iterations, save {settings['checkpoint_save_s']:g} s + bytes, restart "
        f"{settings['restart_s']:g} s. Target loss {_fmt(s['target_loss'])} (the failure-free run's best by "
        f"{TARGET_FRACTION:.0%} of its iterations).",
        "",
        "| variant | final loss | simulated hours | seconds to target | iterations to target | lost iterations |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in v.items():
        lines.append(
            f"| {name} | {r['final_loss']:.4f} | {r['sim_seconds'] / 3600:.2f} | {_fmt(r['seconds_to_target'], 0)} "
            f"| {_fmt(r['iterations_to_target'])} | {r['lost_iterations']} |"
        )
    for name, why in s.get("skipped", {}).items():
        lines.append(f"| {name} | not run: {why} | | | | |")
    lines += [
        "",
        _image(directory, docs, "recovery_loss_vs_iteration.png"),
        _image(directory, docs, "recovery_loss_vs_sim_seconds.png"),
        "",
        "Claims side by side (CheckFree paper, docs/algorithms.md):",
        "",
    ]

    def final(name: str) -> float | None:
        return v[name]["final_loss"] if name in v else None

    def seconds(name: str) -> float:
        reached = v.get(name, {}).get("seconds_to_target")
        return float("inf") if reached is None else reached

    pairs = [
        ("checkfree", "copy", "final loss: CheckFree (22.6 ppl) below copying a neighbour (29.2)"),
        ("copy", "zero", "final loss: copy (29.2) below the authors' 'random' = zero (121)"),
        ("checkfree", "zero", "final loss: CheckFree below zero"),
    ]
    for better, worse, claim in pairs:
        if final(better) is not None and final(worse) is not None:
            holds = final(better) < final(worse)
            lines.append(f"- {claim}: {final(better):.4f} vs {final(worse):.4f}, {verdict(holds)}.")
    for fast, slow, claim in (
        ("checkfree", "checkpoint", "wall-clock to target: CheckFree faster than checkpointing"),
        ("checkfree_plus", "checkpoint", "wall-clock to target: CheckFree+ up to 1.6x faster than checkpointing"),
        ("checkfree_plus", "redundant", "wall-clock to target: CheckFree+ ~12 % faster than redundant computation"),
    ):
        if fast in v and slow in v:
            a, b = seconds(fast), seconds(slow)
            ratio = (
                "n/a"
                if a == float("inf")
                else ("never reached by the slower" if b == float("inf") else f"{b / a:.2f}x")
            )
            lines.append(
                f"- {claim}: {_seconds(v[fast]['seconds_to_target'])} vs {_seconds(v[slow]['seconds_to_target'])} "
                f"({ratio}), {verdict(a < b)}."
            )
    if "zero" in v and any(final(other) > final("zero") for other in ("checkfree", "copy", "random") if other in v):
        lines.append(
            "- `zero` does not end worst here. A likely reason, not measured separately: it removes a block stage for good (an identity stage), and in this "
            "small model on a 32-token second-order chain the remaining block stages can carry the function, so a "
            "removed block costs less than the damage a rebuilt one does before it relearns; the paper's 121 "
            "perplexity comes from language models where every block is needed."
        )
    if not edges and "checkfree_plus" in v and "checkfree" in v and final("checkfree_plus") > final("checkfree"):
        lines.append(
            "- CheckFree+ ends above CheckFree here although both rebuild a middle stage the same way (the "
            "schedule fails middle stages only, the ones every strategy can rebuild): the difference is "
            "CheckFree+'s swapped stage order on odd microbatches, which costs this small model loss, as the "
            "paper's 'somewhat more iterations than a failure-free run' says. Its gain, rebuilding stage 1, "
            "stage S and stage 0, is not exercised by this schedule."
        )
    if "checkfree_plus" in v and "redundant" in v and seconds("checkfree_plus") > seconds("redundant"):
        per_iteration = len(s["schedule"]) / max(settings["steps"] - settings["failures_from"], 1)
        lines.append(
            f"- Redundant computation reaches the target before CheckFree+ here. The schedule fails a stage every "
            f"{1 / max(per_iteration, 1e-9):.0f} iterations on average, against about one in 100 in the paper's "
            "10 %/h setting with its 4-8 stages (0.002 per stage and iteration). Every failure costs CheckFree+ "
            "iterations of relearning; redundant computation pays a fixed extra forward on every block task and "
            "loses nothing at a failure, so the more often stages fail, the better its fixed price compares."
        )
    lines += [
        "",
        "Why a small run can differ: the model is a few hundred thousand parameters on a 32-token second-order "
        "chain, so a rebuilt block is relearned within tens of iterations; a fresh N(0, 0.02) block in a "
        "pre-norm residual stream is nearly the identity (docs/recovery.md), so `random` behaves like a skipped "
        "stage that relearns; the paper's 10k iterations at 5-16 %/h are compressed into a few hundred "
        "iterations at a higher rate, so failures come closer together than in the paper; the clock is charged "
        f"as a larger model's ({s['compute_seconds_per_microbatch_stage']:g} s per microbatch-stage) while the "
        "weights that learn are small. The wall-clock orderings follow from the charged costs (rollback, restart, "
        "the redundant forward); the loss orderings come from the real training of one seed.",
        "",
    ]
    return lines


def gossip_section(s: dict[str, Any], directory: Path, docs: Path) -> list[str]:
    settings = s["settings"]
    lines = [
        "## gossip: NoLoCo vs DiLoCo vs averaging every step, random, shuffled and load-aware routing",
        "",
        f"{settings['stages']} stages x {settings['replicas']} replicas, H = {settings['inner_steps']}, "
        f"{settings['steps']} iterations (equal tokens for every variant), link {s['link']}; "
        "`allreduce` = the replicas' weights averaged after every inner step (DiLoCo with H = 1, momentum 0, "
        "lr 1), charged as a ring all-reduce per step.",
        "",
        "| variant | final loss | final divergence | mean divergence | simulated s | of which sync s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in s["variants"].items():
        lines.append(
            f"| {name} | {r['final_loss']:.4f} | {r['final_divergence']:.4f} | {r['mean_divergence']:.4f} "
            f"| {r['sim_seconds']:.0f} | {r['sync_seconds']:.0f} |"
        )
    v = s["variants"]
    lines += ["", _image(directory, docs, "gossip_eval_loss.png"), _image(directory, docs, "gossip_divergence.png")]
    lines += [_image(directory, docs, "gossip_loss_vs_sim_seconds.png"), ""]
    if "noloco/shuffled" in v and "diloco/shuffled" in v:
        a, b = v["noloco/shuffled"]["final_loss"], v["diloco/shuffled"]["final_loss"]
        lines.append(
            f"- NoLoCo paper: up to 4 % faster convergence than DiLoCo. Final loss NoLoCo {a:.4f} vs DiLoCo {b:.4f}, "
            f"both routed by the authors' permutation (`shuffled`): {verdict(a <= b)} (one seed, "
            f"{settings['steps']} iterations: not a significance test)."
        )
    if all(f"noloco/{r}" in v for r in ("shuffled", "load_aware", "random")):
        shuffled, load_aware, independent = (
            v[f"noloco/{r}"]["mean_divergence"] for r in ("shuffled", "load_aware", "random")
        )
        lines.append(
            f"- Routing and replica divergence (NoLoCo): mean divergence `shuffled` (the authors' permutation per step) "
            f"{shuffled:.4f}, `load_aware` {load_aware:.4f}, `random` (independent uniform draws) {independent:.4f}. "
            "The paper's claim, that random routing mixes gradients across replicas and so lowers divergence, is "
            "against fixed pipelines, which is not run: a swarm has no fixed partners, so the project has no such "
            "routing. Here load-aware routing between equally fast, equally loaded replicas breaks its ties at "
            "random and charges each pick, so it deals a random permutation per step too: `shuffled` and "
            "`load_aware` are the same routing in this simulator"
            + (
                ", and their divergences agree within 10 %."
                if abs(shuffled - load_aware) <= 0.1 * max(shuffled, load_aware)
                else f"; their divergences still differ by more than 10 % ({shuffled:.4f} vs {load_aware:.4f})."
            )
        )
        if independent > max(shuffled, load_aware):
            lines.append(
                "  Independent draws give some replicas two microbatches in an iteration and others none; with one "
                "microbatch per inner step they take different numbers of inner steps at different learning rates, "
                "which drives them apart faster than the mixing pulls them together. A permutation gives every "
                "replica exactly one microbatch per step: equal step counts. Stage 0 never mixes (each stage-0 "
                "replica owns its data stream)."
            )
    lines.append("")
    return lines


def render(directory: Path, docs: Path) -> str:
    lines = [
        "# Results: the papers' claims, reproduced by `node simulate`",
        "",
        "Generated by `make results` (node/simulate/report.py; its real-text section from `make experiments`) "
        "from the presets of `node simulate`: "
        "S stages x R replicas in one process on a simulated clock, driving the project's own stage workers, "
        "routers, NoLoCo/DiLoCo outer steps and CheckFree rebuild plans (node/simulate/). Curves are in "
        "docs/results/*.csv, summaries in docs/results/*.json. Claims: docs/algorithms.md, "
        '"What the authors report".',
        "",
    ]
    if commits := _load(directory, COMMITS):
        measured = ", ".join(f"{name} at {commit}" for name, commit in sorted(commits.items()))
        lines += [f"Measured: {measured} (docs/results/commits.json).", ""]
    real_text = _load(directory / REAL_TEXT, REAL_TEXT)
    on_gpu = _load(directory / REAL_TEXT_CUDA, REAL_TEXT)
    codecs_on_text = _load(directory, HOP_CODEC_TEXT)
    for summary in (real_text, on_gpu):
        if summary is not None:
            lines += real_text_section(summary, directory, docs)
    if real_text or on_gpu or codecs_on_text:  # the real-text part, led by the claims if run
        lines += hop_codec_text_section(codecs_on_text)
        if (at_15m := _load(directory, HOP_CODEC_TEXT_15M)) is not None:
            lines += hop_codec_text_section(
                at_15m, "Hop codecs on real text at the 15m preset's width", "make bench-hop-codec-text-15m"
            )
        lines += [
            "The sections below are toy scale: a 32-token second-order Markov chain and models of a few "
            "hundred thousand parameters. They stay for what real text does not show here: the sync-scaling "
            "figures, edge-stage failures, the curves, and the hop codecs' bytes and loss where the floor is known.",
            "",
        ]
    sections = (
        ("sync_scaling", sync_section),
        ("recovery", recovery_section),
        ("gossip", gossip_section),
        ("hop_codec", hop_codec_section),
    )
    for name, section in sections:
        summary = _load(directory, name)
        if summary is None:
            lines += [f"## {name}", "", f"Not run: no {name}.json in {directory}.", ""]
        else:
            lines += section(summary, directory, docs)
        edges = directory / EDGES
        if name == "recovery" and (summary := _load(edges, name)) is not None:
            lines += recovery_section(summary, edges, docs)
    return "\n".join(lines)


def record_commit(directory: Path, names: list[str]) -> None:
    """Note in DIRECTORY/commits.json that the summaries NAMES were measured at the checkout's HEAD."""
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, check=True)
    path = directory / f"{COMMITS}.json"
    commits = json.loads(path.read_text()) if path.exists() else {}
    commits.update(dict.fromkeys(names, head.stdout.strip()))
    path.write_text(json.dumps(commits, indent=1, sort_keys=True) + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--record"] and len(argv) > 2:
        record_commit(Path(argv[1]), argv[2:])
        return 0
    if len(argv) != 2:
        print("usage: python -m node.simulate.report RESULTS_DIR OUTPUT.md", file=sys.stderr)
        return 2
    directory, docs = Path(argv[0]), Path(argv[1])
    docs.write_text(render(directory, docs))
    print(f"wrote {docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""docs/results.md's real-text sections: `make experiments`' claims over seeds (node/simulate/real_text.py),
each beside the paper's, with the text's own bounds and the spread over seeds. Pure: summaries in, lines out."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from node.config import ModelConfig
from node.simulate.seeds import verdict

REAL_TEXT = "real_text"  # the subdirectory `make experiments` writes real_text.json into
REAL_TEXT_CUDA = "real_text_cuda"  # and `make experiments DEVICE=cuda`, the 125m model's run on a GPU


def real_text_section(s: dict[str, Any], directory: Path, docs: Path) -> list[str]:
    """The claims on real text over seeds (node/simulate/real_text.py), each beside the paper's."""
    corpus, scale, rs = s["corpus"], s["scale"], s["recovery_settings"]
    seeds = len(s["seeds"])
    device = s.get("device", "cpu")  # summaries written before the device was recorded ran on the CPU
    on_gpu = device != "cpu"
    machine = f"one GPU ({device})" if on_gpu else "this 2-core machine"
    model = f"the {scale['model']} preset's shape, " if scale.get("model") else ""
    lines = [
        f"## Real text{' on a GPU' if on_gpu else ''}: the claims over seeds",
        "",
        f"`make experiments{f' DEVICE={device}' if on_gpu else ''}` (node/simulate/real_text.py): {corpus['source']}, prepared at vocabulary "
        f"{corpus['vocab_size']:,} ({corpus['train_tokens']:,} train, {corpus['val_tokens']:,} held-out tokens). "
        f"Model: {model}hidden {scale['hidden']}, {scale['sequence']}-token sequences, learning rate "
        f"{scale['learning_rate']:g}, token embedding initialised at std {scale.get('embedding_init_std', ModelConfig.embedding_init_std):g}, "
        f"{rs['stages']} stages "
        f"(stage 0 + {rs['stages'] - 1} block stages) x {rs['replicas']} replicas for recovery "
        f"({scale['recovery_steps']} iterations, failures from {scale['failures_from']} at "
        f"{rs['failure_percent_per_hour']:g} %/h per middle stage, per seed: {', '.join(str(n) for n in s['failures'].values())}), "
        f"{s['gossip_settings']['replicas']} replicas x {s['gossip_settings']['stages']} stages for the outer "
        f"steps ({scale['gossip_steps']} iterations, H = {s['gossip_settings']['inner_steps']}). Seeds "
        f"{s['seeds']}, {s['seconds'] / 60:.0f} minutes of runs on {machine} (the seeds may run in parallel processes). Losses are held-out nats on val.bin, "
        "mean (lowest-highest) over the seeds.",
        "",
        f"The text's own bounds: {corpus['unigram_nats']:.3f} nats for a model that ignores its input "
        f"(unigram), {corpus['bigram_nats']:.3f} for stage 0 without blocks (bigram: it sees only the "
        "current token); a run below the bigram bound is using its blocks.",
        "",
        *([] if on_gpu else [_WHY_THIS_SIZE, ""]),
        *_against_bigram(s),
        "| recovery variant | final loss | perplexity | seconds to target | iterations to target |",
        "|---|---|---|---|---|",
    ]
    for name, r in s["recovery"].items():
        loss = r.get("final_loss")
        lines.append(
            f"| {name} | {_spread(loss)} | {_ppl(loss)} | {_spread(r.get('seconds_to_target'), 0)} "
            f"| {_spread(r.get('iterations_to_target'), 0)} |"
        )
    lines += ["", "| outer step / routing | final loss | mean divergence |", "|---|---|---|"]
    for name, r in s["gossip"].items():
        lines.append(f"| {name} | {_spread(r.get('final_loss'))} | {_spread(r.get('mean_divergence'), 4)} |")
    lines += _routing_divergence(s["gossip"])
    lines += ["", "| the paper's claim | measured here | seeds where it holds | verdict |", "|---|---|---|---|"]
    for c in s["claims"]:
        lines.append(f"| {c['claim']} | {c['measured']} | {c['holding']} of {c['seeds']} | {verdict(c['holds'])} |")
    lines += [
        "",
        f"A claim is reproduced when its ordering holds on every one of the {seeds} seeds. Wall-clock figures come "
        "from the simulated clock (charged costs of a larger model), losses from real training of the small one. "
        "NoLoCo's other claim, synchronisation about 10x faster than a tree all-reduce at ~1000 replicas, is about "
        "the network, not the text: the sync-scaling section below measures it.",
        "",
    ]
    return lines


def _routing_divergence(gossip: dict[str, Any]) -> list[str]:
    """NoLoCo's replica divergence per routing, and why independent random draws drive replicas apart."""
    routings = ("fixed", "load_aware", "random")
    spreads = [gossip.get(f"noloco/{r}", {}).get("mean_divergence") for r in routings]
    if any(spread is None for spread in spreads):
        return []
    fixed, load_aware, independent = (spread["mean"] for spread in spreads)
    lines = [
        "",
        f"NoLoCo's mean replica divergence: fixed pipelines {fixed:.4f}, load-aware routing {load_aware:.4f}, "
        f"random routing {independent:.4f}.",
    ]
    if independent > max(fixed, load_aware):
        lines[-1] += (
            " Random routing's independent draws give some replicas two microbatches in an iteration and others "
            "none; at one microbatch an inner step they take different numbers of inner steps, which drives them "
            "apart (the toy section's outer-step paragraph measures the same)."
        )
    return lines


# why the CPU runs train a model smaller than any real preset
_WHY_THIS_SIZE = (
    "Why this size and not the 15m preset: 17 runs a seed x 3 seeds must fit in about an hour of 2 CPU cores, and "
    'a 15m microbatch of 8 x 256 tokens takes stage 0 alone about 1.8 s here (docs/benchmarks.md, "The wire at '
    'real size"), some 25 times a whole iteration of this model (2 replicas x 5 stages, about 0.07 s). '
    "`make experiments DEVICE=cuda` trains the 125m preset's model on a GPU."
)


def _against_bigram(s: dict[str, Any]) -> list[str]:
    """How many variants' mean final loss is below the bigram bound, i.e. needed their block stages."""
    bound = s["corpus"]["bigram_nats"]
    runs = [r for r in [*s["recovery"].values(), *s["gossip"].values()] if "final_loss" in r]
    if not runs:
        return []
    below = sum(r["final_loss"]["mean"] < bound for r in runs)
    if below == 0:
        return [
            f"Every run here ended above the bigram bound (lowest final loss "
            f"{min(r['final_loss']['low'] for r in runs):.3f} against {bound:.3f}): at this budget the block "
            "stages have not become necessary yet, so whatever a failure does to a block stage costs little, "
            "and the strategies' losses differ by little.",
            "",
        ]
    return [
        f"{below} of {len(runs)} variants end below the bigram bound on average over the seeds: their block "
        "stages carry part of the loss, so what a failure does to a block stage shows in it.",
        "",
    ]


def _spread(value: dict[str, Any] | None, digits: int = 3) -> str:
    if value is None:
        return "not reached"
    return f"{value['mean']:.{digits}f} ({value['low']:.{digits}f}-{value['high']:.{digits}f})"


def _ppl(value: dict[str, Any] | None) -> str:
    return "" if value is None else f"{math.exp(value['mean']):.1f}"

"""docs/results.md's hop-codec tables (node/simulate/report.py renders the page): the loss at equal
tokens of each hop codec against fp16, on the chain (`make bench-hop-codec`, hop_codec.json) and on
real text (`make bench-hop-codec-text`, hop_codec_real_text.json), both written by
tests/benchmarks/bench_hop_codec.py in one shape, the real-text one with its corpus beside."""

from __future__ import annotations

from pathlib import Path
from statistics import fmean
from typing import Any

from node.model.presets import PresetName, preset_named

HOP_CODEC_TEXT = "hop_codec_real_text"  # the summary bench_hop_codec.py --data writes
HOP_CODEC_TEXT_15M = "hop_codec_real_text_15m"  # the same at the 15m preset's width (make bench-hop-codec-text-15m)
ANCHORS_WITHOUT_PROJECTION = "fp16+anchors"  # bench_hop_codec.py's variant: the anchors' model, lossless hops
TARGET_PERCENT = 2.0  # the wire issue's claim: the default codec costs <= 2 % of fp16's loss
CLAIM = (
    "Claim (issue: the wire at real size): the default codec, `subspace8` with token anchors, costs "
    "<= 2 % of loss at >= 16x fewer bytes than fp16."
)


def _met(holds: bool) -> str:
    return "met" if holds else "**not met**"


def _costs(r: dict[str, Any]) -> str:
    """A variant's cost against fp16: the mean of the paired per-seed costs, then each seed's."""
    costs = r["cost_percent"]
    return f"{fmean(costs):+.2f} % ({', '.join(f'{c:+.2f}' for c in costs)})"


def _runs(a: dict[str, Any], data: str) -> str:
    return (
        f"width {a['width']}, {a['layers']} layers a block stage, {a['microbatches']} microbatches on {data}, "
        f"held-out loss over {a['eval_batches']} batches, seeds {', '.join(map(str, a['seeds']))}"
    )


def _default_codec(s: dict[str, Any], where: str) -> list[str]:
    """The lines on the claim: the default codec's mean and worst seed against the 2 % target, and,
    where the run has it, its cost beside fp16 hops that add the same anchors: the projection's own."""
    results = s["results"]
    default = results.get("subspace8")
    if default is None:
        return []
    mean_cost, worst = fmean(default["cost_percent"]), max(default["cost_percent"])
    lines = [
        "",
        f"- Default codec: mean cost {mean_cost:+.2f} % (the 2 % target {_met(mean_cost <= TARGET_PERCENT)} on the "
        f"mean), worst seed {worst:+.2f} % ({_met(worst <= TARGET_PERCENT)} on every seed); measured at width "
        f"{s['args']['width']} {where}, {_preset_width(s['args']['width'])}.",
    ]
    beside = results.get(ANCHORS_WITHOUT_PROJECTION)
    if beside is not None:
        paired = [100 * (x / b - 1) for x, b in zip(default["losses"], beside["losses"], strict=True)]
        lines.append(
            f"- Against `{ANCHORS_WITHOUT_PROJECTION}` (lossless fp16 hops with the same anchors added: the "
            f"anchors' model without the projection) the default codec costs {fmean(paired):+.2f} % "
            f"({', '.join(f'{c:+.2f}' for c in paired)}): the projection's own cost. The cost against fp16 above "
            "also holds what the anchors bring, which fp16 hops do not carry."
        )
    return lines


def _preset_width(width: int) -> str:
    named = [p.value for p in PresetName if p != PresetName.TINY and preset_named(p).hidden_size == width]
    return f"the {named[0]} preset's width" if named else "not at a preset's width"


def hop_codec_section(s: dict[str, Any], directory: Path, docs: Path) -> list[str]:
    """The hop codecs' loss at equal tokens against fp16 on the order-2 Markov chain (the signature of
    report.py's sections; it draws no plots, so `directory` and `docs` go unused)."""
    lines = [
        "## Hop codecs: the loss at equal tokens",
        "",
        f"`make bench-hop-codec` (tests/benchmarks/bench_hop_codec.py, design in docs/wire.md): one pipeline of "
        f"the project's stage workers per codec, every hop through the codec's encode and decode; "
        f"{_runs(s['args'], 'the order-2 Markov source')}. {CLAIM}",
        "",
        "| codec | bytes a token a hop (15m, 125m) | fewer than fp16 at 15m | held-out loss, mean +- spread "
        "| cost vs fp16, mean (per seed) |",
        "|---|---|---|---|---|",
    ]
    for name, r in s["results"].items():
        lines.append(
            f"| `{name}` | {r['bytes_per_token']['15m']:g}, {r['bytes_per_token']['125m']:g} "
            f"| {r['fewer_bytes_than_fp16']['15m']:.1f}x | {r['mean']:.4f} +- {r['spread']:.4f} | {_costs(r)} |"
        )
    return [*lines, *_default_codec(s, "on the chain"), ""]


def hop_codec_text_section(
    s: dict[str, Any] | None, title: str = "Hop codecs on real text", command: str = "make bench-hop-codec-text"
) -> list[str]:
    """The same on real text, each loss beside the text's own bounds; `s` None: not run yet (the line
    names no directory: the page must render alike from any working directory, for its freshness test).
    `title` and `command`: the section of another run of it (the 15m preset's width)."""
    lines = [f"## {title}", ""]
    if s is None:
        return [*lines, f"Not run: no {HOP_CODEC_TEXT}.json yet (`{command}` writes it).", ""]
    corpus = s["corpus"]
    lines += [
        f"`{command}` (tests/benchmarks/bench_hop_codec.py --data): the chain's benchmark "
        f"below on {corpus['source']}, prepared at vocabulary {corpus['vocab_size']:,} "
        f"({corpus['train_tokens']:,} train, {corpus['val_tokens']:,} held-out tokens), read as a stage-0 peer "
        f"reads it (train.bin, one stream per seed; the held-out loss on val.bin); "
        f"{_runs(s['args'], 'the text')}. {CLAIM}",
        "",
        f"The text's bounds: {corpus['unigram_nats']:.3f} nats unigram, {corpus['bigram_nats']:.3f} bigram (stage 0 "
        "without blocks); a loss below the bigram bound is one the block stages, and so the hops, carry.",
        "",
        "| codec | fewer bytes than fp16 at 15m | held-out loss per seed | mean +- spread | mean - bigram bound "
        "| cost vs fp16, mean (per seed) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in s["results"].items():
        lines.append(
            f"| `{name}` | {r['fewer_bytes_than_fp16']['15m']:.1f}x | {', '.join(f'{x:.4f}' for x in r['losses'])} "
            f"| {r['mean']:.4f} +- {r['spread']:.4f} | {r['mean'] - corpus['bigram_nats']:+.3f} | {_costs(r)} |"
        )
    if min(r["mean"] for r in s["results"].values()) > corpus["bigram_nats"]:
        lines += [
            "",
            "- Every codec's mean ended above the bigram bound: at this budget the block stages are not needed "
            "yet, so what a codec does to the hops costs little, and these costs understate it.",
        ]
    return [*lines, *_default_codec(s, "on real text"), ""]

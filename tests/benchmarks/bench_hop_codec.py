"""The hop codecs' bytes and loss cost: one pipeline of StageWorkers per codec, every hop through it.

Each variant trains the same model on the same tokens (same seeds, microbatches, data streams) with
the project's StageWorkers (inner AdamW, clipping, weight stashes), and every activation and
gradient between two stages goes through `decode_tensor(encode_tensor(t, codec))`, exactly what a
hop's transport does to it. The model is one where the block stages matter: the second-order
Markov chain, whose floor is far below what the current token alone can predict (the blocks must
close that gap), at a width and depth that trains in minutes on a CPU. Prints, per codec, the bytes
a token costs on one hop (at this model's width, and at the 15m and 125m presets' widths, tensors
only) and the held-out loss per seed, its mean and spread, and its cost in % of fp16's loss;
`--json FILE` keeps every number. Not a timed test: `make bench-hop-codec` (docs/wire.md).

`--data DIR` runs the same on real text instead: a `node prepare-data` directory, read as a stage-0
peer reads it (train.bin through open_source, one stream per seed; the held-out loss on val.bin
through open_heldout), the model's vocabulary the tokenizer's, and the text's unigram and bigram
bounds beside the losses. `--prepare-stdlib` first prepares the CPython standard library into DIR
as `make experiments` does, unless DIR already holds it: `make bench-hop-codec-text`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from node.config import ModelConfig, SwarmConfig  # noqa: E402
from node.model.corpus import load_prepared  # noqa: E402
from node.model.llama import build_stage  # noqa: E402
from node.model.presets import PresetName, preset_named  # noqa: E402
from node.model.synthetic import markov_source  # noqa: E402
from node.simulate.real_text import FULL, corpus_record, prepare_stdlib, stdlib_source  # noqa: E402
from node.simulate.settings import prepared_data_values  # noqa: E402
from node.simulate.sources import held_out_source, training_source  # noqa: E402
from node.stage.stage_worker import StageWorker  # noqa: E402
from protocol import Compression, decode_tensor, encode_tensor, wire_nbytes  # noqa: E402
from protocol.subspace import anchors  # noqa: E402


@dataclass(frozen=True)
class HopVariant:
    """What a variant does to every hop: its codec; whether forward hops carry their token ids as
    anchors, as the swarm's do in a subspace codec (node/pipeline/origin.py, hop_token_ids); and
    whether the anchors are added on top of a lossless hop. That last one is no codec: it is the
    model a subspace codec's anchors turn the pipeline into (each stage's input holds a(t) at full
    rank), without the projection, so that the projection's own cost can be told from what the
    anchors bring."""

    codec: Compression
    anchored: bool = False
    adds_anchors: bool = False


# the unanchored run shows what the anchors buy, fp16+anchors what the projection costs beside them
VARIANTS = {
    "fp16": HopVariant(Compression.FP16),
    "int8": HopVariant(Compression.INT8),
    "subspace8": HopVariant(Compression.SUBSPACE8, anchored=True),
    "subspace4": HopVariant(Compression.SUBSPACE4, anchored=True),
    "subspace8-unanchored": HopVariant(Compression.SUBSPACE8),
    "fp16+anchors": HopVariant(Compression.FP16, anchored=True, adds_anchors=True),
}
HELD_OUT_STREAM = 1 << 20  # a data stream no training microbatch comes from
# the sizes a run takes unless told: on the chain, those of the recorded docs/results/hop_codec.json;
# on real text (--data, vocabulary 512), what 6 variants x 3 seeds train in about 20 minutes one at a
# time on 2 busy CPU cores (10 with --processes 2): a microbatch took 66-75 ms here (fp16-subspace8), 90 ms in the recorded chain run;
# 300 of them took fp16 to 3.77 nats against a bigram bound of 3.57 (a small slice of the stdlib),
# so 1000 should end below it, where the blocks and their hops carry the loss; 16 held-out batches
# (twice the chain's), as text is noisier
CHAIN_SIZES = {"microbatches": 800, "width": 128, "layers": 2, "eval_batches": 8}
TEXT_SIZES = {"microbatches": 1000, "width": 128, "layers": 2, "eval_batches": 16}


def bench_config(
    width: int,
    layers_per_stage: int,
    seed: int,
    codec: Compression,
    steps: int,
    data: Path | None = None,
    embedding_init_std: float = ModelConfig.embedding_init_std,
) -> SwarmConfig:
    heads = max(1, width // 32)
    sections: dict[str, dict] = {}
    if data is not None:  # real text: the tokenizer's vocabulary, and the tokenizer the readers check
        for key, value in prepared_data_values(data).items():
            section, field = key.split(".")
            sections.setdefault(section, {})[field] = value
    return SwarmConfig.from_dict(
        {
            "seed": seed,
            "data": sections.get("data", {}),
            "num_stages": 3,
            "model": {
                "hidden_size": width,
                "intermediate_size": (8 * width // 3 + 15) // 16 * 16,
                "num_attention_heads": heads,
                "num_key_value_heads": heads,
                "layers_per_stage": layers_per_stage,
                "embedding_init_std": embedding_init_std,
                **sections.get("model", {}),
            },
            # one microbatch a step, the cosine schedule ending with the run: each codec's loss is
            # read where its training has settled, not in the middle of a high learning rate
            "training": {
                "microbatches_per_step": 1,
                "total_steps": steps,
                "wire_compression": codec,
                "slow_link_compression": codec,
            },
        }
    )


def hop(t: torch.Tensor, variant: HopVariant, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """What a hop's transport does to `t`: encode, decode (anchored to `token_ids` if given); for
    fp16+anchors, the lossless hop with a(t) added."""
    if variant.adds_anchors:
        decoded = decode_tensor(encode_tensor(t, variant.codec))
        if token_ids is None:  # a gradient: a(t) does not depend on x
            return decoded
        return decoded + anchors(token_ids, t.shape[-1]).reshape(t.shape)
    return decode_tensor(encode_tensor(t, variant.codec, anchor_ids=token_ids), anchor_ids=token_ids)


def train_microbatch(workers: list[StageWorker], key: int, tokens, targets, variant: HopVariant) -> float:
    ids = tokens.to(torch.int16) if variant.anchored else None  # forward hops only: a gradient has no anchor
    hidden = hop(workers[0].embed(key, tokens), variant, ids)
    for worker in workers[1:]:
        hidden = hop(worker.forward(key, hidden), variant, ids)
    loss, grad = workers[0].head_loss_backward(key, hidden, targets)
    for worker in reversed(workers[1:]):
        grad = worker.backward(key, hop(grad, variant))
    workers[0].embed_backward(key, hop(grad, variant))
    return loss


@torch.no_grad()
def held_out_loss(workers: list[StageWorker], batches, variant: HopVariant) -> float:
    edge = workers[0].module
    losses = []
    for tokens, targets in batches:
        ids = tokens.to(torch.int16) if variant.anchored else None
        hidden = hop(edge.embed(tokens), variant, ids)
        for worker in workers[1:]:
            hidden = hop(worker.module(hidden), variant, ids)
        losses.append(float(edge.loss(hidden, targets)))
    return statistics.fmean(losses)


def run(variant: HopVariant, seed: int, args: argparse.Namespace) -> dict:
    config = bench_config(
        args.width, args.layers, seed, variant.codec, args.microbatches, args.data, args.embedding_init_std
    )
    workers = [
        StageWorker(config, stage, module=build_stage(config.model, stage, config.seed))
        for stage in range(config.num_stages)
    ]
    try:
        if args.data is None:
            source = markov_source(config, 0)
            held = markov_source(config, HELD_OUT_STREAM)
            floors = {"floor": source.loss_floor, "current_token_floor": source.context_free_floor}
        else:  # the simulator's readers: train.bin in the seed's own stream, val.bin for every codec alike
            source, held, floors = training_source(config, 0), held_out_source(config), {}
        t = config.training
        batches = [held.next_batch(16, t.sequence_length) for _ in range(args.eval_batches)]
        started = time.monotonic()
        for key in range(args.microbatches):
            train_microbatch(workers, key, *source.next_batch(t.microbatch_size, t.sequence_length), variant)
        return {
            "held_out_loss": held_out_loss(workers, batches, variant),
            **floors,
            "seconds": time.monotonic() - started,
        }
    finally:
        for worker in workers:
            worker.close()


def bytes_per_token(width: int, codec: Compression, anchored: bool, tokens: int = 2048) -> float:
    """A forward hop's tensors' bytes per token: the hidden states, and the int16 token ids with them."""
    return wire_nbytes(torch.empty((1, tokens, width), device="meta"), codec) / tokens + (2 if anchored else 0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--microbatches", type=int, help="training microbatches (one step each)")
    parser.add_argument("--width", type=int, help="hidden size of the benchmark model")
    parser.add_argument("--layers", type=int, help="layers per block stage (2 block stages)")
    parser.add_argument("--eval-batches", type=int)
    parser.add_argument(
        "--embedding-init-std",
        type=float,
        default=ModelConfig.embedding_init_std,
        help="the token embedding's initial std (model.embedding_init_std)",
    )
    parser.add_argument("--data", type=Path, help="a `node prepare-data` directory: real text instead of the chain")
    parser.add_argument(
        "--prepare-stdlib",
        action="store_true",
        help="prepare the CPython standard library into --data first, unless it is there (as `make experiments`)",
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument(
        "--processes", type=int, default=1, help="runs at once, one thread each (2 on a 2-core machine halves the time)"
    )
    args = parser.parse_args(argv)
    if args.prepare_stdlib and args.data is None:
        parser.error("--prepare-stdlib needs --data DIR, where the corpus is kept")
    # unset sizes are the chain's or the text's defaults (TEXT_SIZES: chosen from a timed run)
    for name, default in (CHAIN_SIZES if args.data is None else TEXT_SIZES).items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def corpus(args: argparse.Namespace) -> dict | None:
    """The corpus --data names (prepared first with --prepare-stdlib), as the summary records it."""
    if args.data is None:
        return None
    if args.prepare_stdlib:  # the directory `make experiments` uses: either command prepares it once
        prepared, source = prepare_stdlib(args.data, FULL), stdlib_source(FULL)
    else:
        prepared, source = load_prepared(args.data), f"the `node prepare-data` directory {args.data}"
    return {**corpus_record(prepared, source), "directory": str(args.data)}


def _one_thread_run(variant: HopVariant, seed: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)  # the figures compare codecs, not machines: keep runs alike
    return run(variant, seed, args)


def run_all(args: argparse.Namespace) -> dict[tuple[str, int], dict]:
    """Every (variant, seed) run, `args.processes` at a time: each run is one thread, alone in its
    process (spawned: a forked torch may hang on the parent's thread pool), so the figures do not
    depend on how many ran beside it beyond the cores they share."""
    pairs = [(name, seed) for name in args.variants for seed in args.seeds]
    if args.processes <= 1:
        return {(name, seed): _one_thread_run(VARIANTS[name], seed, args) for name, seed in pairs}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.processes, mp_context=context) as pool:
        futures = {pair: pool.submit(_one_thread_run, VARIANTS[pair[0]], pair[1], args) for pair in pairs}
        return {pair: future.result() for pair, future in futures.items()}


def measure(args: argparse.Namespace) -> dict:
    """Every variant over every seed: the summary `--json` writes (and docs/results/hop_codec*.json hold)."""
    text = corpus(args)
    if text is not None:
        print(f"corpus {args.data}: vocabulary {text['vocab_size']}, {text['train_tokens']:,} train tokens", flush=True)
    widths = {
        "bench": args.width,
        "15m": preset_named(PresetName.STORIES_15M).hidden_size,
        "125m": preset_named(PresetName.MOBILELLM_125M).hidden_size,
    }
    every_run = run_all(args)
    results: dict[str, dict] = {}
    for name in args.variants:
        variant = VARIANTS[name]
        codec, anchored = variant.codec, variant.anchored
        runs = [every_run[name, seed] for seed in args.seeds]
        losses = [r["held_out_loss"] for r in runs]
        results[name] = {
            "bytes_per_token": {label: bytes_per_token(w, codec, anchored) for label, w in widths.items()},
            "fewer_bytes_than_fp16": {
                label: bytes_per_token(w, Compression.FP16, False) / bytes_per_token(w, codec, anchored)
                for label, w in widths.items()
            },
            "losses": losses,
            "mean": statistics.fmean(losses),
            "spread": statistics.stdev(losses) if len(losses) > 1 else 0.0,
            "runs": runs,
        }
        r = results[name]
        ratios = ", ".join(f"{label} {ratio:.1f}x" for label, ratio in r["fewer_bytes_than_fp16"].items())
        print(
            f"{name:20s} bytes/token/hop at width {args.width}: {r['bytes_per_token']['bench']:.1f} "
            f"(fewer than fp16: {ratios}); held-out loss {r['mean']:.4f} +- {r['spread']:.4f} "
            f"({', '.join(f'{x:.4f}' for x in losses)})",
            flush=True,
        )
    if "fp16" in results:
        base = results["fp16"]
        if text is None:
            floors = ", ".join(f"{r['floor']:.4f}" for r in base["runs"])
            current = ", ".join(f"{r['current_token_floor']:.4f}" for r in base["runs"])
            print(f"floor per seed {floors}; from the current token alone {current}")
        else:
            print(f"the text's bounds: unigram {text['unigram_nats']:.4f}, bigram {text['bigram_nats']:.4f} nats")
        for name, r in results.items():
            paired = [100 * (x / b - 1) for x, b in zip(r["losses"], base["losses"], strict=True)]
            r["cost_percent"] = paired
            per_seed = ", ".join(f"{p:+.2f}" for p in paired)
            print(f"{name:20s} loss cost vs fp16: {statistics.fmean(paired):+.2f} % (per seed {per_seed})")
    recorded_args = {**vars(args), "json": str(args.json), "data": None if args.data is None else str(args.data)}
    return {"args": recorded_args, **({} if text is None else {"corpus": text}), "results": results}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    summary = measure(args)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

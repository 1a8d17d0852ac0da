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
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from node.config import SwarmConfig  # noqa: E402
from node.model.llama import build_stage  # noqa: E402
from node.model.presets import PresetName, preset_named  # noqa: E402
from node.model.synthetic import markov_source  # noqa: E402
from node.stage.stage_worker import StageWorker  # noqa: E402
from protocol import Compression, decode_tensor, encode_tensor, wire_nbytes  # noqa: E402

# label -> (codec, whether forward hops carry their token ids as anchors, as the swarm's do in a
# subspace codec: node/pipeline/origin.py, hop_token_ids); the unanchored run shows what they buy
VARIANTS = {
    "fp16": (Compression.FP16, False),
    "int8": (Compression.INT8, False),
    "subspace8": (Compression.SUBSPACE8, True),
    "subspace4": (Compression.SUBSPACE4, True),
    "subspace8-unanchored": (Compression.SUBSPACE8, False),
}
HELD_OUT_STREAM = 1 << 20  # a data stream no training microbatch comes from


def bench_config(width: int, layers_per_stage: int, seed: int, codec: Compression, steps: int) -> SwarmConfig:
    heads = max(1, width // 32)
    return SwarmConfig.from_dict(
        {
            "seed": seed,
            "num_stages": 3,
            "model": {
                "hidden_size": width,
                "intermediate_size": (8 * width // 3 + 15) // 16 * 16,
                "num_attention_heads": heads,
                "num_key_value_heads": heads,
                "layers_per_stage": layers_per_stage,
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


def hop(t: torch.Tensor, codec: Compression, token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """What a hop's transport does to `t`: encode, decode (anchored to `token_ids` if given)."""
    return decode_tensor(encode_tensor(t, codec, anchor_ids=token_ids), anchor_ids=token_ids)


def train_microbatch(
    workers: list[StageWorker], key: int, tokens, targets, codec: Compression, anchored: bool
) -> float:
    ids = tokens.to(torch.int16) if anchored else None  # forward hops only: a gradient has no anchor
    hidden = hop(workers[0].embed(key, tokens), codec, ids)
    for worker in workers[1:]:
        hidden = hop(worker.forward(key, hidden), codec, ids)
    loss, grad = workers[0].head_loss_backward(key, hidden, targets)
    for worker in reversed(workers[1:]):
        grad = worker.backward(key, hop(grad, codec))
    workers[0].embed_backward(key, hop(grad, codec))
    return loss


@torch.no_grad()
def held_out_loss(workers: list[StageWorker], batches, codec: Compression, anchored: bool) -> float:
    edge = workers[0].module
    losses = []
    for tokens, targets in batches:
        ids = tokens.to(torch.int16) if anchored else None
        hidden = hop(edge.embed(tokens), codec, ids)
        for worker in workers[1:]:
            hidden = hop(worker.module(hidden), codec, ids)
        losses.append(float(edge.loss(hidden, targets)))
    return statistics.fmean(losses)


def run(codec: Compression, anchored: bool, seed: int, args: argparse.Namespace) -> dict:
    config = bench_config(args.width, args.layers, seed, codec, args.microbatches)
    workers = [
        StageWorker(config, stage, module=build_stage(config.model, stage, config.seed))
        for stage in range(config.num_stages)
    ]
    try:
        source = markov_source(config, 0)
        held = markov_source(config, HELD_OUT_STREAM)
        t = config.training
        batches = [held.next_batch(16, t.sequence_length) for _ in range(args.eval_batches)]
        started = time.monotonic()
        for key in range(args.microbatches):
            train_microbatch(workers, key, *source.next_batch(t.microbatch_size, t.sequence_length), codec, anchored)
        return {
            "held_out_loss": held_out_loss(workers, batches, codec, anchored),
            "floor": source.loss_floor,
            "current_token_floor": source.context_free_floor,
            "seconds": time.monotonic() - started,
        }
    finally:
        for worker in workers:
            worker.close()


def bytes_per_token(width: int, codec: Compression, anchored: bool, tokens: int = 2048) -> float:
    """A forward hop's tensors' bytes per token: the hidden states, and the int16 token ids with them."""
    return wire_nbytes(torch.empty((1, tokens, width), device="meta"), codec) / tokens + (2 if anchored else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--microbatches", type=int, default=800, help="training microbatches (one step each)")
    parser.add_argument("--width", type=int, default=128, help="hidden size of the benchmark model")
    parser.add_argument("--layers", type=int, default=2, help="layers per block stage (2 block stages)")
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the figures compare codecs, not machines: keep runs alike
    widths = {
        "bench": args.width,
        "15m": preset_named(PresetName.STORIES_15M).hidden_size,
        "125m": preset_named(PresetName.MOBILELLM_125M).hidden_size,
    }
    results: dict[str, dict] = {}
    for name in args.variants:
        codec, anchored = VARIANTS[name]
        runs = [run(codec, anchored, seed, args) for seed in args.seeds]
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
        floors = ", ".join(f"{r['floor']:.4f}" for r in base["runs"])
        current = ", ".join(f"{r['current_token_floor']:.4f}" for r in base["runs"])
        print(f"floor per seed {floors}; from the current token alone {current}")
        for name, r in results.items():
            paired = [100 * (x / b - 1) for x, b in zip(r["losses"], base["losses"], strict=True)]
            r["cost_percent"] = paired
            per_seed = ", ".join(f"{p:+.2f}" for p in paired)
            print(f"{name:20s} loss cost vs fp16: {statistics.fmean(paired):+.2f} % (per seed {per_seed})")
    if args.json:
        args.json.write_text(json.dumps({"args": {**vars(args), "json": str(args.json)}, "results": results}, indent=2))


if __name__ == "__main__":
    main()

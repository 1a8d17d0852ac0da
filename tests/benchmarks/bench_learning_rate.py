"""A preset's width at a few learning rates: the training and held-out loss of the live StageWorkers.

Not a test: a script that prints a table (docs/model.md, "Presets", learning rate). Each rate trains
the same model on the same tokens: the preset's width, heads and vocabulary with `--layers` block
layers per stage over 2 block stages (a real preset's depth does not fit a CPU's minutes), one
microbatch of `--microbatch` x `--sequence` tokens a step, on the embedded second-order Markov
source, through StageWorkers as a swarm runs them (inner AdamW, warmup, clipping) but in one
process, hops uncompressed. Prints the mean training loss of every 50 steps' last 20, then the
held-out loss beside the source's floor and its current-token floor (what the embedding alone can
reach: below it, the blocks matter).

    python tests/benchmarks/bench_learning_rate.py --preset 125m --rates 3e-3 1e-3 6e-4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests" / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
from bench_hop_codec import HELD_OUT_STREAM, held_out_loss, train_microbatch  # noqa: E402

from node.model.llama import build_stage  # noqa: E402
from node.model.presets import load_config  # noqa: E402
from node.model.synthetic import markov_source  # noqa: E402
from node.stage.stage_worker import StageWorker  # noqa: E402
from protocol import Compression  # noqa: E402


def run(preset: str, rate: float, args: argparse.Namespace) -> None:
    config = load_config(
        **{
            "model.preset": preset,
            "num_stages": 3,
            "model.layers_per_stage": args.layers,
            "training.microbatch_size": args.microbatch,
            "training.sequence_length": args.sequence,
            "training.microbatches_per_step": 1,
            "training.learning_rate": rate,
        }
    )
    workers = [
        StageWorker(config, stage, module=build_stage(config.model, stage, config.seed))
        for stage in range(config.num_stages)
    ]
    try:
        source, held = markov_source(config, 0), markov_source(config, HELD_OUT_STREAM)
        batches = [held.next_batch(4, args.sequence) for _ in range(4)]
        losses, started = [], time.monotonic()
        for key in range(args.steps):
            batch = source.next_batch(args.microbatch, args.sequence)
            losses.append(float(train_microbatch(workers, key, *batch, Compression.NONE, False)))
            if (key + 1) % 50 == 0:
                print(f"{preset} lr {rate:g} step {key + 1}: training {statistics.fmean(losses[-20:]):.3f}", flush=True)
        held_out = held_out_loss(workers, batches, Compression.NONE, False)
        print(
            f"{preset} lr {rate:g}: held-out {held_out:.3f} after {args.steps} steps; floor {source.loss_floor:.3f}, "
            f"current-token floor {source.context_free_floor:.3f} ({time.monotonic() - started:.0f} s)",
            flush=True,
        )
    finally:
        for worker in workers:
            worker.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="125m", help="whose width, heads and vocabulary (docs/model.md)")
    parser.add_argument("--rates", type=float, nargs="+", default=[3e-3, 1e-3, 6e-4])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=1, help="layers per block stage (2 block stages)")
    parser.add_argument("--microbatch", type=int, default=2)
    parser.add_argument("--sequence", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for rate in args.rates:
        run(args.preset, rate, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

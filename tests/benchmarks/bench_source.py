"""Do the blocks matter on the embedded source? Stage 0 alone against the whole default model.

    python tests/benchmarks/bench_source.py [--steps 600] [--eval-every 100] [--threads 1]

Both runs use the swarm's own code and schedule in one process, no networking: StageWorkers
(AdamW, warmup and cosine decay, clipping, 2 microbatches of 8 x 64 tokens per step). "stage 0
only" sends the embedding straight to the head (what stage 0 computes without blocks: a function
of the current token); "full model" goes through both block stages in CheckFree+'s order (the
block stages swapped on odd microbatches, as in the swarm). Held-out loss on 64 x 64 tokens of
another stream, against the chain's exact floor and its exact current-token-only floor
(docs/model.md records the table).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from node.config import SwarmConfig  # noqa: E402
from node.model.synthetic import markov_source  # noqa: E402
from node.pipeline.order import pipeline_order  # noqa: E402
from node.stage.stage_worker import StageWorker  # noqa: E402


def held_out_loss(workers: list[StageWorker], with_blocks: bool, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    edge = workers[0].module
    with torch.no_grad():
        hidden = edge.embed(tokens)
        if with_blocks:
            for worker in workers[1:]:  # evaluation: the normal order
                hidden = worker.module(hidden)
        return edge.loss(hidden, targets).item()


def train(config: SwarmConfig, with_blocks: bool, steps: int, eval_every: int) -> list[tuple[int, float, float]]:
    """[(optimizer step, held-out loss, seconds)] every eval_every steps."""
    t = config.training
    source, held_out = markov_source(config, 1), markov_source(config, 2)
    eval_tokens, eval_targets = held_out.next_batch(64, t.sequence_length)
    workers = [StageWorker(config, stage) for stage in range(config.num_stages if with_blocks else 1)]
    rows = []
    started = time.monotonic()
    try:
        for index in range(steps * t.microbatches_per_step):
            tokens, targets = source.next_batch(t.microbatch_size, t.sequence_length)
            key = ("bench", index)
            hidden = workers[0].embed(key, tokens)
            order = pipeline_order(config.num_stages, index, config.recovery.checkfree_plus) if with_blocks else []
            for stage in order:
                hidden = workers[stage].forward(key, hidden)
            _, grad = workers[0].head_loss_backward(key, hidden, targets)
            for stage in reversed(order):
                grad = workers[stage].backward(key, grad)
            workers[0].embed_backward(key, grad)
            step = workers[0].inner_step
            if (index + 1) % t.microbatches_per_step == 0 and step % eval_every == 0:
                loss = held_out_loss(workers, with_blocks, eval_tokens, eval_targets)
                rows.append((step, loss, time.monotonic() - started))
                print(f"{'full model' if with_blocks else 'stage 0 only'} step {step}: {loss:.3f}", file=sys.stderr)
    finally:
        for worker in workers:
            worker.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps of each run")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    config = SwarmConfig()
    source = markov_source(config, 0)
    print(source.description)
    print(f"floor {source.loss_floor:.3f}, current token alone {source.context_free_floor:.3f}")
    edge = train(config, False, args.steps, args.eval_every)
    full = train(config, True, args.steps, args.eval_every)
    print("| step | stage 0 only | full model (CheckFree+ order) |")
    print("|---|---|---|")
    for (step, edge_loss, _), (_, full_loss, _) in zip(edge, full, strict=True):
        print(f"| {step} | {edge_loss:.3f} | {full_loss:.3f} |")
    print(f"seconds: stage 0 only {edge[-1][2]:.0f}, full model {full[-1][2]:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

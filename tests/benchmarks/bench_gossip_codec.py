"""The loss cost of the gossip codec: NoLoCo with the codec's rounds against exact fp32 rounds.

Runs the project's StageWorkers, Router and outer steps in one process on the simulated clock
(node/simulate/swarm.py) on the second-order Markov chain where the block stages matter, twice per
seed: every round exchanging phi and Delta in fp32 (16 bytes a parameter), and as the swarm does
(node/averaging/gossip_codec.py: 4-bit Delta with error feedback, phi as residues on a dithered
grid decoded against the receiver's own phi; 2.125 bytes a parameter at the defaults). The same tokens reach both (same seeds,
iterations, replicas and data streams). Prints the held-out loss and the replica divergence at the
end, per seed and as mean and spread, and the codec's cost in % of the loss; `--json FILE` keeps
every number. Not a timed test: `python tests/benchmarks/bench_gossip_codec.py` (docs/results.md).
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

from node.averaging.gossip_codec import GossipCodec  # noqa: E402
from node.config import GossipConfig  # noqa: E402
from node.simulate.settings import SimSettings  # noqa: E402
from node.simulate.swarm import SimulatedSwarm, SyncMode  # noqa: E402

VARIANTS = {"exact fp32 rounds": True, "codec": False}


def run(sim: SimSettings, exact: bool, gossip: dict) -> dict:
    config = sim.config().replace(gossip=gossip)
    swarm = SimulatedSwarm(
        config, sim.replicas, sim.link, sim.compute_seconds, SyncMode.NOLOCO, sim.seed, exact_gossip=exact
    )
    held_out = swarm.held_out(sim.eval_batches)
    started = time.monotonic()
    divergences = []
    try:
        for iteration in range(sim.steps):
            swarm.train_iteration()
            swarm.synchronise()
            if (iteration + 1) % sim.eval_every == 0:
                divergences.append(swarm.divergence())
        rounds = sum(replica.state.round for row in swarm.outer for replica in row)
        return {
            "eval_loss": swarm.eval_loss(held_out),
            "final_divergence": swarm.divergence(),
            "mean_divergence": statistics.fmean(divergences) if divergences else 0.0,
            "outer_rounds": rounds,
            "max_phi_edge_share": max(swarm.phi_edge_shares, default=0.0),
            "mean_phi_edge_share": statistics.fmean(swarm.phi_edge_shares) if swarm.phi_edge_shares else 0.0,
            "seconds": time.monotonic() - started,
        }
    finally:
        swarm.close()


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{mean:.4f} ± {sd:.4f} ({min(values):.4f}-{max(values):.4f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--phi-bits", type=int, default=GossipConfig.phi_bits, choices=[4, 8])
    parser.add_argument("--phi-step", type=float, default=GossipConfig.phi_step)
    parser.add_argument("--codec-only", action="store_true", help="skip the exact rounds (their figures do not change)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gossip = {"phi_bits": args.phi_bits, "phi_step": args.phi_step}
    codec = GossipCodec(GossipConfig.delta_block, args.phi_bits, args.phi_step)
    print(
        f"NoLoCo, {args.stages} stages x {args.replicas} replicas, H = {args.inner_steps}, {args.steps} iterations, "
        f"seeds {args.seeds}; codec: phi {codec.phi_bits} bits at {codec.phi_step:g} Delta scales, "
        f"Delta block {codec.block} "
        f"({2 * codec.bytes_per_parameter():.3f} bytes a parameter a round, exact: 16)",
        flush=True,
    )
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for seed in args.seeds:
        sim = SimSettings(
            steps=args.steps,
            stages=args.stages,
            replicas=args.replicas,
            seed=seed,
            inner_steps=args.inner_steps,
            compute_ms=10.0,
        )
        for name, exact in VARIANTS.items():
            if exact and args.codec_only:
                continue
            result = run(sim, exact, gossip)
            results[name].append({"seed": seed, **result})
            print(
                f"  seed {seed} {name:18s} loss {result['eval_loss']:.4f}  divergence {result['final_divergence']:.4f} "
                f"(mean {result['mean_divergence']:.4f})  {result['outer_rounds']} rounds  "
                f"phi at the reach's edge: max {result['max_phi_edge_share']:.2%}, mean {result['mean_phi_edge_share']:.2%}  "
                f"{result['seconds']:.0f} s",
                flush=True,
            )
    if args.codec_only:
        print(f"codec: loss {spread([r['eval_loss'] for r in results['codec']])}")
        return 0
    exact_losses = [r["eval_loss"] for r in results["exact fp32 rounds"]]
    codec_losses = [r["eval_loss"] for r in results["codec"]]
    costs = [100.0 * (c - e) / e for c, e in zip(codec_losses, exact_losses)]
    print("held-out loss (mean ± sd over seeds, min-max):")
    for name, runs in results.items():
        print(f"  {name:18s} {spread([r['eval_loss'] for r in runs])}")
        print(f"  {'':18s} divergence {spread([r['final_divergence'] for r in runs])}")
    print(f"codec cost, per seed: {', '.join(f'{c:+.2f} %' for c in costs)}; mean {statistics.fmean(costs):+.2f} %")
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps({"args": vars(args), "results": results, "cost_percent": costs}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make demo`: a real training swarm on loopback with the embedded defaults.

A bootstrap peer plus `stages x peers-per-stage` joiners, each its own process with its own libp2p
daemon, train the default model on the embedded order-2 Markov chain (data.source = markov). Every
few seconds the demo reads the swarm from the DHT (as `node status` does) and prints the loss
falling toward the chain's exact floor, past the level stage 0 alone cannot beat (the best
prediction from the current token only: getting below it takes the block stages' attention), then
stops every process it started.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console

from dht.records import PeerState
from node.config import SwarmConfig
from node.local_swarm import Swarm, peers_by_stage, wait_for
from node.model.synthetic import markov_source


def summarize(snapshot: dict) -> dict:
    online = [peer for stage in snapshot["stages"] for peer in stage["peers"] if peer["state"] == PeerState.ONLINE]
    losses = [peer["loss"] for peer in online if peer["stage"] == 0 and peer["loss"] is not None]
    return {
        "online": len(online),
        "per_stage": [len(ids) for ids in peers_by_stage(snapshot).values()],
        "loss": sum(losses) / len(losses) if losses else None,
        "steps": [peer["inner_step"] for peer in online],
        "stage0_steps": sum(peer["inner_step"] for peer in online if peer["stage"] == 0),
    }


async def watch(swarm: Swarm, duration: float, interval: float, console: Console, floor: float | None) -> list[float]:
    from node.monitor.observer import observe

    losses: list[float] = []
    training = SwarmConfig().training
    tokens_per_step = training.microbatches_per_step * training.microbatch_size * training.sequence_length
    previous: tuple[float, int] | None = None
    async with observe(swarm.initial_peers, None) as observer:
        started = time.monotonic()
        while time.monotonic() - started < duration:
            summary = summarize(await observer.snapshot())
            now = time.monotonic()
            loss = "-" if summary["loss"] is None else f"{summary['loss']:.3f}"
            if summary["loss"] is not None:
                losses.append(summary["loss"])
            # every stage-0 optimizer step is microbatches_per_step microbatches that went all the
            # way through the swarm and back
            rate = "-"
            if previous is not None and now > previous[0]:
                rate = f"{(summary['stage0_steps'] - previous[1]) * tokens_per_step / (now - previous[0]):.0f}"
            previous = (now, summary["stage0_steps"])
            steps = f"{min(summary['steps'], default=0)}..{max(summary['steps'], default=0)}"
            console.print(
                f"[bold]{now - started:4.0f}s[/] peers/stage {summary['per_stage']} steps {steps:<9} "
                f"loss [cyan]{loss}[/] (floor {floor:.3f}) {rate} tokens/s"
            )
            await asyncio.sleep(interval)
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.demo", description=__doc__)
    parser.add_argument("--stages", type=int, default=3, help="pipeline stages, counting stage 0")
    parser.add_argument("--peers-per-stage", type=int, default=2)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of training to show")
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--workdir", help="where peer logs go (default: a temporary directory)")
    args = parser.parse_args(argv)

    console = Console(soft_wrap=True)  # one line per report, also when piped
    config = SwarmConfig(num_stages=args.stages)
    source = markov_source(config, 0)  # what the default config (data.source = markov) trains on
    floor = source.floor_at(config.training.sequence_length)  # = source.loss_floor, typed float
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pipeswarm-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    console.print(
        f"[bold]pipeswarm demo[/]: {args.stages} stages x {args.peers_per_stage} peers on 127.0.0.1, logs in {workdir}"
    )
    console.print(f"data: {source.description}")
    swarm = Swarm(workdir)
    try:
        swarm.bootstrap("--num-stages", str(args.stages), "--heartbeat-period", "2", "--heartbeat-ttl", "8")
        console.print(f"bootstrap up at {swarm.initial_peers[0]}")
        total = args.stages * args.peers_per_stage
        for i in range(total):
            swarm.join(f"peer{i}", "--stage", "auto", "--threads", "1", "--quiet", "--name", f"demo-{i}")
        wait_for(
            lambda: (
                all(node.process.poll() is None for node in swarm.nodes)
                and sum(map(len, peers_by_stage(swarm.status()).values())) == total
            ),
            120,
            lambda: "peers did not come online; see logs in " + str(workdir),
            interval=2.0,
        )
        console.print(f"{total} peers online; training (ctrl-c stops early)")
        losses = asyncio.run(watch(swarm, args.duration, args.interval, console, floor))
        if len(losses) >= 2:
            # below context_free_floor only the block stages' attention gets the loss (stage 0 alone stops there)
            console.print(
                f"[bold green]stage-0 loss {losses[0]:.3f} -> {losses[-1]:.3f}[/] (floor {floor:.3f}, "
                f"stage 0 alone stops at {source.context_free_floor:.3f})"
            )
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        console.print("stopping every peer ...")
        swarm.close()
        console.print("done: no process left behind")


if __name__ == "__main__":
    sys.exit(main())

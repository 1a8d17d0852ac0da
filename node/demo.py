"""`make demo`: a real training swarm on loopback with the embedded defaults, and the three methods
at work.

A bootstrap peer plus `stages x peers-per-stage` joiners, each its own process with its own libp2p
daemon, train the default model on the embedded order-2 Markov chain (data.source = markov), whose
exact floor the loss falls toward, past the level stage 0 alone cannot beat: SWARM routing between the stages, NoLoCo
gossip inside each stage (its rounds are shown per stage). Part way through, the demo SIGKILLs
every peer of a middle block stage, and later of stage 1, and starts `--stage auto` newcomers: the
first stage is rebuilt by CheckFree (its neighbours averaged by gradient norm), the second by
CheckFree+ (a copy of stage 2, which learned stage 1's role on the swapped microbatches). The
rebuild lines, the loss dip and the recovery are printed as they happen; the demo ends with a
dashboard frame and a summary (tokens/s, loss against the source's floor, time to rebuild), then
stops every process it started.

Only the timing of the swarm differs from the defaults (heartbeat 1 s, record TTL 4 s, a stage is
lost after 2 s without a peer), so that a failure is noticed within seconds of a three-minute demo.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from dht.records import EventKind, PeerState
from node.config import SwarmConfig
from node.local_swarm import NodeProcess, Swarm, peers_by_stage
from node.model.synthetic import markov_source
from node.monitor.observer import Observer, observe

DEMO_TIMING = """\
num_stages = {num_stages}
[heartbeat]
period = 1.0
ttl = 4.0
[recovery]
lost_grace = 2.0
rebalance_wait = 10.0
edge_copy_interval = 10
"""
PEER_FLAGS = ("--threads", "1", "--quiet", "--join-jitter", "0.5")
SHOWN_EVENTS = (EventKind.LOST, EventKind.REBUILD, EventKind.UNRECOVERABLE)


def summarize(snapshot: dict) -> dict:
    online = [peer for stage in snapshot["stages"] for peer in stage["peers"] if peer["state"] == PeerState.ONLINE]
    losses = [peer["loss"] for peer in online if peer["stage"] == 0 and peer["loss"] is not None]
    return {
        "online": len(online),
        "per_stage": [len(ids) for ids in peers_by_stage(snapshot).values()],
        "loss": sum(losses) / len(losses) if losses else None,
        "steps": [peer["inner_step"] for peer in online],
        "stage0_microbatches": {peer["peer_id"]: peer["microbatches"] for peer in online if peer["stage"] == 0},
        # NoLoCo rounds each stage has made so far (its most advanced online replica)
        "rounds": [
            max((p["outer_round"] for p in stage["peers"] if p["state"] == PeerState.ONLINE), default=0)
            for stage in snapshot["stages"]
        ],
    }


@dataclass
class Failure:
    """A whole stage killed at `at` seconds into training, and when it served again."""

    stage: int
    method: str
    at: float
    killed_at: float | None = None  # monotonic
    back_after: float | None = None  # seconds from the kill to an online peer of the stage again


@dataclass
class DemoRun:
    swarm: Swarm
    console: Console
    config: SwarmConfig
    peers: dict[int, list[NodeProcess]] = field(default_factory=dict)
    started: int = 0
    seen_events: set[tuple] = field(default_factory=set)
    losses: list[float] = field(default_factory=list)
    # every stage-0 peer's latest inner step: a peer missing from one snapshot (a late heartbeat)
    # keeps its count, so the throughput never goes backwards
    stage0_microbatches: dict[str, int] = field(default_factory=dict)

    def join(self, *stage_args: str) -> NodeProcess:
        self.started += 1
        return self.swarm.join(f"peer{self.started}", *stage_args, *PEER_FLAGS, "--name", f"demo-{self.started}")

    def start(self, peers_per_stage: int) -> None:
        for stage in range(self.config.num_stages):
            self.peers[stage] = [self.join("--stage", str(stage)) for _ in range(peers_per_stage)]

    def kill_stage(self, failure: Failure) -> None:
        """SIGKILL every peer of the stage (p2pd included), then start as many `--stage auto` newcomers."""
        victims = [node for node in self.peers.get(failure.stage, []) if node.process.poll() is None]
        for node in victims:
            node.kill_hard()
        failure.killed_at = time.monotonic()
        self.console.print(
            f"[bold red]killed all {len(victims)} peers of stage {failure.stage}[/] (SIGKILL, no goodbye); "
            f"{len(victims)} newcomers join with --stage auto: expect a rebuild by {failure.method}"
        )
        self.peers[failure.stage] = []
        time.sleep(1.0)
        for _ in victims:
            self.peers[failure.stage].append(self.join("--stage", "auto"))

    def report_events(self, snapshot: dict) -> None:
        for event in sorted(snapshot.get("events", []), key=lambda e: e.get("time", 0.0)):
            key = (event.get("time"), event.get("kind"), event.get("stage"), event.get("peer_id"))
            if event.get("kind") in SHOWN_EVENTS and key not in self.seen_events:
                self.seen_events.add(key)
                self.console.print(f"  [magenta]{event['kind']}[/] stage {event.get('stage')}: {event.get('detail')}")

    async def run(
        self, total: int, duration: float, interval: float, failures: list[Failure], floor: float | None
    ) -> dict:
        """Wait for `total` peers online, then watch: one observer (one p2pd) for the whole demo."""
        async with observe(self.swarm.initial_peers, None, find_timeout=60.0) as observer:
            deadline = time.monotonic() + 180.0
            while sum(map(len, peers_by_stage(await observer.snapshot()).values())) < total:
                if time.monotonic() > deadline or any(n.process.poll() is not None for n in self.swarm.nodes):
                    raise RuntimeError(f"peers did not come online; see logs in {self.swarm.workdir}")
                await asyncio.sleep(2.0)
            self.console.print(f"{total} peers online; training (ctrl-c stops early)")
            return await self.watch(observer, duration, interval, failures, floor)

    async def watch(
        self, observer: Observer, duration: float, interval: float, failures: list[Failure], floor: float | None
    ) -> dict:
        training = self.config.training
        tokens_per_microbatch = training.microbatch_size * training.sequence_length
        previous: tuple[float, int] | None = None
        first: tuple[float, int] | None = None
        snapshot: dict = {}
        started = time.monotonic()
        while time.monotonic() - started < duration:
            for failure in failures:
                if failure.killed_at is None and time.monotonic() - started >= failure.at:
                    await asyncio.to_thread(self.kill_stage, failure)
            snapshot = await observer.snapshot()
            summary = summarize(snapshot)
            now = time.monotonic()
            for failure in failures:
                stage_online = summary["per_stage"][failure.stage] if failure.stage < len(summary["per_stage"]) else 0
                if failure.killed_at is not None and failure.back_after is None and stage_online:
                    failure.back_after = now - failure.killed_at
                    self.console.print(
                        f"[bold green]stage {failure.stage} serves again {failure.back_after:.0f} s after the kill[/]"
                    )
            self.report_events(snapshot)
            if summary["loss"] is not None:
                self.losses.append(summary["loss"])
            # a microbatch finished at stage 0 went all the way through the swarm and back
            for peer_id, done in summary["stage0_microbatches"].items():
                self.stage0_microbatches[peer_id] = max(done, self.stage0_microbatches.get(peer_id, 0))
            done_so_far = sum(self.stage0_microbatches.values())
            rate = "-"
            if previous is not None and now > previous[0]:
                rate = f"{(done_so_far - previous[1]) * tokens_per_microbatch / (now - previous[0]):.0f}"
            previous = (now, done_so_far)
            first = first or previous
            loss = "-" if summary["loss"] is None else f"{summary['loss']:.3f}"
            floor_text = "" if floor is None else f" (floor {floor:.3f})"
            self.console.print(
                f"[bold]{now - started:4.0f}s[/] peers/stage {summary['per_stage']} "
                f"gossip rounds/stage {summary['rounds']} loss [cyan]{loss}[/]{floor_text} {rate} tokens/s"
            )
            await asyncio.sleep(interval)
        average_rate = None
        if first is not None and previous is not None and previous[0] > first[0]:
            average_rate = (previous[1] - first[1]) * tokens_per_microbatch / (previous[0] - first[0])
        return {"snapshot": snapshot, "tokens_per_s": average_rate}


def print_summary(
    console: Console, run: DemoRun, result: dict, failures: list[Failure], floor: float | None, alone: float
) -> None:
    from node.monitor.dashboard import render_once

    if result["snapshot"]:
        console.print(render_once(result["snapshot"], 110), markup=False, highlight=False)
    console.print("[bold]summary[/]")
    rate = result["tokens_per_s"]
    console.print(f"  throughput: {rate:.0f} tokens/s through the whole pipeline" if rate else "  throughput: -")
    if len(run.losses) >= 2:
        gap = "" if floor is None else f", {run.losses[-1] - floor:+.3f} nats/token from the floor {floor:.3f}"
        console.print(f"  stage-0 loss: {run.losses[0]:.3f} -> {run.losses[-1]:.3f}{gap}")
        # below this level only the block stages' attention gets the loss (stage 0 alone stops there)
        console.print(f"  stage 0 alone (embedding + head) would stop at {alone:.3f}")
    for failure in failures:
        if failure.killed_at is None:
            continue
        back = "never within the demo" if failure.back_after is None else f"{failure.back_after:.0f} s"
        console.print(f"  stage {failure.stage} ({failure.method}): killed, serving again after {back}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.demo", description=__doc__)
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages, counting stage 0 (4: a middle block)")
    parser.add_argument("--peers-per-stage", type=int, default=2)
    parser.add_argument("--duration", type=float, default=130.0, help="seconds of training to show")
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument(
        "--fail-middle-at", type=float, default=40.0, help="seconds in: kill a middle block stage (0: never)"
    )
    parser.add_argument("--fail-first-at", type=float, default=85.0, help="seconds in: kill stage 1 (0: never)")
    parser.add_argument("--workdir", help="where peer logs go (default: a temporary directory)")
    args = parser.parse_args(argv)

    console = Console(soft_wrap=True)  # one line per report, also when piped
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pipeswarm-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    timing = workdir / "demo.toml"
    timing.write_text(DEMO_TIMING.format(num_stages=args.stages))
    from node.config import read_config

    config = read_config(timing)
    source = markov_source(config, 0)  # what the default config (data.source = markov) trains on
    floor = source.floor_at(config.training.sequence_length)
    failures = []
    if args.fail_middle_at > 0 and args.stages >= 4:
        failures.append(Failure(args.stages // 2, "CheckFree (neighbours averaged)", args.fail_middle_at))
    if args.fail_first_at > 0 and args.stages >= 3:
        failures.append(Failure(1, "CheckFree+ (a copy of stage 2)", args.fail_first_at))
    console.print(
        f"[bold]pipeswarm demo[/]: {args.stages} stages x {args.peers_per_stage} peers on 127.0.0.1, logs in {workdir}"
    )
    console.print(f"data: {source.description}")
    swarm = Swarm(workdir)
    run = DemoRun(swarm, console, config)
    try:
        swarm.bootstrap("--config", str(timing))
        console.print(f"bootstrap up at {swarm.initial_peers[0]}")
        run.start(args.peers_per_stage)
        total = args.stages * args.peers_per_stage
        result = asyncio.run(run.run(total, args.duration, args.interval, failures, floor))
        print_summary(console, run, result, failures, floor, source.context_free_floor)
        return 0
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:
        console.print(f"[bold red]demo failed:[/] {e}")
        return 1
    finally:
        console.print("stopping every peer ...")
        swarm.close()
        console.print("done: no process left behind")


if __name__ == "__main__":
    sys.exit(main())

"""Swarm training tokens/s beside a single process training the same model on the same machine.

Not a test: a script that prints a report (docs/benchmarks.md holds a recorded run).

    python tests/benchmarks/bench_swarm.py [--single-seconds 30] [--warmup 20] [--window 60] \
        [--layouts 1 2] [--single-threads 1 2] [--heartbeat-period P --heartbeat-ttl T] [--json out.json]

single process  The default config (SwarmConfig()), the same StageWorkers (stage 0, 1, 2: embed,
                two block stages, norm+head+loss; AdamW, clipping, microbatches_per_step
                accumulation) chained in one process as tests/swarm/test_pipeline_correctness.py does,
                one microbatch at a time on the synthetic source. tokens/s = microbatch_size *
                sequence_length * microbatches completed / wall seconds, after a few warm-up
                microbatches. The 1-thread run is made again after the swarms, and the ratios
                are against the mean of the two (the swarms run minutes later, on a host whose
                speed drifts). A microbatch a worker's checks reject is dropped and counted, as
                a swarm's origin drops one (bench_floor.py does the same).
swarm           node/local_swarm.py: a bootstrap process plus 3 stages x P peers (`node join
                --stage s --threads 1 --quiet`), each a process with its own p2pd, on 127.0.0.1,
                default config (fp16 wire compression, an in-flight window of 4 to 32, heartbeat 5 s / TTL 15 s;
                `--heartbeat-period 1 --heartbeat-ttl 5` is what runs before 2026-11-26 16:30 UTC
                used, whose DHT traffic cost the swarm CPU a peer on the defaults does not spend).
                After every peer is online and stage 0 reports a loss, `--warmup` seconds pass,
                then each stage-0 peer's `pipeswarm_microbatches_completed_total` is read from its
                `--metrics-port` twice, `--window` seconds apart. Swarm tokens/s = sum over stage-0
                peers of completed * microbatch_size * sequence_length / the time between its two
                reads. A DHT snapshot (as `node status` reads) at both ends gives the losses and
                the block stages' steps.
CPU cost        Beside tokens/s, both runs report CPU seconds (user+system) per microbatch: for the
                single process its own process time, for the swarm the psutil CPU times of every
                process the swarm started (bootstrap, peers, all their p2pd daemons) over the
                window (the benchmark's own DHT observer excluded). On a shared machine tokens/s
                depends on the share of the CPUs the runs get; CPU ms per microbatch does much less.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

import torch  # noqa: E402

from tests.benchmarks.bench_transport import machine_info, script_main  # noqa: E402

# bench_wide_area.py counts microbatches from the records inside its namespaces: a 1 s heartbeat
# gives it the resolution (its ratio compares windows of one swarm, so the DHT's cost cancels there)
HEARTBEAT_PERIOD, HEARTBEAT_TTL = 1.0, 5.0
METRICS_LINE = re.compile(r"Prometheus metrics on http://127\.0\.0\.1:(\d+)/metrics")


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---- single process ------------------------------------------------------------------------------


def single_process(seconds: float, threads: int, warmup_microbatches: int = 4) -> dict:
    from node.config import SwarmConfig
    from node.model.data import open_source
    from node.stage.admission import RejectedInput
    from node.stage.stage_worker import StageWorker
    from tests.helpers.chain import chain_microbatch

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    config = SwarmConfig()
    t = config.training
    source = open_source(config, None, stream_id=1)
    workers = [StageWorker(config, stage) for stage in range(config.num_stages)]
    losses = []
    keys = iter(range(1 << 62))
    rejected = 0

    def one() -> float | None:
        """One microbatch through the chain; None if a worker's checks rejected it (a gradient
        gate seeing a spike the training made, say): dropped, as a swarm's origin drops one."""
        tokens, targets = source.next_batch(t.microbatch_size, t.sequence_length)
        key = ("local", next(keys))
        try:
            return chain_microbatch(workers, key, tokens, targets)
        except RejectedInput as e:
            log(f"single process: a microbatch was rejected: {e}")
            for worker in workers:
                worker.drop(key)
            nonlocal rejected
            rejected += 1
            return None

    try:
        for _ in range(warmup_microbatches):
            one()
        count = 0
        started = time.perf_counter()
        cpu0 = time.process_time()
        while time.perf_counter() - started < seconds:
            loss = one()
            if loss is not None:
                losses.append(loss)
                count += 1
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu0
        if count == 0:
            raise RuntimeError(f"single process: no microbatch completed in {seconds:.0f} s ({rejected} rejected)")
    finally:
        for worker in workers:
            worker.close()
        torch.set_num_threads(previous_threads)
    tokens_per_mb = t.microbatch_size * t.sequence_length
    return {
        "threads": threads,
        "microbatches": count,
        "rejected": rejected,
        "seconds": elapsed,
        "cpu_seconds": cpu,
        "cpu_cores_used": cpu / elapsed,
        "cpu_ms_per_microbatch": 1e3 * cpu / count,
        "microbatches_per_s": count / elapsed,
        "tokens_per_s": count * tokens_per_mb / elapsed,
        "ms_per_microbatch": 1e3 * elapsed / count,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


# ---- swarm ---------------------------------------------------------------------------------------


async def _snapshot(initial_peers: list[str]) -> dict:
    from node.monitor.observer import observe_once

    return await observe_once(initial_peers, None)


def snapshot(initial_peers: list[str]) -> dict:
    import uvloop

    return uvloop.run(_snapshot(initial_peers))


def online(snap: dict, stage: int) -> list[dict]:
    return [p for p in snap["stages"][stage]["peers"] if p["state"] == "online"]


def swarm_cpu_seconds(swarm) -> dict[int, float]:
    """user+system CPU seconds so far of every process the swarm started (p2pd daemons included)."""
    import psutil

    seconds = {}
    for node in swarm.nodes:
        for pid in node.refresh_family():
            try:
                times = psutil.Process(pid).cpu_times()
                seconds[pid] = times.user + times.system
            except psutil.NoSuchProcess:
                pass
    return seconds


def loop_and_other_threads(pid: int) -> tuple[float, float]:
    """CPU seconds so far of a process's main thread (a peer's event loop) and of its other threads
    (the stage's compute thread, mostly); (0, 0) once the process is gone."""
    import psutil

    try:
        threads = psutil.Process(pid).threads()
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    loop = sum(t.user_time + t.system_time for t in threads if t.id == pid)
    return loop, sum(t.user_time + t.system_time for t in threads) - loop


def thread_split(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]], microbatches: float
) -> dict:
    """Per process name: (event loop, other threads) CPU ms per microbatch between two reads."""
    return {
        name: tuple(round(1e3 * (after[name][i] - before[name][i]) / microbatches, 2) for i in (0, 1))
        for name in after
        if name in before and microbatches
    }


def format_thread_split(split: dict) -> str:
    return ", ".join(f"{name} {loop:.1f} / {other:.1f}" for name, (loop, other) in split.items())


def completed_microbatches(port: int) -> tuple[float, float]:
    """(monotonic time of the read, a stage-0 peer's completed microbatches so far) from its /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        at, text = time.monotonic(), reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pipeswarm_microbatches_completed_total":
                return at, sample.value
    raise RuntimeError(f"no pipeswarm_microbatches_completed_total on port {port}")


def stage0_throughput(first: dict, last: dict) -> list[dict]:
    """Per stage-0 peer online in both snapshots: microbatches it completed between them (delta of
    its record's `microbatches`; a step may take more than microbatches_per_step of them) over the
    time between its two announcements (delta of the record's expiration: announce time + TTL)."""
    per_peer = []
    by_id = {p["peer_id"]: p for p in online(first, 0)}
    for p in online(last, 0):
        q = by_id.get(p["peer_id"])
        if q is None:
            continue
        microbatches = p["microbatches"] - q["microbatches"]
        seconds = p["expires"] - q["expires"]
        if seconds <= 0:  # the same announcement read twice: no time passed as far as the record says
            continue
        per_peer.append(
            {
                "peer": p["peer_id"][-8:],
                "microbatches": microbatches,
                "seconds": seconds,
                "microbatches_per_s": microbatches / seconds,
                "loss": p["loss"],
            }
        )
    return per_peer


def swarm_run(
    peers_per_stage: int,
    warmup: float,
    window: float,
    workdir: Path,
    links: str = "direct",
    heartbeat: tuple[float, float] | None = None,
) -> dict:
    """One swarm's window; `links` "direct": as `node join` runs (pipeline channels on direct links,
    node/p2p/direct.py), "p2pd": every hop through the libp2p daemons (`--no-direct-links`);
    `heartbeat` (period, TTL): None for the defaults."""
    from node.config import SwarmConfig
    from node.local_swarm import Swarm, peers_by_stage, wait_for

    config = SwarmConfig()
    t = config.training
    stages = config.num_stages
    total = stages * peers_per_stage
    swarm = Swarm(workdir)
    try:
        t0 = time.monotonic()
        heartbeat_flags = []
        if heartbeat is not None:
            heartbeat_flags = ["--heartbeat-period", str(heartbeat[0]), "--heartbeat-ttl", str(heartbeat[1])]
        swarm.bootstrap("--num-stages", str(stages), *heartbeat_flags)
        link_flags = ["--no-direct-links"] if links == "p2pd" else []
        nodes = [
            swarm.join(
                f"peer{i}",
                *("--stage", str(i % stages), "--threads", "1", "--quiet", *link_flags),
                *(("--metrics-port", "0") if i % stages == 0 else ()),
            )
            for i in range(total)
        ]
        wait_for(
            lambda: sum(map(len, peers_by_stage(snapshot(swarm.initial_peers)).values())) == total,
            180,
            lambda: "peers never came online:\n" + "\n".join(n.log()[-1500:] for n in nodes),
            interval=1.0,
        )
        wait_for(
            lambda: any(p["loss"] is not None for p in online(snapshot(swarm.initial_peers), 0)),
            120,
            "stage 0 never reported a loss",
            interval=1.0,
        )
        startup = time.monotonic() - t0
        log(
            f"  swarm 3x{peers_per_stage}: all {total} peers online and training after {startup:.0f} s; "
            f"warm-up {warmup:.0f} s"
        )
        ports = {}
        for node in nodes[::stages]:  # the stage-0 peers
            found = METRICS_LINE.search(node.log())
            if found is None:
                raise RuntimeError(f"{node.name} printed no metrics address:\n{node.log()[-1500:]}")
            ports[node.name] = int(found.group(1))
        time.sleep(warmup)
        load_before = os.getloadavg()
        first = snapshot(swarm.initial_peers)
        threads_before = {node.name: loop_and_other_threads(node.process.pid) for node in nodes}
        cpu_before, cpu_t0 = swarm_cpu_seconds(swarm), time.monotonic()
        counts_before = {name: completed_microbatches(port) for name, port in ports.items()}
        time.sleep(window)
        counts_after = {name: completed_microbatches(port) for name, port in ports.items()}
        cpu_after, cpu_wall = swarm_cpu_seconds(swarm), time.monotonic() - cpu_t0
        threads_after = {node.name: loop_and_other_threads(node.process.pid) for node in nodes}
        last = snapshot(swarm.initial_peers)
        load_after = os.getloadavg()
        swarm.refresh_families()
        crashed = [n.name for n in swarm.nodes if n.process.poll() is not None]
        if crashed:  # e.g. someone else's cleanup signalled them: the window means nothing
            log(f"  swarm 3x{peers_per_stage}: {crashed} exited during the window; this run is INVALID")

        tokens_per_mb = t.microbatch_size * t.sequence_length
        per_peer = []
        for name in ports:
            (t0, done0), (t1, done1) = counts_before[name], counts_after[name]
            per_peer.append(
                {
                    "peer": name,
                    "microbatches": done1 - done0,
                    "seconds": t1 - t0,
                    "microbatches_per_s": (done1 - done0) / (t1 - t0),
                }
            )
        block_microbatches = {
            s: sum(p["microbatches"] for p in online(last, s)) - sum(p["microbatches"] for p in online(first, s))
            for s in range(1, stages)
        }
        microbatches_per_s = sum(p["microbatches_per_s"] for p in per_peer)
        cpu = sum(cpu_after.get(pid, 0.0) - cpu_before.get(pid, 0.0) for pid in cpu_after if pid in cpu_before)
        result = {
            "layout": f"3 stages x {peers_per_stage} peer(s)" + (", hops through p2pd" if links == "p2pd" else ""),
            "links": links,
            "cpu_seconds_window": cpu,
            "cpu_cores_used": cpu / cpu_wall,
            "cpu_ms_per_microbatch": 1e3 * cpu / cpu_wall / microbatches_per_s if microbatches_per_s else None,
            "peers_per_stage": peers_per_stage,
            "processes": 1 + total,
            "startup_seconds": startup,
            "window_seconds": window,
            "per_stage0_peer": per_peer,
            "microbatches_per_s": sum(p["microbatches_per_s"] for p in per_peer),
            "tokens_per_s": sum(p["microbatches_per_s"] for p in per_peer) * tokens_per_mb,
            "block_stage_microbatches": block_microbatches,
            "loss_end": [p["loss"] for p in online(last, 0)],
            "loadavg_window": [round(load_before[0], 2), round(load_after[0], 2)],
            "crashed": crashed,
            # per peer: event loop / other threads (its compute thread), CPU ms per swarm microbatch
            "threads_ms_per_microbatch": thread_split(threads_before, threads_after, microbatches_per_s * cpu_wall),
        }
        return result
    finally:
        swarm.close()
        leftovers = [pid for node in swarm.nodes for pid in node.alive_family()]
        if leftovers:
            log(f"  WARNING: processes left behind: {leftovers}")


# ---- report --------------------------------------------------------------------------------------


def format_report(result: dict) -> str:
    lines = ["## Swarm training throughput", ""]
    config = result["config"]
    lines.append(
        f"Model/config: defaults (hidden {config['hidden_size']}, {config['num_stages']} stages, microbatch "
        f"{config['microbatch_size']} x {config['sequence_length']} tokens = {config['tokens_per_microbatch']} "
        f"tokens, microbatches_per_step {config['microbatches_per_step']}, wire {config['wire_compression']}, "
        f"heartbeat {config['heartbeat'][0]:g} s / TTL {config['heartbeat'][1]:g} s)."
    )
    lines.append("")
    lines.append(
        "| run | processes | torch threads/process | tokens/s | microbatches/s | vs single process (1 thread) "
        "| CPU cores used | CPU ms per microbatch | CPU vs single process (1 thread) |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|")
    after = result.get("single_after")
    singles = [(r, "") for r in result["single"]] + ([(after, ", again after the swarms")] if after else [])
    references = [r for r, _ in singles if r["threads"] == 1]
    base = sum(r["tokens_per_s"] for r in references) / len(references) if references else None
    base_cpu = sum(r["cpu_ms_per_microbatch"] for r in references) / len(references) if references else None

    def versus(value: float | None, reference: float | None) -> str:
        return f"{value / reference:.2f}x" if value and reference else "-"

    for r, when in singles:
        rejected = f", {r['rejected']} rejected" if r.get("rejected") else ""
        lines.append(
            f"| single process, stages chained{when} ({r['microbatches']} microbatches in {r['seconds']:.0f} s{rejected}) "
            f"| 1 | {r['threads']} | {r['tokens_per_s']:.0f} | {r['microbatches_per_s']:.2f} "
            f"| {versus(r['tokens_per_s'], base)} | {r['cpu_cores_used']:.2f} | {r['cpu_ms_per_microbatch']:.1f} "
            f"| {versus(r['cpu_ms_per_microbatch'], base_cpu)} |"
        )
    for r in result["swarm"]:
        if r["crashed"]:
            lines.append(
                f"| swarm {r['layout']}: INVALID, peers exited during the window ({r['crashed']}) "
                f"| {r['processes']} | 1 | - | - | - | - | - | - |"
            )
            continue
        cpu = r["cpu_ms_per_microbatch"]
        lines.append(
            f"| swarm {r['layout']} ({r['window_seconds']:.0f} s window) | {r['processes']} (+{r['processes']} p2pd) "
            f"| 1 | {r['tokens_per_s']:.0f} | {r['microbatches_per_s']:.2f} | {versus(r['tokens_per_s'], base)} "
            f"| {r['cpu_cores_used']:.2f} | {f'{cpu:.1f}' if cpu else '-'} | {versus(cpu, base_cpu)} |"
        )
    lines.append("")
    if len(references) > 1:
        lines.append(
            "Ratios are against the mean of the 1-thread single process before and after the swarms "
            f"({references[0]['tokens_per_s']:.0f} and {references[-1]['tokens_per_s']:.0f} tokens/s, "
            f"{references[0]['cpu_ms_per_microbatch']:.1f} and {references[-1]['cpu_ms_per_microbatch']:.1f} ms per "
            "microbatch): the host's speed drifts over the minutes between them."
        )
        lines.append("")
    for r in result["swarm"]:
        peers = ", ".join(
            f"{p['peer']}: {p['microbatches']:.0f} mb in {p['seconds']:.1f} s" for p in r["per_stage0_peer"]
        )
        lines.append(
            f"- swarm {r['layout']}: stage-0 peers {peers}; block-stage microbatches in the window "
            f"{r['block_stage_microbatches']}; 1-min load average {r['loadavg_window'][0]} -> "
            f"{r['loadavg_window'][1]}; startup {r['startup_seconds']:.0f} s"
            + (f"; EXITED EARLY: {r['crashed']}" if r["crashed"] else "")
        )
        if r.get("threads_ms_per_microbatch"):
            lines.append(
                "  CPU ms per microbatch, event loop / other threads (the compute thread): "
                + format_thread_split(r["threads_ms_per_microbatch"])
            )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--single-seconds", type=float, default=30.0, help="timed seconds of the single-process run")
    parser.add_argument(
        "--single-threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="torch threads of the single-process runs (one run each)",
    )
    parser.add_argument("--layouts", type=int, nargs="+", default=[1, 2], help="peers per stage of each swarm run")
    parser.add_argument("--warmup", type=float, default=20.0, help="swarm seconds after the first loss, not measured")
    parser.add_argument("--window", type=float, default=60.0, help="swarm measurement window (s)")
    parser.add_argument("--workdir", help="where swarm logs go (default: a temporary directory)")
    parser.add_argument(
        "--links",
        nargs="+",
        choices=["direct", "p2pd"],
        default=["direct"],
        help="how the swarm's hops travel: direct links (as `node join` runs) and/or through p2pd only "
        "(--no-direct-links); one swarm run per layout and choice",
    )
    parser.add_argument(
        "--heartbeat-period",
        type=float,
        help="the swarm's heartbeat period in s (default: the config's, 5 s; give --heartbeat-ttl with it)",
    )
    parser.add_argument("--heartbeat-ttl", type=float, help="the swarm's record TTL in s (default: the config's, 15 s)")


def run(args: argparse.Namespace) -> dict:
    from node.config import SwarmConfig

    config = SwarmConfig()
    t = config.training
    result: dict = {
        "machine_before": machine_info(),
        "config": {
            "hidden_size": config.model.hidden_size,
            "num_stages": config.num_stages,
            "microbatch_size": t.microbatch_size,
            "sequence_length": t.sequence_length,
            "tokens_per_microbatch": t.microbatch_size * t.sequence_length,
            "microbatches_per_step": t.microbatches_per_step,
            "wire_compression": t.wire_compression,
        },
        "single": [],
        "swarm": [],
    }
    for threads in args.single_threads:
        log(f"swarm benchmark: single process, {threads} torch thread(s), {args.single_seconds:.0f} s ...")
        result["single"].append(single_process(args.single_seconds, threads))
    heartbeat = None
    if getattr(args, "heartbeat_period", None) is not None:
        heartbeat = (args.heartbeat_period, args.heartbeat_ttl or 5 * args.heartbeat_period)
    result["config"]["heartbeat"] = list(heartbeat or (config.heartbeat.period, config.heartbeat.ttl))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pipeswarm-bench-"))
    for peers in args.layouts:
        for links in args.links:
            log(f"swarm benchmark: swarm 3 stages x {peers}, {links} hops ... (logs in {workdir})")
            run_dir = workdir / f"swarm-3x{peers}-{links}"
            run_dir.mkdir(parents=True, exist_ok=True)
            result["swarm"].append(swarm_run(peers, args.warmup, args.window, run_dir, links, heartbeat))
    if 1 in args.single_threads and result["swarm"]:
        # the reference again after the swarms: the ratios take the mean of the two, which cancels a
        # linear drift of the host's speed (the swarms run minutes after the first reference)
        log(f"swarm benchmark: single process again, 1 torch thread, {args.single_seconds:.0f} s ...")
        result["single_after"] = single_process(args.single_seconds, 1)
    result["machine_after"] = machine_info()
    return result


def main(argv: list[str] | None = None) -> int:
    return script_main(__doc__, add_arguments, run, format_report, argv)


if __name__ == "__main__":
    sys.exit(main())

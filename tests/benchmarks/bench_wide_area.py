"""Stage-0 tokens/s of a 3 x 1 swarm over 100 ms RTT / 50 Mbit/s links, beside the same swarm unshaped.

Not a test: a script that prints a report (docs/benchmarks.md holds a recorded run). Needs root and
iproute2 (network namespaces); where tests/helpers/netns.py's namespaces_supported() says no, it
prints one line saying why and measures nothing.

    python tests/benchmarks/bench_wide_area.py [--wide-warmup 80] [--wide-window 60] [--wide-settle 40] \
        [--wide-resettle 15] [--wide-configs default window32 int8] [--wide-rtt-ms 100] [--wide-rate-mbit 50] \
        [--quick] [--json out.json]

Layout      A namespace test bed (tests/helpers/netns.py) with four public hosts: the bootstrap on
            `boot`, and one peer of each of the 3 stages on `s0`, `s1`, `s2` (`node join --stage s
            --threads 1 --quiet`), each with its own p2pd; heartbeat 1 s, TTL 5 s as bench_swarm.py.
Shaping     A path between two hosts adds both hosts' shaping, so every host gets RTT / 4 one-way
            delay (25 ms: 50 ms one way, 100 ms round trip per path) and a 50 Mbit/s rate (tbf, up
            and down). All four hosts are shaped, the bootstrap's too (the DHT crosses the links).
            Where the kernel has no netem the delay is the test bed's userspace delay line, a
            Python process whose CPU is reported beside the swarm's. It runs with offload
            (tests/helpers/delay_line.py): it takes TCP bursts as super-packets, as a NIC with
            TSO/GRO would, so it forwards ~20x fewer packets than at 1500 bytes each and takes far
            less of the 2 cores the swarm needs (0.30 cores before, docs/changes.md).
Procedure   One swarm per config, measured three times: after every peer is online and stage 0
            reports a loss, `--wide-warmup` seconds pass, then a `--wide-window` of unshaped links;
            then every host is shaped, `--wide-settle` seconds pass, a window of shaped links; then
            the shaping is removed, `--wide-resettle` seconds pass, a second unshaped window. The
            same swarm throughout: the same processes, placement and warmed-up workers, so only the
            links differ (a fresh swarm would add its own startup variance), and the two unshaped
            windows around the shaped one cancel a linear drift of the machine's other load. The
            settle time is longer than the in-flight window's minimum-RTT horizon (30 s,
            node/pipeline/in_flight_window.py), so an adaptive window has re-measured the round trip
            of the shaped links by then; a shorter round trip is taken at once, so unshaping needs less.
            The warm-up is long enough for the first unshaped window to be a fair reference: after
            20 s it read 28,450 and 28,960 tokens/s against 39,784 and 40,658 for the second
            (2026-11-27, two runs: a reference biased low flatters the ratio); after 80 s, 41,587
            against 40,384.
tokens/s    As bench_swarm.py: two `node status --json` snapshots (run inside `boot`) a window
            apart; stage-0 microbatches = delta of the record's `microbatches`, time = delta of
            the stage-0 record's expiration (the time between its two announcements), tokens/s =
            microbatches x microbatch_size x sequence_length / time. Ratio = shaped / (mean of the two
            unshaped windows). Beside it: CPU cores used by the swarm's processes (p2pd included), by
            the delay line, and by the whole machine (anyone's processes) during each window.
Configs     `default`: SwarmConfig(): hops in fp16, int8 while fp16 would keep a peer's uplink over
            half busy (node/pipeline/link_compression.py; the report gives each stage's encoding at
            the end of each window); the window adapts between 4 and max_in_flight 32, and every
            stage takes steps of max(2, ceil(held / 2)) microbatches, so staleness stays within
            max_staleness_steps = 2 however wide the window grows. `window16`: max_in_flight 16 (the
            default until this round), passed to `node bootstrap --config`. `fp16`: the defaults
            with slow_link_compression = fp16, so the hops stay fp16 however busy the links are.
            Only when asked for: `window32` (32, the default now), `window64` (a ceiling of 64),
            `window32-int8` and `int8` (int8 on the wire always, with a ceiling of 32 and the
            default one).
Window      The window's size is in no record or metric; stage 0 logs "in-flight window A -> B" when
            it doubled or halved since its last such line, so the report gives the last logged size
            per phase (to within a factor of 2) and its min round trip. For a fixed window, the mean
            round trip follows from Little's law: window / (microbatches/s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node.local_swarm import Swarm
    from tests.helpers.netns import TestBed

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

from tests.benchmarks.bench_swarm import (  # noqa: E402
    HEARTBEAT_PERIOD,
    HEARTBEAT_TTL,
    log,
    online,
    stage0_throughput,
    swarm_cpu_seconds,
)
from tests.benchmarks.bench_transport import machine_info, script_main  # noqa: E402

HOSTS = ("boot", "s0", "s1", "s2")
CONFIGS: dict[str, dict[str, dict[str, int | str]]] = {
    "default": {},
    # the default's ceiling until slow_link_compression came (steps grow with the window, so
    # staleness stays within max_staleness_steps whatever the ceiling)
    "window16": {"training": {"max_in_flight": 16}},
    "window32": {"training": {"max_in_flight": 32}},
    "window64": {"training": {"max_in_flight": 64}},
    # each host carries 2 activations in and 2 out per microbatch: 128 KiB each way in fp16, which
    # 50 Mbit/s caps at ~47 microbatches/s (~24k tokens/s); int8 halves the bytes
    "window32-int8": {"training": {"max_in_flight": 32, "wire_compression": "int8"}},
    "int8": {"training": {"wire_compression": "int8"}},
    # the default, never switching to int8 (what every config did before slow_link_compression)
    "fp16": {"training": {"slow_link_compression": "fp16"}},
}
DEFAULT_CONFIGS = ("default", "window16", "fp16")
TARGET_RATIO = 0.8  # issue 16: shaped tokens/s >= 0.8 x unshaped
STATUS_TIMEOUT = 120.0  # `node status` over shaped links does a few DHT round trips more slowly
WINDOW_LINE = re.compile(r"in-flight window (\d+) -> (\d+) \(min round trip ([\d.]+) s, ([\d.]+) microbatches/s\)")
# node/pipeline/link_compression.py logs each change of a peer's encoding of its hops
ENCODING_LINE = re.compile(r"pipeline hops in (\w+): ")


def write_config(path: Path, table: dict[str, dict[str, int | str]]) -> Path:
    """The TOML `node bootstrap --config` reads (sections of integer and plain string keys)."""
    text = "".join(
        f"[{section}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
        for section, keys in table.items()
    )
    path.write_text(text)
    return path


def window_lines(text: str) -> list[dict]:
    """The stage-0 peer's logged window changes, in order."""
    return [
        {"from": int(a), "to": int(b), "min_rtt": float(rtt), "rate": float(rate)}
        for a, b, rtt, rate in WINDOW_LINE.findall(text)
    ]


def encodings(peers: list, usual: str) -> list[str]:
    """The encoding each stage's hops were last logged in (`usual` until a change is logged)."""
    return [(ENCODING_LINE.findall(peer.log()) or [usual])[-1] for peer in peers]


def process_cpu(pid: int | None) -> float | None:
    import psutil

    if pid is None:
        return None
    try:
        times = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return None
    return times.user + times.system


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (all processes, anyone's)."""
    import psutil

    times = psutil.cpu_times()._asdict()
    # guest time is already inside user time; steal is the hypervisor's, not this machine's work
    return sum(times.values()) - sum(times.get(k, 0.0) for k in ("idle", "iowait", "steal", "guest", "guest_nice"))


def measure(swarm: Swarm, bed: TestBed, window: float, tokens_per_mb: int) -> dict:
    """Stage-0 throughput over one window, with the CPU the swarm and the delay line used meanwhile."""
    launcher = bed.launcher("boot")
    load_before = os.getloadavg()
    first = swarm.status(launcher=launcher, timeout=STATUS_TIMEOUT)
    cpu_before, line_before, line_stats0, busy_before, t0 = (
        swarm_cpu_seconds(swarm),
        process_cpu(bed.delay_line_pid()),
        bed.delay_line_stats(),
        machine_busy_seconds(),
        time.monotonic(),
    )
    time.sleep(window)
    cpu_after, line_after, line_stats1, busy_after = (
        swarm_cpu_seconds(swarm),
        process_cpu(bed.delay_line_pid()),
        bed.delay_line_stats(),
        machine_busy_seconds(),
    )
    wall = time.monotonic() - t0
    last = swarm.status(launcher=launcher, timeout=STATUS_TIMEOUT)
    per_peer = stage0_throughput(first, last)
    microbatches_per_s = sum(p["microbatches_per_s"] for p in per_peer)
    cpu = sum(cpu_after[pid] - cpu_before[pid] for pid in cpu_after if pid in cpu_before)
    line_cpu = line_after - line_before if line_before is not None and line_after is not None else None
    return {
        "per_stage0_peer": per_peer,
        "microbatches_per_s": microbatches_per_s,
        "tokens_per_s": microbatches_per_s * tokens_per_mb,
        # between the two announcements read: the window plus the time `node status` took
        "seconds": max((p["seconds"] for p in per_peer), default=0.0),
        "swarm_cpu_cores": cpu / wall,
        "delay_line_cpu_cores": line_cpu / wall if line_cpu is not None else None,
        # every process on the machine, ours and other people's: what is left of the 2 cores
        "machine_cpu_cores": (busy_after - busy_before) / wall,
        "delay_line_packets": {k: line_stats1[k] - line_stats0.get(k, 0) for k in ("forwarded", "lost", "overflow")}
        if line_stats1
        else None,
        "loss_end": [p["loss"] for p in online(last, 0)],
        "loadavg": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }


def config_run(name: str, table: dict, args: argparse.Namespace, workdir: Path) -> dict:
    from node.local_swarm import wait_for
    from node.model.presets import load_config
    from tests.helpers.netns import TestBed
    from tests.helpers.swarms import make_swarm, peer_id_of

    config_args: list[str] = []
    if table:
        config_args = ["--config", str(write_config(workdir / "swarm.toml", table))]
    config = load_config(config_args[1] if config_args else None)
    t = config.training
    tokens_per_mb = t.microbatch_size * t.sequence_length
    per_host_delay, per_host_rate = args.wide_rtt_ms / 4, args.wide_rate_mbit
    with TestBed(offload=True) as bed:
        for host in HOSTS:
            bed.add_public_host(host)
        swarm = make_swarm(workdir)
        try:
            t0 = time.monotonic()
            swarm.bootstrap(
                *("--num-stages", "3", "--heartbeat-period", str(HEARTBEAT_PERIOD)),
                *("--heartbeat-ttl", str(HEARTBEAT_TTL), *config_args),
                host=bed.address("boot"),
                launcher=bed.launcher("boot"),
                timeout=90,
            )
            peers = [
                swarm.join(
                    f"stage{stage}",
                    *("--stage", str(stage), "--threads", "1", "--quiet", "--join-jitter", "0"),
                    host=bed.address(f"s{stage}"),
                    launcher=bed.launcher(f"s{stage}"),
                )
                for stage in range(3)
            ]
            wait_for(
                lambda: all(map(peer_id_of, peers)),
                180,
                lambda: "peers never joined:\n" + "\n".join(f"--- {p.name}\n{p.log()[-1500:]}" for p in peers),
                interval=1.0,
            )
            wait_for(
                lambda: any(
                    p["loss"] is not None for p in online(swarm.status(launcher=bed.launcher("boot"), timeout=60), 0)
                ),
                180,
                "stage 0 never reported a loss",
                interval=2.0,
            )
            startup = time.monotonic() - t0
            log(f"  wide-area {name}: 3 peers training after {startup:.0f} s; warm-up {args.wide_warmup:.0f} s")
            time.sleep(args.wide_warmup)
            phases: dict[str, dict] = {}
            logged = 0
            # unshaped, shaped, unshaped again: the machine's other load drifts, and the mean of the two
            # unshaped windows around the shaped one cancels a linear drift
            for phase, shaped in (("unshaped", False), ("shaped", True), ("unshaped again", False)):
                if phase != "unshaped":
                    for host in HOSTS:
                        if shaped:
                            bed.shape(host, delay_ms=per_host_delay, rate_mbit=per_host_rate)
                        else:
                            bed.shape(host)
                    time.sleep(args.wide_settle if shaped else args.wide_resettle)
                result = measure(swarm, bed, args.wide_window, tokens_per_mb)
                window_log = window_lines(peers[0].log())
                # the size this phase began with: the last one logged before it, else the floor it starts at
                result["window_at_start"] = window_log[logged - 1]["to"] if logged else t.min_in_flight
                result["window_log"], logged = window_log[logged:], len(window_log)
                result["encodings"] = encodings(peers, str(t.wire_compression))  # per stage, at the end of the window
                phases[phase] = result
                log(f"  wide-area {name}: {phase} {result['tokens_per_s']:.0f} tokens/s")
            swarm.refresh_families()
            crashed = [n.name for n in swarm.nodes if n.process.poll() is not None]
            tracebacks = [n.name for n in swarm.nodes if "Traceback" in n.log()]
            netem = bed.delay_line_pid() is None  # the bed starts a delay line only where netem is missing
        finally:
            swarm.close()
            leftovers = [pid for node in swarm.nodes for pid in node.alive_family()]
            if leftovers:
                log(f"  WARNING: processes left behind: {leftovers}")
    for phase in phases.values():
        # Little's law needs the window's size: known only when it cannot move
        fixed = t.min_in_flight == t.max_in_flight
        phase["implied_round_trip_s"] = (
            t.max_in_flight / phase["microbatches_per_s"] if fixed and phase["microbatches_per_s"] else None
        )
    unshaped = (phases["unshaped"]["tokens_per_s"] + phases["unshaped again"]["tokens_per_s"]) / 2
    return {
        "config": name,
        "overrides": table,
        "min_in_flight": t.min_in_flight,
        "max_in_flight": t.max_in_flight,
        "microbatches_per_step": t.microbatches_per_step,
        "wire_compression": str(t.wire_compression),
        "slow_link_compression": str(t.slow_link_compression),
        "staleness_steps": t.max_staleness_steps,
        "tokens_per_microbatch": tokens_per_mb,
        "startup_seconds": startup,
        "phases": phases,
        "unshaped_tokens_per_s": unshaped,
        "ratio": phases["shaped"]["tokens_per_s"] / unshaped if unshaped else None,
        "crashed": crashed,
        "tracebacks": tracebacks,
        "per_host_delay_ms": per_host_delay,
        "per_host_rate_mbit": per_host_rate,
        "netem": netem,
    }


# ---- report --------------------------------------------------------------------------------------


def _window(phase: dict, result: dict) -> str:
    if result["min_in_flight"] == result["max_in_flight"]:
        return f"{result['max_in_flight']} (fixed)"
    lines = phase["window_log"]
    if not lines:
        return f"no change logged: about {phase['window_at_start']} (within 2x)"
    last = lines[-1]
    return f"last logged {last['from']} -> {last['to']} (min RTT {last['min_rtt']:.2f} s)"


def format_report(result: dict) -> str:
    lines = ["## Wide-area: 3 x 1 over 100 ms RTT / 50 Mbit/s", ""]
    if result.get("skipped"):
        lines.append(f"Wide-area (3 x 1 swarm over shaped namespace links): skipped, {result['skipped']}.")
        return "\n".join(lines)
    runs = result["runs"]
    if runs:
        r = runs[0]
        lines.append(
            f"One public host each for the bootstrap and the 3 stages; every host {r['per_host_delay_ms']:g} ms one "
            f"way and {r['per_host_rate_mbit']:g} Mbit/s, so {4 * r['per_host_delay_ms']:g} ms RTT per path; delay by "
            f"{'netem' if r['netem'] else 'the userspace delay line'}. The same swarm unshaped, shaped "
            f"({result['settle']:.0f} s settle), unshaped again ({result['resettle']:.0f} s settle); "
            f"{result['window']:.0f} s windows, tokens/s over the time between the stage-0 announcements read "
            f"('in N s'). Ratio = shaped / mean of the two unshaped. Target: >= {TARGET_RATIO}x."
        )
        lines.append("")
    lines.append("| config | staleness (steps) | unshaped tokens/s (mean) | shaped tokens/s | ratio | target |")
    lines.append("|---|---|---|---|---|---|")
    for r in runs:
        invalid = r["crashed"] or r["tracebacks"]
        met = r["ratio"] is not None and r["ratio"] >= TARGET_RATIO
        verdict = "INVALID" if invalid else ("met" if met else "NOT met")
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        lines.append(
            f"| {r['config']} (max_in_flight {r['max_in_flight']}, microbatches_per_step {r['microbatches_per_step']}, "
            f"wire {r.get('wire_compression', 'fp16')}, {r.get('slow_link_compression', 'fp16')} while links are busy) "
            f"| {r['staleness_steps']:g} | {r['unshaped_tokens_per_s']:.0f} "
            f"| {r['phases']['shaped']['tokens_per_s']:.0f} | {ratio} | {verdict} |"
        )
    lines.append("")
    lines.append(
        "| config | phase | stage-0 tokens/s | in-flight window | round trip (Little's law) | hops of stages 0/1/2 in "
        "| swarm CPU cores | delay line CPU cores | machine CPU cores (all processes) | 1-min load |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        for name, phase in r["phases"].items():
            rtt = phase["implied_round_trip_s"]
            line_cpu = phase["delay_line_cpu_cores"]
            lines.append(
                f"| {r['config']} | {name} | {phase['tokens_per_s']:.0f} in {phase['seconds']:.0f} s "
                f"| {_window(phase, r)} | {f'{1e3 * rtt:.0f} ms' if rtt else '-'} "
                f"| {' / '.join(phase.get('encodings', ['-']))} | {phase['swarm_cpu_cores']:.2f} "
                f"| {f'{line_cpu:.2f}' if line_cpu is not None else '-'} | {phase['machine_cpu_cores']:.2f} "
                f"| {phase['loadavg'][0]} -> {phase['loadavg'][1]} |"
            )
    lines.append("")
    for r in runs:
        packets = r["phases"]["shaped"]["delay_line_packets"]
        lines.append(
            f"- {r['config']}: startup {r['startup_seconds']:.0f} s; stage-0 loss at the end "
            f"{[round(x, 3) for x in r['phases']['unshaped again']['loss_end'] if x is not None]}"
            + (f"; delay line while shaped {packets}" if packets else "")
            + (f"; EXITED: {r['crashed']}" if r["crashed"] else "")
            + (f"; Traceback in the logs of {r['tracebacks']}" if r["tracebacks"] else "")
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--wide-warmup", type=float, default=80.0, help="wide-area: seconds after the first loss, not measured"
    )
    parser.add_argument("--wide-window", type=float, default=60.0, help="wide-area: each measurement window (s)")
    parser.add_argument(
        "--wide-settle",
        type=float,
        default=40.0,
        help="wide-area: seconds between shaping and the shaped window (keep > 30 s, the window's min-RTT horizon)",
    )
    parser.add_argument(
        "--wide-resettle", type=float, default=15.0, help="wide-area: seconds between unshaping and the last window"
    )
    parser.add_argument(
        "--wide-configs",
        nargs="+",
        choices=sorted(CONFIGS),
        default=list(DEFAULT_CONFIGS),
        help="wide-area: configs to run, in order",
    )
    parser.add_argument(
        "--wide-rtt-ms", type=float, default=100.0, help="wide-area: round trip of a path between two hosts"
    )
    parser.add_argument("--wide-rate-mbit", type=float, default=50.0, help="wide-area: rate of every host's link")
    parser.add_argument("--wide-workdir", help="wide-area: where swarm logs go (default: a temporary directory)")


def apply_quick(args: argparse.Namespace) -> None:
    """A smoke run's timings: both configs, shorter warm-up and windows; the settle time stays past the
    window's 30 s min-RTT horizon, or the adaptive config would be measured before it adapted."""
    args.wide_warmup, args.wide_window, args.wide_settle, args.wide_resettle = 5.0, 15.0, 35.0, 10.0


def _standalone_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="smoke timings: 5 s warm-up, 15 s windows, 35 s settle")


def run(args: argparse.Namespace) -> dict:
    from tests.helpers.netns import namespaces_supported

    if getattr(args, "quick", False):
        apply_quick(args)
    result: dict = {
        "machine_before": machine_info(),
        "window": args.wide_window,
        "settle": args.wide_settle,
        "resettle": args.wide_resettle,
    }
    ok, why = namespaces_supported()
    if not ok:
        result.update(skipped=why, runs=[], machine_after=machine_info())
        return result
    workdir = Path(args.wide_workdir or tempfile.mkdtemp(prefix="pipeswarm-bench-wide-"))
    result["runs"] = []
    for name in args.wide_configs:
        log(f"wide-area benchmark: 3x1 swarm, config {name} ... (logs in {workdir / name})")
        run_dir = workdir / name
        run_dir.mkdir(parents=True, exist_ok=True)
        result["runs"].append(config_run(name, CONFIGS[name], args, run_dir))
    result["machine_after"] = machine_info()
    return result


def main(argv: list[str] | None = None) -> int:
    return script_main(__doc__, _standalone_arguments, run, format_report, argv)


if __name__ == "__main__":
    sys.exit(main())

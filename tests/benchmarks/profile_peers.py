"""Where a running swarm's CPU goes, per peer: Python vs its p2pd (psutil), and a py-spy profile of
each peer's Python process split by what the code does (docs/benchmarks.md, "A pipeline hop's cost
on one host").

Not a test: attach it to a swarm that `bench_swarm.py --workdir DIR` (or anything using
node/local_swarm.py) runs, while it trains:

    python tests/benchmarks/profile_peers.py DIR [--seconds 25] [--out OUT]

py-spy is not a dependency: install it anywhere (`pip install --target /tmp/pyspy py-spy`) and pass
`--py-spy /tmp/pyspy/bin/py-spy`; without it only the psutil CPU split is printed. Peers are found
as `node join --stage S` processes whose working directory is under DIR. py-spy's shares are of
non-idle samples: a thread runnable but waiting for a core counts as active, so on a loaded
machine read them as shares of activity and take CPU seconds from the psutil lines.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time
from enum import StrEnum
from pathlib import Path

import psutil


class Category(StrEnum):
    TORCH = "torch compute (stage worker thread)"
    CODEC = "protocol/ codec (encode/decode, framing, MAC)"
    BINDINGS = "hivemind's p2pd bindings (Python side)"
    DHT = "DHT (hivemind DHT, dht/ records and signing)"
    TRANSPORT = "node/p2p: metering, conduct, transport, channels"
    PIPELINE = "node/pipeline, node/stage: handlers, routing, admission"
    NODE = "other node code"
    TORCH_ON_LOOP = "torch on the event loop thread"
    LOOP = "event loop (uvloop C code, asyncio)"
    OTHER = "other (main thread)"


# (path fragment of a frame's file, category), tried from the innermost frame outwards: the first
# frame that belongs to one of these says what the sample was doing
RULES: tuple[tuple[str, Category], ...] = (
    ("protocol/", Category.CODEC),
    ("hivemind/p2p", Category.BINDINGS),
    ("hivemind/dht", Category.DHT),
    ("dht/", Category.DHT),
    ("node/p2p/", Category.TRANSPORT),
    ("node/pipeline/", Category.PIPELINE),
    ("node/stage/", Category.PIPELINE),  # the wire-input checks (admission.py) moved there
    ("node/", Category.NODE),
    ("torch/", Category.TORCH_ON_LOOP),
    ("asyncio/", Category.LOOP),
    ("uvloop", Category.LOOP),
)
_FRAME_FILE = re.compile(r"\(([^)]*)\)\s*$")


def classify(thread: str, frames: list[str]) -> Category:
    if "worker" in thread:  # StageWorker's thread is named stage<k>-worker
        return Category.TORCH
    for frame in reversed(frames):
        match = _FRAME_FILE.search(frame)
        path = match.group(1) if match else frame
        for fragment, category in RULES:
            if fragment in path:
                return category
    return Category.OTHER


def summarize(raw: Path) -> dict:
    """Shares of samples per category and the hottest innermost main-thread frames, from py-spy's
    `--format raw --threads` output (one `thread;frame;...;frame count` line per stack)."""
    categories: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        samples = int(count)
        total += samples
        categories[classify(thread, frames)] += samples
        if "worker" not in thread and frames:
            leaves[frames[-1]] += samples
    share = {name: round(100 * n / max(total, 1), 1) for name, n in categories.most_common()}
    hottest = {name: round(100 * n / max(total, 1), 1) for name, n in leaves.most_common(10)}
    return {"samples": total, "percent": share, "hottest_main_thread_frames": hottest}


def find_peers(workdir: Path) -> dict[int, psutil.Process]:
    peers = {}
    for process in psutil.process_iter(["cmdline", "cwd"]):
        try:
            command, cwd = process.info["cmdline"] or [], process.info["cwd"] or ""
            if cwd.startswith(str(workdir)) and "join" in command and "--stage" in command:
                peers[int(command[command.index("--stage") + 1])] = process
        except (psutil.Error, ValueError, IndexError):
            continue
    return peers


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def threads(process: psutil.Process) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in process.threads()}


def profile(workdir: Path, seconds: float, out: Path, py_spy: str | None) -> dict:
    peers = find_peers(workdir)
    if not peers:
        raise SystemExit(f"no `node join --stage` process runs under {workdir}")
    daemons = {s: [c for c in p.children(recursive=True) if "p2pd" in c.name()] for s, p in peers.items()}
    before = {s: (cpu_seconds(p), sum(map(cpu_seconds, daemons[s])), threads(p)) for s, p in peers.items()}
    started = time.monotonic()
    spies = []
    if py_spy:
        out.mkdir(parents=True, exist_ok=True)
        for stage, process in peers.items():
            command = [py_spy, "record", "--pid", str(process.pid), "--duration", str(int(seconds)), "--rate", "200"]
            command += ["--format", "raw", "--threads", "--nonblocking", "-o", str(out / f"stage{stage}.txt")]
            spies.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for spy in spies:
            spy.wait()
    else:
        time.sleep(seconds)
    wall = time.monotonic() - started
    result: dict = {"loadavg": [round(x, 2) for x in os.getloadavg()], "seconds": round(wall, 1), "stages": {}}
    for stage, process in sorted(peers.items()):
        python0, daemon0, threads0 = before[stage]
        entry = {
            "python_cpu_s": round(cpu_seconds(process) - python0, 2),
            "p2pd_cpu_s": round(sum(map(cpu_seconds, daemons[stage])) - daemon0, 2),
            "thread_cpu_s": {tid: round(t - threads0.get(tid, 0.0), 2) for tid, t in threads(process).items()},
        }
        if py_spy and (out / f"stage{stage}.txt").exists():
            entry["py_spy"] = summarize(out / f"stage{stage}.txt")
        result["stages"][stage] = entry
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir", type=Path, help="the swarm's work directory (bench_swarm.py --workdir)")
    parser.add_argument("--seconds", type=float, default=25.0, help="how long to watch")
    parser.add_argument("--out", type=Path, default=Path("profile-out"), help="where py-spy's raw stacks go")
    parser.add_argument("--py-spy", help="path of a py-spy executable (none: psutil only)")
    args = parser.parse_args(argv)
    result = profile(args.workdir.resolve(), args.seconds, args.out, args.py_spy)
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

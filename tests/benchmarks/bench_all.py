"""The benchmarks in one run, one report (the tables docs/benchmarks.md records).

    python tests/benchmarks/bench_all.py [--quick] [--json out.json] \
        [flags of bench_transport / bench_swarm / bench_wide_area]

Runs the transport benchmark first (two peers in this process), then the swarm benchmark (single
process, then the multi-process swarms), then the floor of any three-process pipeline here (the same
workers on raw loopback TCP, bench_floor.py), then the wide-area one (a 3 x 1 swarm in network
namespaces, unshaped then over 100 ms RTT / 50 Mbit/s links; it needs root and iproute2 and says
why it skipped without them), and last the wire at real size (bench_wire.py: the 15m preset per hop
codec over the same links, its last line the `wire:` summary); nothing runs concurrently with anything else started here.
--quick shortens every timing (a smoke run: the figures are noisier).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.benchmarks import bench_floor, bench_swarm, bench_transport, bench_wide_area, bench_wire  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_transport.add_arguments(parser)
    bench_swarm.add_arguments(parser)
    bench_floor.add_arguments(parser)
    bench_wide_area.add_arguments(parser)
    bench_wire.add_arguments(parser)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short timings: 2 s per transport case, 10 s single process, 3x1 swarm only, 30 s window; "
        "the floor 15 s per run; wide-area 15 s windows after a 35 s settle; the wire: subspace8 alone, 30 s",
    )
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args(argv)
    bench_transport.end_through_cleanups_on_sigterm()
    if args.quick:
        args.seconds, args.min_reps = 2.0, 10
        args.single_seconds, args.single_threads = 10.0, [1]
        args.layouts, args.warmup, args.window = [1], 10.0, 30.0
        args.floor_seconds, args.floor_warmup, args.floor_windows, args.floor_single_seconds = 15.0, 5.0, [16], 10.0

    transport = bench_transport.run(args)
    swarm = bench_swarm.run(args)
    floor = bench_floor.run(args)
    wide_area = bench_wide_area.run(args)  # applies its own --quick timings
    wire = bench_wire.run(args)  # and this one too
    m0, m1 = transport["machine_before"], wire["machine_after"]
    print("# pipeswarm benchmarks")
    print()
    print(f"machine: {m0['nproc']} CPUs, {m0['cpu']}; python {m0['python']}, torch {m0['torch']}; started {m0['time']}")
    print(
        f"load average (1, 5, 15 min): {m0['loadavg']} at start, {transport['machine_after']['loadavg']} after the "
        f"transport part, {swarm['machine_after']['loadavg']} after the swarm part, {m1['loadavg']} at the end"
    )
    print()
    print(bench_swarm.format_report(swarm))
    print()
    print(bench_floor.format_report(floor))
    print()
    print(bench_transport.format_report(transport))
    print()
    print(bench_wide_area.format_report(wide_area))
    print()
    print(bench_wire.format_report(wire))
    if args.json:
        results = {"transport": transport, "swarm": swarm, "floor": floor, "wide_area": wide_area, "wire": wire}
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

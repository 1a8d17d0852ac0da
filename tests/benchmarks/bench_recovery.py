"""Recovery time: from the death of a stage's last peer to the first microbatch through the rebuilt stage.

    python tests/benchmarks/bench_recovery.py [--repeats N] [--scenarios joiner move edge]

Real multi-process swarms on loopback (tiny model, 1 thread per peer, heartbeat 1 s / TTL 4 s,
lost_grace 2 s, rebalance_wait 3 s; the config of tests/swarm/test_swarm_recovery.py). Scenarios:
  joiner  4 stages x 1 peer; stage 2 is killed (kill -9, p2pd included) and a new `--stage auto`
          peer is started at that moment: it rebuilds stage 2 by the CheckFree average
  move    3 stages, peers 0, 1, 2, 2; stage 1 is killed and nobody joins: after lost_grace +
          rebalance_wait a stage-2 peer moves and rebuilds stage 1 (CheckFree+ copy of stage 2)
  edge    3 stages x 1 peer; stage 0 is killed and a new `--stage auto` peer rebuilds it from the
          edge copies kept by stages 1 and 2
The end time is the wall-clock time the rebuilt peer logs for its first finished microbatch
("RECOVERED ..."); the rebuild itself (fetch + average + load) is reported by the same peer.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from node.local_swarm import Swarm  # noqa: E402
from tests.helpers.swarms import SHORT_JOIN_JITTER, join_peer  # noqa: E402
from tests.swarm.test_swarm_recovery import (  # noqa: E402
    kill_stage,
    rebuild_dump,
    recovery_seconds,
    start_training_swarm,
)

SCENARIOS = {
    # name: (num_stages, stages of the initial peers, stage killed, a joiner is started)
    "joiner": (4, [0, 1, 2, 3], 2, True),
    "move": (3, [0, 1, 2, 2], 1, False),
    "edge": (3, [0, 1, 2], 0, True),
}
REBUILD_LINE = re.compile(r"rebuilt (stage \d+ by .*?) in ([0-9.]+) s")


def run_once(name: str) -> dict:
    num_stages, stages, victim_stage, with_joiner = SCENARIOS[name]
    with tempfile.TemporaryDirectory(prefix=f"bench-recovery-{name}-") as workdir:
        swarm = Swarm(Path(workdir))
        try:
            nodes = start_training_swarm(swarm, num_stages, stages)
            victims = [n for n, s in zip(nodes, stages) if s == victim_stage]
            killed_at = kill_stage(swarm, victims)
            if with_joiner:
                join_peer(swarm, "joiner", "auto", *SHORT_JOIN_JITTER)
            rebuild_dump(swarm, victim_stage, timeout=120)
            rebuilt_by = next(n for n in swarm.nodes if REBUILD_LINE.search(n.log()))
            seconds = recovery_seconds(rebuilt_by, victim_stage, killed_at)
            detail, rebuild_seconds = REBUILD_LINE.search(rebuilt_by.log()).groups()
            return {
                "scenario": name,
                "recovery_s": seconds,
                "rebuild_s": float(rebuild_seconds),
                "detail": detail,
                "rebuilt_by": rebuilt_by.name,
            }
        finally:
            swarm.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    args = parser.parse_args(argv)
    load = os.getloadavg()
    print(
        f"machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, python "
        f"{platform.python_version()}; load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    print()
    print("| scenario | rebuilt by | how | rebuild (fetch+compute+load) | death -> first microbatch |")
    print("|---|---|---|---|---|")
    for name in args.scenarios:
        for _ in range(args.repeats):
            r = run_once(name)
            how = r["detail"].replace("|", "\\|")  # |g| would split a markdown cell
            print(
                f"| {r['scenario']} | {r['rebuilt_by']} | {how} | {r['rebuild_s']:.2f} s | {r['recovery_s']:.1f} s |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

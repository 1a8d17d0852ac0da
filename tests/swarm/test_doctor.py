"""`node doctor` against a real swarm on loopback: ready when a join would work, one clear failed
line and a non-zero exit when it would not."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from node.local_swarm import Swarm, peers_by_stage, wait_for


def doctor(swarm: Swarm, *args: str, initial_peers: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "node",
            "--log-level",
            "WARNING",
            "doctor",
            "--host",
            "127.0.0.1",
            "--initial-peers",
            *(initial_peers or swarm.initial_peers),
            *args,
        ],
        capture_output=True,
        text=True,
        env=swarm.env,
        cwd=swarm.workdir,
        timeout=120,
    )


def lines_by_check(output: str) -> dict[str, str]:
    """{check name: its line} from doctor's "[outcome] name ..." lines."""
    found = {}
    for line in output.splitlines():
        if line.startswith("[") and "]" in line:
            found[line.split("]", 1)[1].split()[0]] = line
    return found


@pytest.mark.timeout(300)
def test_doctor_says_ready_for_a_live_swarm_and_names_what_is_wrong_otherwise(swarm: Swarm):
    swarm.bootstrap("--num-stages", "3", "--heartbeat-period", "1", "--heartbeat-ttl", "5")
    swarm.join("peer1", "--stage", "1", "--no-train")
    wait_for(lambda: peers_by_stage(swarm.observe()).get(1), 120, "the stage-1 peer never came online")

    ready = doctor(swarm)
    assert ready.returncode == 0, ready.stdout + ready.stderr
    checks = lines_by_check(ready.stdout)
    assert set(checks) >= {"port", "daemon", "peers", "versions", "swarm", "clock", "reachability", "memory"}, (
        ready.stdout
    )
    assert all(line.startswith("[  ok]") for line in checks.values()), ready.stdout
    assert "1 of 1 initial peer(s) answer" in checks["peers"]
    assert "stage 0 needs" in checks["memory"] or "stage 2 needs" in checks["memory"]  # an empty stage
    assert ready.stdout.strip().endswith("ready to join")
    assert "Traceback" not in ready.stderr

    with socket.socket() as holder:  # the port the user asked for is taken
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = doctor(swarm, "--port", str(holder.getsockname()[1]))
    assert busy.returncode == 1 and "[fail] port" in busy.stdout and "not ready to join" in busy.stdout
    assert "Traceback" not in busy.stderr

    # a stage this swarm does not have
    wrong_stage = doctor(swarm, "--stage", "9")
    assert wrong_stage.returncode == 1 and "[fail] memory" in wrong_stage.stdout, wrong_stage.stdout

    # initial peers nobody answers at: a free port on loopback under the bootstrapper's peer id
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    bootstrap_id = swarm.initial_peers[0].rsplit("/p2p/", 1)[1]
    dead = doctor(swarm, initial_peers=[f"/ip4/127.0.0.1/tcp/{dead_port}/p2p/{bootstrap_id}"])
    assert dead.returncode == 1, dead.stdout + dead.stderr
    assert "[  ok] daemon" in dead.stdout and "[fail] peers" in dead.stdout
    assert "Traceback" not in dead.stderr

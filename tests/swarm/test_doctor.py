"""`node doctor` against a real swarm on loopback: ready when a join would work, one clear failed
line and a non-zero exit when it would not."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from node.local_swarm import Swarm, peers_by_stage, wait_for
from tests.helpers.swarms import bootstrap_fast

# a node of another protocol version: the same code with PROTOCOL_VERSION patched before it runs
OTHER_VERSION = [
    "-c",
    "import sys, protocol.version as v; v.PROTOCOL_VERSION = 99; from node.cli import main; sys.exit(main())",
]
# a stage of ~830 GiB (64 layers of width 4096 in one block stage): no machine of this project holds it
HUGE_MODEL = """num_stages = 2
[model]
hidden_size = 4096
intermediate_size = 11008
num_attention_heads = 32
num_key_value_heads = 32
layers_per_stage = 64
"""


def doctor(
    swarm: Swarm, *args: str, initial_peers: list[str] | None = None, prefix: list[str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            *(prefix or ["-m", "node"]),
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
    bootstrap_fast(swarm, 3)
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

    # software of another protocol version: named, with what to do
    other = doctor(swarm, prefix=OTHER_VERSION)
    assert other.returncode == 1, other.stdout + other.stderr
    versions = lines_by_check(other.stdout)["versions"]
    assert versions.startswith("[fail]") and "protocol 99 (swarm " in versions and "install" in versions
    assert "Traceback" not in other.stderr


@pytest.mark.timeout(180)
def test_doctor_refuses_a_stage_the_device_cannot_hold(swarm: Swarm):
    config = swarm.workdir / "huge.toml"
    config.write_text(HUGE_MODEL)
    swarm.bootstrap("--config", str(config))
    result = doctor(swarm, "--stage", "1", "--device", "cpu")
    assert result.returncode == 1, result.stdout + result.stderr
    memory = lines_by_check(result.stdout)["memory"]
    assert memory.startswith("[fail]") and "stage 1 needs about" in memory and "GiB" in memory, result.stdout
    assert "not ready to join" in result.stdout and "Traceback" not in result.stderr

"""A private swarm on loopback: members share a key made by `node keygen`; they train, and a joiner
with no key or the wrong key is refused with one clear line and a non-zero exit code."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from node.local_swarm import Swarm, peers_by_stage, wait_for
from node.p2p.swarm_key import ENV_VAR
from tests.helpers.swarms import bootstrap_fast, join_peer, wait_online


def keygen(swarm: Swarm, path: Path) -> subprocess.CompletedProcess[str]:
    """`node keygen --swarm-key path`, in the swarm's environment."""
    return subprocess.run(
        [sys.executable, "-m", "node", "keygen", "--swarm-key", str(path)],
        capture_output=True,
        text=True,
        env=swarm.env,
        timeout=60,
    )


def stage0_steps(swarm: Swarm) -> int:
    snapshot = swarm.observe()
    return sum(p["inner_step"] for p in snapshot["stages"][0]["peers"] if p["state"] == "online")


@pytest.mark.timeout(420)
def test_private_swarm_trains_with_the_key_and_refuses_joiners_without_it(swarm: Swarm, tmp_path):
    swarm.env.pop(ENV_VAR, None)  # this test hands out the keys itself (also under `make test-private`)
    key, wrong = tmp_path / "swarm.key", tmp_path / "wrong.key"
    for path in (key, wrong):
        made = keygen(swarm, path)
        assert made.returncode == 0 and "fingerprint" in made.stdout, made.stderr
    again = keygen(swarm, key)
    assert again.returncode == 2 and "exists already" in again.stderr and "Traceback" not in again.stderr

    bootstrap_fast(swarm, 3, extra=("--swarm-key", str(key)))
    members = [join_peer(swarm, f"peer{i}", i, "--swarm-key", str(key)) for i in range(3)]
    wait_online(swarm, 3, 150, members)
    first = wait_for(lambda: (steps := stage0_steps(swarm)) > 0 and steps, 120, "the private swarm never trained")

    keyless = swarm.join("keyless", "--stage", "auto", "--find-timeout", "20")
    wrong_key = swarm.join("wrong-key", "--stage", "auto", "--find-timeout", "20", "--swarm-key", str(wrong))
    for stranger, expected in ((keyless, "is private"), (wrong_key, "swarm key")):
        code = stranger.process.wait(timeout=120)
        log = stranger.log()
        assert code != 0, log
        assert expected in log and "refusing to join" in log, log
        assert "Traceback" not in log, log

    # the strangers never became members, and the members kept training meanwhile
    ids = {
        pid for stage in peers_by_stage(swarm.observe(), ("online", "joining", "rebuilding")).values() for pid in stage
    }
    assert len(ids) == 3, ids
    wait_for(lambda: stage0_steps(swarm) > first, 90, "training stopped while strangers tried to join")
    for member in members:
        assert member.process.poll() is None and "Traceback" not in member.log(), member.log()[-2000:]

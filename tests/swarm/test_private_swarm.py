"""A private swarm on loopback: members share a key made by `node keygen`; they train, and a joiner
with no key or the wrong key is refused with one clear line and a non-zero exit code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from node.local_swarm import Swarm, peers_by_stage, wait_for
from node.p2p.swarm_key import ENV_VAR


def stage0_steps(swarm: Swarm) -> int:
    snapshot = swarm.observe()
    return sum(p["inner_step"] for p in snapshot["stages"][0]["peers"] if p["state"] == "online")


@pytest.mark.timeout(420)
def test_private_swarm_trains_with_the_key_and_refuses_joiners_without_it(swarm: Swarm, tmp_path):
    swarm.env.pop(ENV_VAR, None)  # this test hands out the keys itself (also under `make test-private`)
    key, wrong = tmp_path / "swarm.key", tmp_path / "wrong.key"
    for path in (key, wrong):
        made = subprocess.run(
            [sys.executable, "-m", "node", "keygen", "--swarm-key", str(path)],
            capture_output=True,
            text=True,
            env=swarm.env,
            timeout=60,
        )
        assert made.returncode == 0 and "fingerprint" in made.stdout, made.stderr
    again = subprocess.run(
        [sys.executable, "-m", "node", "keygen", "--swarm-key", str(key)],
        capture_output=True,
        text=True,
        env=swarm.env,
        timeout=60,
    )
    assert again.returncode == 2 and "exists already" in again.stderr and "Traceback" not in again.stderr

    swarm.bootstrap("--num-stages", "3", "--heartbeat-period", "1", "--heartbeat-ttl", "5", "--swarm-key", str(key))
    members = [
        swarm.join(f"peer{i}", "--stage", str(i), "--threads", "1", "--quiet", "--swarm-key", str(key))
        for i in range(3)
    ]
    wait_for(
        lambda: sum(map(len, peers_by_stage(swarm.observe()).values())) == 3,
        150,
        lambda: "members never came online:\n" + "\n".join(n.log()[-1500:] for n in members),
    )
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

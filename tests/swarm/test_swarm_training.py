"""A real training swarm: 3 stages x 2 peers, each its own process with its own p2pd, on loopback.

The loss at stage 0 falls from ln(256) = 5.55 at init toward the embedded chain's floor (0.860):
here below ln(256) - 3 = 2.55 (what one token tells is worth 2.454, and only the blocks get below
that: the demo passes it after about 80 s and reaches 1.4 after 5 minutes, docs/model.md);
killing a block-stage peer mid-run does not stop training: its microbatches go elsewhere.
"""

from __future__ import annotations

import math
import signal
import time

import pytest

from node.local_swarm import Swarm, peers_by_stage, wait_for
from tests.helpers.swarms import start_small_swarm, wait_online


def stage0(snap: dict) -> list[dict]:
    return [p for p in snap["stages"][0]["peers"] if p["state"] == "online"]


def mean_loss(snap: dict) -> float | None:
    losses = [p["loss"] for p in stage0(snap) if p["loss"] is not None]
    return sum(losses) / len(losses) if losses else None


def total_steps(snap: dict, stage: int = 0) -> int:
    return sum(p["inner_step"] for p in snap["stages"][stage]["peers"] if p["state"] == "online")


@pytest.mark.timeout(300)
def test_three_by_two_swarm_trains_and_survives_a_killed_peer(swarm: Swarm):
    nodes = start_small_swarm(swarm, 3, [i % 3 for i in range(6)])
    wait_online(swarm, 6, 120, nodes)

    first = wait_for(lambda: (s := swarm.observe()) and mean_loss(s) is not None and s, 60, "no loss reported")
    initial_loss = mean_loss(first)
    ln_vocab = math.log(256)
    # the snapshot that showed the loss below the line is the one asserted on: a second observation
    # may catch the noisy mean a hair above it again (a clean-clone run read 2.547 against 2.545)
    trained = wait_for(
        lambda: (s := swarm.observe()) and (loss := mean_loss(s)) is not None and loss < ln_vocab - 3.0 and s,
        150,
        lambda: f"loss did not fall below {ln_vocab - 3.0:.3f} (started at {initial_loss:.3f})",
    )
    loss_before_kill = mean_loss(trained)
    print(f"stage-0 loss: first report {initial_loss:.3f}, then {loss_before_kill:.3f} (ln V = {ln_vocab:.3f})")
    assert loss_before_kill < ln_vocab - 3.0  # from ~5.5 at init to below 2.55

    # kill -9 one stage-1 peer; the other stage-1 peer takes its microbatches
    victim = nodes[1]
    victim.refresh_family()
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait()
    steps_at_kill = total_steps(trained)
    time.sleep(8)
    later = wait_for(
        lambda: (s := swarm.observe()) and total_steps(s) >= steps_at_kill + 20 and s,
        90,
        "training stalled after a peer was killed",
    )
    loss_after = mean_loss(later)
    print(f"after kill: stage-0 steps {steps_at_kill} -> {total_steps(later)}, loss {loss_after:.3f}")
    assert loss_after is not None and loss_after < ln_vocab - 2.5  # still far below init after the kill
    assert len(peers_by_stage(later)[1]) == 1

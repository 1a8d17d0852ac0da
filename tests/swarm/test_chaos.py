"""Churn: peers SIGKILLed at random (sometimes every peer of a stage) and replaced by `--stage auto`
joiners while the swarm trains (tests/helpers/chaos.py). The default suite runs a short version;
`make chaos` the long one. Afterwards:

- no surviving process crashed and no log holds a Traceback;
- stage-0 steps were made in every window (a minute in the long run of 10 minutes, 30 s in the short one of 65 s);
- every block stage had an online peer again within the recovery bound after each outage;
- the loss at the end is below the loss at the start;
- no process of the swarm (peers, p2pds) is left (the `swarm` fixture checks it).
"""

from __future__ import annotations

import pytest

from node.local_swarm import Swarm
from tests.helpers.chaos import ChaosRun

RECOVERY_BOUND = 60.0  # seconds a stage may be without an online peer: grace 2 s + a join + a rebuild


@pytest.mark.parametrize(
    "mode",
    [
        pytest.param("short", marks=pytest.mark.timeout(600)),
        pytest.param("long", marks=[pytest.mark.slow, pytest.mark.timeout(1800)]),
    ],
)
def test_training_survives_churn(swarm: Swarm, mode: str):
    long = mode == "long"
    chaos = ChaosRun(swarm, block_stages=3, peers_per_stage=2, kill_every=30.0 if long else 15.0)
    chaos.start()
    seconds, window = (600.0, 60.0) if long else (65.0, 30.0)
    chaos.run(seconds)
    per_window = chaos.steps_per_window(window)
    outages = chaos.outages()
    first_loss, last_loss = chaos.losses()
    microbatches = chaos.microbatches()
    survivors = [n for stage in chaos.peers.values() for n in stage] + [swarm.nodes[0]]
    print(
        f"chaos {mode}: {seconds:.0f} s, {chaos.killed} peers killed in {len(chaos.kills)} strikes "
        f"({sum(1 for _, _, n in chaos.kills if n > 1)} whole stages), {chaos.started} peers started; "
        f"stage-0 steps per {window:.0f} s: {per_window}; stage outages (s): {[round(o) for o in outages]}; "
        f"loss {first_loss} -> {last_loss}; stage-0 microbatches completed {microbatches['done']}, "
        f"attempts lost and retried {microbatches['retried']}, dropped {microbatches['dropped']}"
    )
    assert chaos.killed >= 2, "the driver killed nothing"
    for node in survivors:
        assert node.process.poll() is None, f"{node.name} crashed:\n{node.log()[-2000:]}"
    for node in swarm.nodes:
        assert "Traceback" not in node.log(), f"{node.name}:\n{node.log()[-3000:]}"
    assert per_window and all(steps > 0 for steps in per_window), per_window
    assert all(outage <= RECOVERY_BOUND for outage in outages), outages
    assert first_loss is not None and last_loss is not None and last_loss < first_loss
    assert microbatches["done"] > 10 * microbatches["dropped"], microbatches

"""Bad links and partitions between hosts (`make internet`; a short partition runs in `make test`).

Four public hosts in network namespaces (tests/helpers/netns.py): the bootstrapper and a stage-0
peer on `a`, a second stage-0 peer on `b`, a stage-1 peer each on `c` and `d` (2 stages). Links are
shaped per host; a path between two hosts adds both hosts' shaping, so 50 +- 10 ms and 0.5 % loss
per host make 100 +- 20 ms one way and ~1 % loss per path, as a swarm across continents sees.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from node.local_swarm import NodeProcess, Swarm, wait_for
from tests.helpers.netns import TestBed, require_namespaces
from tests.helpers.swarms import bootstrap_on, join_placed, peer_id_of, swarm_on_bed, wait_for_peer_ids

GOSSIP_EVERY = 8
HOSTS = ("a", "b", "c", "d")
PEERS = {"stage0a": ("a", 0), "stage0b": ("b", 0), "stage1c": ("c", 1), "stage1d": ("d", 1)}
STAGE0A_PORT = 31001  # fixed, so that `node status` can enter through stage0a once the bootstrapper is gone


def start(bed: TestBed, swarm: Swarm, workdir: Path) -> tuple[NodeProcess, dict[str, NodeProcess], dict[str, str]]:
    """(the bootstrapper, the peers by name, their peer ids)."""
    (workdir / "swarm.toml").write_text(f"[gossip]\ninner_steps = {GOSSIP_EVERY}\n")
    bootstrapper = bootstrap_on(bed, "a", swarm, 2, workdir / "swarm.toml")
    placement = {
        name: (host, stage, ("--port", str(STAGE0A_PORT)) if name == "stage0a" else ())
        for name, (host, stage) in PEERS.items()
    }
    nodes = join_placed(bed, swarm, placement)
    return bootstrapper, nodes, wait_for_peer_ids(nodes)


def totals(swarm: Swarm, bed: TestBed) -> tuple[int, int, dict]:
    """(stage-0 inner steps, outer rounds of all peers, the snapshot), from `node status` inside host a."""
    snapshot = swarm.status(launcher=bed.launcher("a"), timeout=120)
    online = [p for stage in snapshot["stages"] for p in stage["peers"] if p["state"] == "online"]
    steps = sum(p["inner_step"] for p in online if p["stage"] == 0)
    return steps, sum(p["outer_round"] for p in online), snapshot


def rate(swarm: Swarm, bed: TestBed, seconds: float) -> tuple[float, int]:
    steps, rounds, _ = totals(swarm, bed)
    started = time.monotonic()
    time.sleep(seconds)
    steps2, rounds2, _ = totals(swarm, bed)
    return (steps2 - steps) / (time.monotonic() - started), rounds2 - rounds


def stop_bootstrapper(bootstrapper: NodeProcess) -> None:
    """Stop the bootstrapper as its operator would (SIGTERM), its p2pd with it."""
    bootstrapper.refresh_family()
    bootstrapper.process.send_signal(signal.SIGTERM)
    try:
        bootstrapper.process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        bootstrapper.kill_hard()
    wait_for(lambda: not bootstrapper.alive_family(), 10, "the bootstrapper's p2pd outlived it")


def assert_healthy(swarm: Swarm, gone: NodeProcess | None = None) -> None:
    """Every peer of `swarm` but `gone` (stopped by the test) is running, and no log holds a traceback."""
    for node in swarm.nodes:
        if node is gone:
            continue
        assert node.process.poll() is None, f"{node.name} died:\n{node.log()[-2000:]}"
        assert "Traceback" not in node.log(), f"{node.name}:\n{node.log()[-3000:]}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_training_goes_on_over_slow_lossy_links(tmp_path: Path):
    require_namespaces(nat=False)
    with swarm_on_bed(tmp_path, HOSTS) as (bed, swarm):
        start(bed, swarm, tmp_path)
        wait_for(lambda: totals(swarm, bed)[0] > 20, 120, "the swarm never trained")
        clean, clean_rounds = rate(swarm, bed, 40)
        for host in HOSTS:
            bed.shape(host, delay_ms=50, jitter_ms=10, loss=0.005, rate_mbit=50)
        time.sleep(10)  # let in-flight work drain into the new conditions
        shaped, shaped_rounds = rate(swarm, bed, 60)
        print(
            f"stage-0 steps/s: clean {clean:.2f}, shaped {shaped:.2f} (ratio {shaped / max(clean, 1e-9):.2f}); "
            f"gossip rounds: clean {clean_rounds} in 40 s, shaped {shaped_rounds} in 60 s; "
            f"delay line {bed.delay_line_stats()}"
        )
        assert shaped > 0.05 * clean and shaped_rounds > 0
        # a newcomer downloads its stage's state over the shaped links
        late = join_placed(bed, swarm, {"late": ("d", 1, ())})["late"]
        wait_for(
            lambda: "joined live stage 1" in late.log(),
            240,
            lambda: f"the late joiner never took over a state:\n{late.log()[-3000:]}",
        )
        wait_for(
            lambda: any(
                p["state"] == "online" and p["peer_id"] == peer_id_of(late)
                for stage in totals(swarm, bed)[2]["stages"]
                for p in stage["peers"]
            ),
            240,
            lambda: f"the late joiner never came online:\n{late.log()[-3000:]}",
        )
        assert_healthy(swarm)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "windows",
    [pytest.param((20, 45, 30), marks=pytest.mark.slow, id="full"), pytest.param((5, 25, 5), id="short")],
)
def test_a_partitioned_stage_comes_back_after_heal(tmp_path: Path, windows: tuple[float, float, float]):
    """`windows`: seconds of training measured before the cut, of the cut (longer than the records'
    TTL and the lost-stage grace, 10 s each), and of training measured once it resumed."""
    before_for, cut_for, after_for = windows
    require_namespaces(nat=False)
    with swarm_on_bed(tmp_path, HOSTS) as (bed, swarm):
        bootstrapper, nodes, ids = start(bed, swarm, tmp_path)
        wait_for(lambda: totals(swarm, bed)[0] > 20, 120, "the swarm never trained")
        before, _ = rate(swarm, bed, before_for)
        cut_at = time.monotonic()
        bed.cut("c")
        bed.cut("d")  # every stage-1 peer is gone
        # and so is every peer's only initial peer: after the heal the two sides must find each other
        # through the peers they still know (node/p2p/rejoin.py), as after a home router's reboot
        stop_bootstrapper(bootstrapper)
        swarm.enter_through([f"/ip4/{bed.address('a')}/tcp/{STAGE0A_PORT}/p2p/{ids['stage0a']}"])
        during, _ = rate(swarm, bed, cut_for - (time.monotonic() - cut_at))
        bed.heal("c")
        bed.heal("d")
        healed_at = time.monotonic()
        steps = totals(swarm, bed)[0]
        resumed = wait_for(
            lambda: totals(swarm, bed)[0] >= steps + 20 and time.monotonic(),
            300,
            lambda: (
                "stage 0 never trained again after the heal:\n"
                + "\n".join(f"--- {n}\n{p.log()[-1500:]}" for n, p in nodes.items())
            ),
        )
        after, _ = rate(swarm, bed, after_for)

        def stage1_online() -> list[dict]:
            return [p for p in totals(swarm, bed)[2]["stages"][1]["peers"] if p["state"] == "online"]

        stage1 = wait_for(
            lambda: len(found := stage1_online()) == 2 and found, 60, lambda: f"stage 1 after: {stage1_online()}"
        )
        print(
            f"partition of stage 1 for {healed_at - cut_at:.0f} s, the bootstrapper stopped: stage-0 steps/s "
            f"{before:.2f} before, {during:.2f} during, {after:.2f} after; training resumed "
            f"{resumed - healed_at:.0f} s after the heal; stage 1 online after: {len(stage1)} peers, outer "
            f"rounds {[p['outer_round'] for p in stage1]}"
        )
        assert_healthy(swarm, gone=bootstrapper)

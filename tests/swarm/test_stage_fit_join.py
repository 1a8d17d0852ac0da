"""`node join --stage auto` against real swarms whose stages this machine cannot all hold: it takes
the stage that fits instead of the neediest, and refuses in one line with exit code 3 when none
fits (node/server/stage_fit.py; the rule's unit tests: tests/unit/test_stage_fit.py)."""

from __future__ import annotations

import pytest

from node.local_swarm import Swarm, peers_by_stage, wait_for
from tests.swarm.test_doctor import HUGE_MODEL, doctor, lines_by_check

# HUGE_MODEL's block stage (~830 GiB, the least demanding) and a stage 0 of a 4M-token vocabulary at width 4096
NOTHING_FITS = HUGE_MODEL.replace("[model]\n", "[model]\nvocab_size = 4000000\n")


@pytest.mark.timeout(300)
def test_auto_takes_the_stage_this_device_holds_rather_than_the_neediest(swarm: Swarm):
    config = swarm.workdir / "huge.toml"
    config.write_text(HUGE_MODEL)  # stage 0 is small, stage 1 fits no machine here
    swarm.bootstrap("--config", str(config), "--heartbeat-period", "1", "--heartbeat-ttl", "5")
    checked = lines_by_check(doctor(swarm, "--device", "cpu").stdout)["memory"]
    assert checked.startswith("[  ok]") and "stage 0 needs about" in checked, checked
    joiner = swarm.join("edge", "--stage", "auto", "--device", "cpu", "--join-jitter", "0", "--quiet")
    wait_for(
        lambda: peers_by_stage(swarm.observe()).get(0),
        180,
        lambda: f"the joiner never served stage 0:\n{joiner.log()[-3000:]}",
    )
    log = joiner.log()
    assert "--stage auto skips stage 1: it needs about" in log, log[-3000:]
    assert not peers_by_stage(swarm.observe()).get(1)


@pytest.mark.timeout(240)
def test_auto_refuses_in_one_line_when_no_stage_fits(swarm: Swarm):
    config = swarm.workdir / "nothing.toml"
    config.write_text(NOTHING_FITS)
    swarm.bootstrap("--config", str(config))
    joiner = swarm.join("nowhere", "--stage", "auto", "--device", "cpu", "--join-jitter", "0", "--quiet")
    assert joiner.process.wait(timeout=180) == 3, joiner.log()[-3000:]
    refusals = [line for line in joiner.log().splitlines() if "refusing to join" in line]
    assert len(refusals) == 1, joiner.log()[-3000:]
    assert "no stage of swarm pipeswarm-demo fits cpu: the least demanding, stage 1, needs about" in refusals[0]
    assert "Traceback" not in joiner.log()

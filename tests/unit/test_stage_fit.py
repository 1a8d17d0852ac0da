"""node/server/stage_fit.py and its users: `node join --stage auto` skips a stage this device cannot
hold in favour of the next-neediest that fits, refuses in one line (exit code 3) when none fits, and
`node doctor` checks the stage such a join would take."""

from __future__ import annotations

import logging

import pytest

from dht.records import PeerRecord, PeerState
from node.config import Precision
from node.model.memory import DeviceMemory, estimate_stage_memory, format_bytes
from node.model.presets import load_config
from node.server import daemon, stage_fit
from node.server.doctor import Outcome, check_auto_memory

GiB = 2**30


@pytest.fixture
def config():
    return load_config(**{"model.preset": "125m"})  # stage 0 ~2.8 GiB, block stages ~6.9 GiB at 4 in flight (CPU)


def device_with(monkeypatch, free: int) -> None:
    monkeypatch.setattr(stage_fit, "available_memory", lambda device: DeviceMemory(device, free))


def test_the_stages_a_device_holds_are_those_whose_estimate_at_min_in_flight_fits(monkeypatch, config, caplog):
    least_block = estimate_stage_memory(config, 2, config.training.min_in_flight).total  # no edge copy
    device_with(monkeypatch, least_block)
    with caplog.at_level(logging.INFO, logger="node.server.daemon"):
        assert daemon.stages_this_device_holds(config, "cpu") == frozenset({0, 2})
    # stages 1 and 3 keep CheckFree+ copies of stage 0's embedding / head: a little more than stage 2
    assert "--stage auto skips stage 1: it needs about" in caplog.text
    assert "--stage auto skips stage 3" in caplog.text and "skips stage 2" not in caplog.text
    device_with(monkeypatch, 100 * GiB)
    assert daemon.stages_this_device_holds(config, "cpu") == frozenset(range(4))
    assert daemon.stages_this_device_holds(config, None) is None  # --skip-memory-check, or no training


def test_a_device_that_holds_no_stage_is_refused_in_one_line_with_the_numbers(monkeypatch, config, caplog):
    device_with(monkeypatch, GiB)
    least = estimate_stage_memory(config, 0, config.training.min_in_flight).total
    with pytest.raises(daemon.JoinRefused) as refused:
        daemon.stages_this_device_holds(config, "cpu")
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"no stage of swarm pipeswarm-demo fits cpu: the least demanding, stage 0, needs about "
        f"{format_bytes(least)} with 4 microbatches in flight but cpu has 1.0 GiB free"
    )

    async def join_here() -> int:
        daemon.stages_this_device_holds(config, "cpu")
        return 0

    with caplog.at_level(logging.ERROR):
        assert daemon.run(join_here()) == 3
    assert caplog.records[-1].getMessage() == f"refusing to join: {message}"


def test_an_unreadable_device_is_refused_in_one_line(monkeypatch, config):
    def no_cuda(device: str) -> DeviceMemory:
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(stage_fit, "available_memory", no_cuda)
    with pytest.raises(daemon.JoinRefused, match="cannot use device cuda:1: Torch not compiled"):
        daemon.stages_this_device_holds(config, "cuda:1")


def test_the_fit_is_that_of_the_precision_the_device_computes_in(config):
    block = estimate_stage_memory(config, 2, 4).total
    (fit,) = stage_fit.stage_fits(config, [2], DeviceMemory("cpu", block))  # auto: fp32 on a CPU
    assert fit.fits and fit.estimate == estimate_stage_memory(config, 2, 4, precision=Precision.FP32)
    bf16 = load_config(**{"model.preset": "125m", "training.precision": "bf16"})
    (fit,) = stage_fit.stage_fits(bf16, [2], DeviceMemory("cpu", block))
    assert fit.in_flight is not None and fit.in_flight > 4  # bf16 activations are smaller: a wider window


def record(peer: str, stage: int, throughput: float) -> PeerRecord:
    return PeerRecord(peer_id=peer, stage=stage, state=PeerState.ONLINE, throughput=throughput)


def test_doctor_checks_the_stage_auto_would_take_on_this_device(config):
    peers = {0: [record("a", 0, 5.0)], 1: [], 2: [record("c", 2, 1.0)], 3: [record("d", 3, 2.0)]}
    roomy = check_auto_memory(peers, config, "cpu", lambda device: DeviceMemory(device, 100 * GiB))
    assert roomy.outcome == Outcome.OK and roomy.found.startswith("stage 1 needs about")
    # stage 0 fits, no block stage does: the check is stage 0's
    only_edge = estimate_stage_memory(config, 0, 4).total
    small = check_auto_memory(peers, config, "cpu", lambda device: DeviceMemory(device, only_edge))
    assert small.outcome == Outcome.OK and small.found.startswith("stage 0 needs about")
    tiny = check_auto_memory(peers, config, "cpu", lambda device: DeviceMemory(device, GiB))
    assert tiny.outcome == Outcome.FAIL and tiny.found.startswith("no stage of swarm pipeswarm-demo fits cpu")

"""node/model/memory.py and node/server/stage_fit.py: the memory estimate per stage, precision and
device, what autograd really saves, the refusal of a device too small for its stage, the store of
activations bounded by the window the check admitted, and `node status`'s figures. (Measured
against a real StageWorker's peak: tests/benchmarks/bench_memory.py, docs/model.md.)"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
import torch

from node.config import GossipMode, ModelConfig, Precision, RecoveryStrategy, SwarmConfig
from node.model.llama import build_stage
from node.model.memory import (
    DeviceMemory,
    estimate_stage_memory,
    fitting_in_flight,
    format_bytes,
    memory_refusal,
)
from node.model.memory_tables import HOME_GPU_BUDGET
from node.model.presets import PRESETS, PresetName, load_config
from node.p2p.bans import BanList


def preset_config(name: PresetName, **overrides) -> SwarmConfig:
    return load_config(**{"model.preset": name.value, **overrides})


# ------------------------------------------------------------------------------------------------
# The estimate


def test_the_memory_estimate_of_tiny_equals_a_hand_computation():
    config = SwarmConfig()  # tiny: V 256, H 64, I 176, 1 layer per block stage, 3 stages
    tokens = 8 * 64  # microbatch_size x sequence_length
    p0 = 2 * 256 * 64 + 64  # embedding, LM head, final norm
    p1 = 4 * 64 * 64 + 3 * 64 * 176 + 2 * 64  # q k v o, gate up down, two norms
    # embedding output (4 x H bytes) and int64 ids and targets per token, plus the head's gradients
    # (V x H + H values) kept per microbatch between its loss and its embedding backward
    edge_per_token = 4 * 64 + 16
    edge_activations = 32 * (tokens * edge_per_token + (256 * 64 + 64) * 4)
    loss_head = 3 * tokens * 256 * 4  # logits, log-softmax, their gradient
    edge = estimate_stage_memory(config, 0)  # fp32 on a CPU: max_in_flight 32
    assert edge.to_dict() == {
        "stage": 0,
        "parameters": p0,
        "weights": 4 * p0,
        "gradients": 8 * p0,  # accumulated, and one working copy (a microbatch's, the step's, a round's)
        "optimizer": 8 * p0,
        "outer_state": 12 * p0,  # phi, momentum, the error-feedback residual
        "gossip_round": 32 * p0,  # 7 fp32 copies
        "stashed_weights": 0,  # stage 0 redoes its embedding lookup instead
        "edge_copies": 0,
        "activations": edge_activations,
        "loss_head": loss_head,
        "allocator_slack": 32 * tokens * edge_per_token // 4,  # glibc's heap: a quarter of what is kept per token
        "total": 64 * p0 + edge_activations + loss_head + 32 * tokens * edge_per_token // 4,
    }
    assert (p0, edge.total) == (32_832, 2_101_248 + 6_561_792 + 1_572_864 + 1_114_112)
    # a block stage keeps per token its output and, per layer, 10 H + 4 I fp32 values (its input included)
    block_activations = 32 * tokens * ((10 * 64 + 4 * 176) * 4 + 64 * 4)
    first = estimate_stage_memory(config, 1)
    assert (first.parameters, first.activations, first.edge_copies) == (p1, block_activations, 256 * 64 * 2)
    assert first.stashed_weights == 4 * p1 * 4  # training.stashed_weights fp32 copies
    assert first.allocator_slack == block_activations // 4
    # 80 x 50,304 + 32,768 (the edge copy in bfloat16) + 16,384 x 5,632 x 1.25
    assert first.total == 80 * p1 + 256 * 64 * 2 + block_activations * 5 // 4 == 119_400_448
    last = estimate_stage_memory(config, 2)
    assert last.edge_copies == (256 * 64 + 64) * 2  # the LM head and the final norm, in bfloat16
    # on a GPU: no heap slack; the edge copies are kept on the stage's device there too
    gpu = estimate_stage_memory(config, 1, device="cuda:0")
    edge_copy = 256 * 64 * 2
    assert (gpu.allocator_slack, gpu.edge_copies, gpu.total) == (0, edge_copy, 80 * p1 + edge_copy + block_activations)
    # bf16 autocast: the residual stream stays fp32 (4 H), 9 H + 4 I values are bf16, and every stored
    # forward keeps bf16 copies of the weights its matmuls used
    half = estimate_stage_memory(config, 1, precision=Precision.BF16, device="cuda")
    per_token = 4 * 64 * 4 + (9 * 64 + 4 * 176) * 2 + 64 * 4
    assert half.activations == 32 * (tokens * per_token + 2 * p1) == 66_134_016
    assert estimate_stage_memory(config, 1, precision=Precision.FP16) == estimate_stage_memory(
        config, 1, precision=Precision.BF16
    )
    assert format_bytes(first.total) == "113.9 MiB"


def test_the_estimate_wants_the_precision_resolved_for_the_device():
    with pytest.raises(ValueError, match=r"resolve training\.precision"):
        estimate_stage_memory(SwarmConfig(), 1, precision=Precision.AUTO)


def test_a_device_too_small_for_the_widest_window_gets_the_widest_that_fits():
    config = SwarmConfig()  # windows of 4..32
    widest = estimate_stage_memory(config, 1).total
    assert fitting_in_flight(config, 1, widest) == (32, estimate_stage_memory(config, 1))
    free = estimate_stage_memory(config, 1, 9).total + 1  # 9 fit, 10 do not
    in_flight, estimate = fitting_in_flight(config, 1, free)
    assert in_flight == 9 and estimate.total <= free < estimate_stage_memory(config, 1, 10).total
    least = estimate_stage_memory(config, 1, 4)
    assert fitting_in_flight(config, 1, least.total - 1) == (None, least)  # not even the floor: refused
    # the same memory holds a wider window in bf16 on a GPU
    gpu_window, _ = fitting_in_flight(config, 1, free, precision=Precision.BF16, device="cuda")
    assert gpu_window is not None and gpu_window > 9


def test_gossip_off_drops_the_round_and_no_checkfree_plus_drops_the_edge_copies():
    config = SwarmConfig().replace(gossip={"mode": GossipMode.NONE}, recovery={"checkfree_plus": False})
    estimate = estimate_stage_memory(config, 1)
    assert estimate.gossip_round == 0 and estimate.edge_copies == 0
    assert estimate.outer_state == 12 * estimate.parameters  # the OuterReplica exists in every mode


@pytest.mark.parametrize("strategy", list(RecoveryStrategy))
@pytest.mark.parametrize("num_stages", [2, 3, 5])
def test_edge_copies_are_counted_where_the_recovery_code_keeps_them(strategy, num_stages):
    from node.recovery.edge_copies import edge_copies_for

    config = SwarmConfig(num_stages=num_stages).replace(recovery={"strategy": strategy})
    for stage in range(num_stages):
        kept = edge_copies_for(config.recovery, config.num_stages, stage)
        assert (estimate_stage_memory(config, stage).edge_copies > 0) == (kept is not None), (strategy, stage)


def kept_activation_bytes(config: SwarmConfig, batch: int, seq: int, precision: Precision) -> int:
    """Bytes one block-stage forward keeps for its backward: what autograd saves (the input included,
    the live weights excluded: autocast's casts of them are new tensors and count) and the output."""
    stage = build_stage(config.model, 1, config.seed)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(batch, seq, config.model.hidden_size, requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    dtype = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(precision)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = stage(x)
    storages[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    return sum(size for pointer, size in storages.items() if pointer not in weights)


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
@pytest.mark.parametrize("name", [PresetName.TINY, PresetName.STORIES_15M, PresetName.MOBILELLM_125M])
def test_the_activation_bytes_per_layer_match_what_autograd_saves(name, precision):
    m = preset_config(name, **{"model.vocab_size": 256}).model  # 125m: grouped-query attention
    config = SwarmConfig(num_stages=2, model=ModelConfig(**{**m.__dict__, "layers_per_stage": 2}))
    batch, seq = 2, 64
    measured = kept_activation_bytes(config, batch, seq, precision)
    one_microbatch = config.replace(training={"microbatch_size": batch, "sequence_length": seq})
    estimate = estimate_stage_memory(one_microbatch, 1, 1, precision=precision)
    # not modelled, a few percent at 64 tokens: cos/sin per position, the norms' statistics, the
    # attention's log-sum-exp
    assert estimate.activations == pytest.approx(measured, rel=0.03), (name, precision)


def test_a_24_gb_home_gpu_holds_every_stage_of_every_real_preset_at_its_widest_window():
    """HOME_GPU_BUDGET: a 24 GiB card less the CUDA context and the caching allocator's reserve."""
    for name in PresetName:
        if name is PresetName.TINY:
            continue
        config = preset_config(name)
        for stage in range(config.num_stages):
            # what auto resolves to on a GPU with native bf16 and on an older one (node/stage/precision.py)
            for precision in (Precision.BF16, Precision.FP16):
                needs = estimate_stage_memory(config, stage, precision=precision, device="cuda").total
                assert needs <= HOME_GPU_BUDGET, (name, stage, precision, format_bytes(needs))
    assert PRESETS[PresetName.MOBILELLM_125M].num_stages == 4


# ------------------------------------------------------------------------------------------------
# Refusing a device too small for its stage


def test_memory_refusal_is_one_line_when_the_device_is_too_small_and_none_when_it_fits():
    config = preset_config(PresetName.MOBILELLM_1B, num_stages=4)
    estimate = estimate_stage_memory(config, 1)
    assert memory_refusal(config.swarm_id, estimate, DeviceMemory("cuda:0", estimate.total)) is None
    refusal = memory_refusal(config.swarm_id, estimate, DeviceMemory("cuda:0", 8 * 2**30))
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith(f"stage 1 of swarm pipeswarm-demo needs about {format_bytes(estimate.total)} (")
    assert "but cuda:0 has 8.0 GiB free" in refusal


def test_join_refuses_with_exit_code_3_before_building_the_stage(monkeypatch, caplog):
    import node.server.stage_service as stage_service
    from node.server import daemon

    config = preset_config(PresetName.MOBILELLM_350M)
    monkeypatch.setattr(stage_service, "available_memory", lambda device: DeviceMemory(device, 2**30))

    def must_not_serve(*args):
        raise AssertionError("the stage was served despite the refusal")

    monkeypatch.setattr(stage_service, "serve_current_stage", must_not_serve)
    me = SimpleNamespace(stage=2)
    options = stage_service.ServiceOptions(device="cpu")
    with pytest.raises(daemon.JoinRefused, match="stage 2 of swarm pipeswarm-demo needs about"):
        asyncio.run(stage_service.serve_stage(None, config, me, asyncio.Event(), options))  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR):
        code = daemon.run(stage_service.serve_stage(None, config, me, asyncio.Event(), options))  # type: ignore[arg-type]
    assert code == 3
    assert caplog.records[-1].getMessage().startswith("refusing to join: stage 2 of swarm")


def test_join_serves_when_the_stage_fits_or_the_check_is_skipped(monkeypatch):
    import node.server.stage_service as stage_service

    served = []

    async def serve_once(network, config, me, stop, options):
        served.append(me.stage)
        return None

    monkeypatch.setattr(stage_service, "serve_current_stage", serve_once)
    monkeypatch.setattr(stage_service, "available_memory", lambda device: DeviceMemory(device, 2**20))
    me = SimpleNamespace(stage=1)
    tiny, big = SwarmConfig(), preset_config(PresetName.MOBILELLM_350M)
    with pytest.raises(stage_service.JoinRefused):
        asyncio.run(stage_service.serve_stage(None, tiny, me, asyncio.Event(), stage_service.ServiceOptions()))  # type: ignore[arg-type]
    skip = stage_service.ServiceOptions(check_memory=False)
    asyncio.run(stage_service.serve_stage(None, big, me, asyncio.Event(), skip))  # type: ignore[arg-type]
    monkeypatch.setattr(stage_service, "available_memory", lambda device: DeviceMemory(device, 2**30))
    asyncio.run(stage_service.serve_stage(None, tiny, me, asyncio.Event(), stage_service.ServiceOptions()))  # type: ignore[arg-type]
    assert served == [1, 1]


def test_join_refuses_in_one_line_a_device_whose_memory_cannot_be_read(monkeypatch):
    import node.server.stage_service as stage_service

    def no_such_device(device: str) -> DeviceMemory:
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(stage_service, "available_memory", no_such_device)
    with pytest.raises(stage_service.JoinRefused, match="cannot use device cuda:3: Torch not compiled"):
        stage_service.check_stage_fits(SwarmConfig(), 1, "cuda:3")


class WorkerBuilt(Exception):
    """Raised by the stand-in StageWorker: build_service got as far as the worker."""


def test_the_store_of_activations_holds_the_window_the_memory_check_admitted(monkeypatch):
    import node.server.stage_service as stage_service

    config = SwarmConfig()  # windows of 4..32
    admitted = 9
    free = estimate_stage_memory(config, 1, admitted).total + 1  # 9 fit, 10 do not
    monkeypatch.setattr(stage_service, "available_memory", lambda device: DeviceMemory(device, free))
    stores = []

    def worker(config, stage, device, max_stored):
        stores.append(max_stored)
        raise WorkerBuilt

    async def build_only(network, config, me, stop, options):
        return await stage_service.build_service(network, config, me, options)

    monkeypatch.setattr(stage_service, "StageWorker", worker)
    monkeypatch.setattr(stage_service, "serve_current_stage", build_only)
    network = SimpleNamespace(dht=None, bans=BanList())
    me = SimpleNamespace(stage=1)
    with pytest.raises(WorkerBuilt):
        asyncio.run(stage_service.serve_stage(network, config, me, asyncio.Event(), stage_service.ServiceOptions()))  # type: ignore[arg-type]
    # what the estimate counted, not a multiple of it: a peer never stores more than it was checked for
    assert stores == [admitted]


# ------------------------------------------------------------------------------------------------
# What node status shows


def test_the_status_snapshot_carries_parameters_and_memory_per_stage():
    from node.monitor.status import format_table, stage_requirements

    config = preset_config(PresetName.MOBILELLM_125M)
    requirements = stage_requirements(config)
    assert [r["parameters"] for r in requirements] == [36_864_576] + [35_400_960] * 3
    assert requirements[1]["total"] == estimate_stage_memory(config, 1).total
    snapshot = {
        "swarm_id": "s",
        "num_stages": 4,
        "config_hash": "abc",
        "model_parameters": 143_067_456,
        "model_preset": "125m",
        "stages": [
            {
                "stage": stage,
                "status": "empty",
                "throughput": 0.0,
                "parameters": r["parameters"],
                "memory": {k: v for k, v in r.items() if k not in ("stage", "parameters")},
                "peers": [],
            }
            for stage, r in enumerate(requirements)
        ],
    }
    table = format_table(snapshot)
    assert "model 143,067,456 params (preset 125m)" in table
    assert (
        f"stage 1: empty, 0 peer(s), throughput 0.00, 35,400,960 params, {format_bytes(requirements[1]['total'])} per peer"
        in table
    )

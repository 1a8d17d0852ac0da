"""node/model/presets.py and node/model/memory.py: preset shapes against their published parameter
counts, the even split of layers over block stages, presets in TOML and on the command line, the
memory estimate per stage, and the refusal of a device too small for its stage."""

from __future__ import annotations

import asyncio
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from node.config import ConfigError, GossipMode, ModelConfig, RecoveryStrategy, SwarmConfig
from node.model.llama import build_stage
from node.model.memory import (
    DeviceMemory,
    activation_values_per_layer,
    estimate_stage_memory,
    fitting_in_flight,
    format_bytes,
    memory_refusal,
)
from node.model.parameters import count_stage_parameters
from node.model.presets import (
    PRESETS,
    PresetName,
    gossip_round_timeout,
    load_config,
    preset_of,
    valid_block_stage_counts,
)

# a block-stage count each preset splits evenly, as a swarm of that preset would typically run
TYPICAL_BLOCK_STAGES = {
    PresetName.TINY: 2,
    PresetName.STORIES_15M: 2,
    PresetName.MOBILELLM_125M: 3,
    PresetName.MOBILELLM_350M: 4,
    PresetName.MOBILELLM_1B: 9,
}


def preset_config(name: PresetName, block_stages: int | None = None, **overrides) -> SwarmConfig:
    stages = TYPICAL_BLOCK_STAGES[name] if block_stages is None else block_stages
    return load_config(**{"model.preset": name.value, "num_stages": stages + 1, **overrides})


def meta_stage_parameters(config: SwarmConfig, stage: int) -> int:
    """Parameters of the module build_stage gives, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        module = build_stage(config, stage)
    assert all(p.is_meta for p in module.parameters())
    return sum(p.numel() for p in module.parameters())


# ------------------------------------------------------------------------------------------------
# Shapes and published counts


def test_every_preset_name_has_a_preset():
    assert set(PRESETS) == set(PresetName)


def test_tiny_is_exactly_todays_defaults_at_any_stage_count():
    for num_stages in (2, 3, 4, 7):
        config = load_config(**{"model.preset": "tiny", "num_stages": num_stages})
        assert config.model == ModelConfig()
        assert config == SwarmConfig(num_stages=num_stages)
    assert load_config(**{"model.preset": "tiny"}).config_hash() == SwarmConfig().config_hash()


@pytest.mark.parametrize("name", [name for name in PresetName if PRESETS[name].published_parameters is not None])
def test_each_preset_built_on_the_meta_device_has_its_published_parameter_count(name):
    preset = PRESETS[name]
    config = preset_config(name)
    block_stages = config.num_stages - 1
    per_stage = [meta_stage_parameters(config, stage) for stage in range(config.num_stages)]
    assert per_stage == [count_stage_parameters(config, stage) for stage in range(config.num_stages)]
    assert len(set(per_stage[1:])) == 1, "block stages differ"
    assert config.model.layers_per_stage * block_stages == preset.num_layers
    total = sum(per_stage)
    # The published models tie the LM head to the embedding; pipeswarm's stage 0 holds an untied
    # head, so it has exactly one vocab x hidden matrix more than the model it follows.
    untied_head = preset.vocab_size * preset.hidden_size
    comparable = total - untied_head if preset.published_ties_embeddings else total
    assert comparable == pytest.approx(preset.published_parameters, rel=0.01), (
        f"{name}: {comparable:,} vs published {preset.published_parameters:,}"
    )


def test_the_preset_totals_as_documented_in_docs_model_md():
    configs = {name: preset_config(name) for name in PresetName}
    totals = {
        name: count_stage_parameters(c, 0) + (c.num_stages - 1) * count_stage_parameters(c, 1)
        for name, c in configs.items()
    }
    assert totals == {
        PresetName.TINY: 133_440,
        PresetName.STORIES_15M: 24_407_712,  # 15,191,712 tied + 9,216,000 head
        PresetName.MOBILELLM_125M: 143_067_456,  # 124,635,456 tied + 18,432,000 head
        PresetName.MOBILELLM_350M: 376_075_200,  # 345,355,200 tied + 30,720,000 head
        PresetName.MOBILELLM_1B: 1_046_421_760,  # 1,005,461,760 tied + 40,960,000 head
    }


def test_layers_are_split_evenly_and_a_stage_count_that_does_not_divide_them_is_refused():
    assert preset_config(PresetName.MOBILELLM_125M, 3).model.layers_per_stage == 10
    assert preset_config(PresetName.MOBILELLM_125M, 30).model.layers_per_stage == 1
    with pytest.raises(ConfigError) as refused:
        preset_config(PresetName.MOBILELLM_125M, 4)
    message = str(refused.value)
    assert "preset 125m has 30 layers" in message and "4 block stages (num_stages = 5)" in message
    assert "choose num_stages among 2, 3, 4, 6, 7, 11, 16, 31" in message
    assert valid_block_stage_counts(54) == [1, 2, 3, 6, 9, 18, 27, 54]


def test_preset_of_names_the_preset_a_config_holds_and_none_for_a_custom_shape():
    for name in PresetName:
        assert preset_of(preset_config(name)) == name
    assert preset_of(load_config(**{"model.preset": "15m", "model.vocab_size": 512})) is None


# ------------------------------------------------------------------------------------------------
# Loading: TOML, flags, precedence


def write_toml(tmp_path, text: str):
    path = tmp_path / "swarm.toml"
    path.write_text(text)
    return path


def test_a_toml_preset_fills_the_model_section_and_is_not_stored(tmp_path):
    path = write_toml(tmp_path, 'num_stages = 4\n[model]\npreset = "125m"\n')
    config = load_config(path)
    assert config.model == PRESETS[PresetName.MOBILELLM_125M].model_config(4)
    assert config.model.layers_per_stage == 10 and config.model.max_position_embeddings == 2048
    assert "preset" not in config.to_dict()["model"]
    assert SwarmConfig.from_dict(config.to_dict()) == config  # a joiner rebuilds it from the DHT as is


def test_explicit_model_keys_win_over_the_preset(tmp_path):
    path = write_toml(tmp_path, '[model]\npreset = "15m"\nvocab_size = 8192\n')
    config = load_config(path)
    assert config.model.vocab_size == 8192 and config.model.hidden_size == 288
    assert config.model.layers_per_stage == 3  # 6 layers over the default 2 block stages
    # an explicit layers_per_stage is the user's split: the preset's total and its divisibility no longer apply
    config = load_config(write_toml(tmp_path, 'num_stages = 5\n[model]\npreset = "15m"\nlayers_per_stage = 2\n'))
    assert config.model.layers_per_stage == 2 and config.model.hidden_size == 288


def test_the_flag_preset_wins_over_the_toml_preset_and_flags_over_both(tmp_path):
    path = write_toml(tmp_path, 'num_stages = 4\n[model]\npreset = "125m"\n')
    assert load_config(path, **{"model.preset": "15m"}).model.hidden_size == 288
    # num_stages from a flag decides the split
    assert load_config(path, num_stages=7).model.layers_per_stage == 5


def test_node_config_alone_refuses_a_preset_it_cannot_resolve(tmp_path):
    import node.config

    with pytest.raises(ConfigError, match=r"model: unknown keys \['preset'\]"):
        node.config.load_config(write_toml(tmp_path, '[model]\npreset = "15m"\n'))


def test_an_unknown_or_mistyped_preset_is_refused_with_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"model.preset: 'huge' is not one of tiny, 15m, 125m, 350m, 1b"):
        load_config(write_toml(tmp_path, '[model]\npreset = "huge"\n'))
    with pytest.raises(ConfigError, match="is not one of"):
        load_config(write_toml(tmp_path, "[model]\npreset = 125\n"))


def test_node_bootstrap_refuses_a_bad_preset_in_one_line_with_exit_code_2(monkeypatch, caplog):
    import node.cli as cli

    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    with caplog.at_level(logging.ERROR, logger="node"):
        assert cli.main(["bootstrap", "--preset", "125m", "--num-stages", "5"]) == 2
    assert caplog.records[-1].getMessage().startswith("bad config: preset 125m has 30 layers")
    assert "\n" not in caplog.records[-1].getMessage()


# ------------------------------------------------------------------------------------------------
# The training shape and the gossip timeout a preset fills


def test_a_preset_fills_the_training_shape_its_model_needs_and_its_stage_count():
    for name in PresetName:
        preset = PRESETS[name]
        config = load_config(**{"model.preset": name.value})
        shape = preset.training
        t = config.training
        assert (t.sequence_length, t.microbatch_size, t.min_in_flight, t.max_in_flight) == (
            shape.sequence_length,
            shape.microbatch_size,
            shape.min_in_flight,
            shape.max_in_flight,
        )
        assert config.num_stages == (preset.num_stages or SwarmConfig.num_stages)
    assert load_config(**{"model.preset": "15m"}).training.sequence_length == 256  # its whole context
    for name in (PresetName.MOBILELLM_125M, PresetName.MOBILELLM_350M, PresetName.MOBILELLM_1B):
        config = load_config(**{"model.preset": name.value})
        assert config.training.sequence_length == config.model.max_position_embeddings == 2048
    assert load_config(**{"model.preset": "125m"}).model.layers_per_stage == 10  # 3 block stages


def test_the_gossip_timeout_is_the_largest_stage_round_at_the_stated_link_rate_with_slack():
    config = load_config(**{"model.preset": "125m"})
    largest = max(count_stage_parameters(config, 0), count_stage_parameters(config, 1))
    assert largest == 36_864_576  # stage 0: embedding, norm, head
    # phi and Delta, fp32, both ways: 16 bytes a parameter, at 50 Mbit/s, twice that, rounded up
    assert config.gossip.round_timeout == gossip_round_timeout(config) == math.ceil(2 * largest * 16 * 8 / 50e6) == 189
    # from the final model: a smaller vocabulary shrinks stage 0, the block stage is then the largest
    small_vocab = load_config(**{"model.preset": "125m", "model.vocab_size": 8192})
    assert small_vocab.gossip.round_timeout == math.ceil(2 * 35_400_960 * 16 * 8 / 50e6) == 182
    assert load_config(**{"model.preset": "tiny"}).gossip.round_timeout == 30.0  # never below the default


def test_explicit_training_and_gossip_keys_and_stage_counts_win_over_the_preset(tmp_path):
    path = write_toml(
        tmp_path,
        'num_stages = 7\n[model]\npreset = "125m"\n[training]\nsequence_length = 1024\n'
        "[gossip]\nround_timeout = 45.0\n",
    )
    config = load_config(path)
    assert config.num_stages == 7 and config.model.layers_per_stage == 5
    assert config.training.sequence_length == 1024 and config.training.microbatch_size == 1
    assert config.gossip.round_timeout == 45.0
    flags = load_config(
        path, num_stages=3, **{"training.max_in_flight": 6, "training.min_in_flight": 2, "gossip.round_timeout": None}
    )
    assert flags.num_stages == 3 and flags.model.layers_per_stage == 15
    assert (flags.training.min_in_flight, flags.training.max_in_flight) == (2, 6)
    assert flags.gossip.round_timeout == 45.0  # a None override is no override: the TOML's value stays
    # a shorter context the user chose shortens the preset's sequence; a sequence written longer is refused
    assert (
        load_config(**{"model.preset": "125m", "model.max_position_embeddings": 1024}).training.sequence_length == 1024
    )
    with pytest.raises(ConfigError, match="sequence_length exceeds max_position_embeddings"):
        load_config(**{"model.preset": "125m", "model.max_position_embeddings": 1024, "training.sequence_length": 2048})


# ------------------------------------------------------------------------------------------------
# Memory estimate


def test_the_memory_estimate_of_tiny_equals_a_hand_computation():
    config = SwarmConfig()  # tiny: V 256, H 64, I 176, 1 layer per block stage, 3 stages
    tokens_in_flight = 32 * 8 * 64  # max_in_flight x microbatch_size x sequence_length
    p0 = 2 * 256 * 64 + 64  # embedding, LM head, final norm
    p1 = 4 * 64 * 64 + 3 * 64 * 176 + 2 * 64  # q k v o, gate up down, two norms
    edge_activations = tokens_in_flight * (4 * 64 + 16) + 32 * (256 * 64 + 64) * 4
    loss_head = 3 * (8 * 64) * 256 * 4  # logits, log-softmax, their gradient
    edge = estimate_stage_memory(config, 0)
    assert edge.to_dict() == {
        "stage": 0,
        "parameters": p0,
        "weights": 4 * p0,
        "gradients": 8 * p0,  # accumulated, and one microbatch's before they are added
        "optimizer": 8 * p0,
        "outer_state": 8 * p0,
        "gossip_round": 28 * p0,  # 7 fp32 copies
        "stashed_weights": 0,  # stage 0 redoes its embedding lookup instead
        "edge_copies": 0,
        # embedding output (4 x H bytes) and int64 ids and targets per token, plus the head's
        # gradients (V x H + H values) kept per microbatch between its loss and its embedding backward
        "activations": edge_activations,
        "loss_head": loss_head,
        "total": 56 * p0 + edge_activations + loss_head,
    }
    # 56 x 32,832 + 16,384 x 272 + 32 x 16,448 x 4 + 3 x 512 x 256 x 4
    assert (p0, edge.total) == (32_832, 1_838_592 + 4_456_448 + 2_105_344 + 1_572_864)
    first = estimate_stage_memory(config, 1)
    activations = tokens_in_flight * (2 * 64 + 9 * 64 + 4 * 176) * 4  # input, output, one layer's saved values
    assert (first.parameters, first.activations, first.edge_copies) == (p1, activations, 256 * 64 * 4)
    assert first.stashed_weights == 4 * p1 * 4  # training.stashed_weights fp32 copies
    # 72 x 50,304 + 65,536 + 16,384 x 1,408 x 4
    assert first.total == 72 * p1 + 256 * 64 * 4 + activations == 3_621_888 + 65_536 + 92_274_688
    last = estimate_stage_memory(config, 2)
    assert last.edge_copies == (256 * 64 + 64) * 4  # the LM head and the final norm
    assert format_bytes(first.total) == "91.5 MiB"


def test_a_device_too_small_for_the_widest_window_gets_the_widest_that_fits():
    config = SwarmConfig()  # windows of 4..32
    widest = estimate_stage_memory(config, 1).total
    assert fitting_in_flight(config, 1, widest) == (32, estimate_stage_memory(config, 1))
    free = estimate_stage_memory(config, 1, 9).total + 1  # 9 fit, 10 do not
    in_flight, estimate = fitting_in_flight(config, 1, free)
    assert in_flight == 9 and estimate.total <= free < estimate_stage_memory(config, 1, 10).total
    least = estimate_stage_memory(config, 1, 4)
    assert fitting_in_flight(config, 1, least.total - 1) == (None, least)  # not even the floor: refused


def test_gossip_off_drops_the_round_and_no_checkfree_plus_drops_the_edge_copies():
    config = SwarmConfig().replace(gossip={"mode": GossipMode.NONE}, recovery={"checkfree_plus": False})
    estimate = estimate_stage_memory(config, 1)
    assert estimate.gossip_round == 0 and estimate.edge_copies == 0
    assert estimate.outer_state == 8 * estimate.parameters  # the OuterReplica exists in every mode


@pytest.mark.parametrize("strategy", list(RecoveryStrategy))
@pytest.mark.parametrize("num_stages", [2, 3, 5])
def test_edge_copies_are_counted_where_the_recovery_code_keeps_them(strategy, num_stages):
    from node.recovery.edge_copies import edge_copies_for

    config = SwarmConfig(num_stages=num_stages).replace(recovery={"strategy": strategy})
    for stage in range(num_stages):
        kept = edge_copies_for(config, stage)
        assert (estimate_stage_memory(config, stage).edge_copies > 0) == (kept is not None), (strategy, stage)


def saved_activation_bytes(config: SwarmConfig, batch: int, seq: int) -> int:
    """Bytes autograd saves for one block-stage forward (weights and the input excepted)."""
    stage = build_stage(config, 1)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(batch, seq, config.model.hidden_size, requires_grad=True)
    skip = {p.untyped_storage().data_ptr() for p in stage.parameters()} | {x.untyped_storage().data_ptr()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x)
    return sum(size for pointer, size in storages.items() if pointer not in skip)


@pytest.mark.parametrize("name", [PresetName.TINY, PresetName.STORIES_15M])
def test_the_per_layer_activation_factor_matches_what_autograd_saves(name):
    m = preset_config(name, **{"model.vocab_size": 256}).model
    small = SwarmConfig(num_stages=2, model=ModelConfig(**{**m.__dict__, "layers_per_stage": 2}))
    batch, seq = 2, 64
    measured = saved_activation_bytes(small, batch, seq)
    # the layers' saved values plus the input each layer normalises (the first one's is the stage input)
    estimated = batch * seq * 2 * activation_values_per_layer(m.hidden_size, m.intermediate_size) * 4
    assert estimated == pytest.approx(measured, rel=0.1)


# ------------------------------------------------------------------------------------------------
# Refusing a device too small for its stage


def test_memory_refusal_is_one_line_when_the_device_is_too_small_and_none_when_it_fits():
    config = preset_config(PresetName.MOBILELLM_1B, 3)
    estimate = estimate_stage_memory(config, 1)
    assert memory_refusal(config, estimate, DeviceMemory("cuda:0", estimate.total)) is None
    refusal = memory_refusal(config, estimate, DeviceMemory("cuda:0", 8 * 2**30))
    assert refusal is not None and "\n" not in refusal
    assert refusal.startswith(f"stage 1 of swarm pipeswarm-demo needs about {format_bytes(estimate.total)} (")
    assert "but cuda:0 has 8.0 GiB free" in refusal


def test_join_refuses_with_exit_code_3_before_building_the_stage(monkeypatch, caplog):
    import node.server.stage_service as stage_service
    from node.server import daemon

    config = preset_config(PresetName.MOBILELLM_350M, 4)
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
    tiny, big = SwarmConfig(), preset_config(PresetName.MOBILELLM_350M, 4)
    with pytest.raises(stage_service.JoinRefused):
        asyncio.run(stage_service.serve_stage(None, tiny, me, asyncio.Event(), stage_service.ServiceOptions()))  # type: ignore[arg-type]
    skip = stage_service.ServiceOptions(check_memory=False)
    asyncio.run(stage_service.serve_stage(None, big, me, asyncio.Event(), skip))  # type: ignore[arg-type]
    monkeypatch.setattr(stage_service, "available_memory", lambda device: DeviceMemory(device, 2**30))
    asyncio.run(stage_service.serve_stage(None, tiny, me, asyncio.Event(), stage_service.ServiceOptions()))  # type: ignore[arg-type]
    assert served == [1, 1]


# ------------------------------------------------------------------------------------------------
# What node status shows


def test_the_status_snapshot_carries_parameters_and_memory_per_stage():
    from node.monitor.status import format_table, stage_requirements

    config = preset_config(PresetName.MOBILELLM_125M, 3)
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


def test_join_refuses_in_one_line_a_device_whose_memory_cannot_be_read(monkeypatch):
    import node.server.stage_service as stage_service

    def no_such_device(device: str) -> DeviceMemory:
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(stage_service, "available_memory", no_such_device)
    with pytest.raises(stage_service.JoinRefused, match="cannot use device cuda:3: Torch not compiled"):
        stage_service.check_stage_fits(SwarmConfig(), 1, "cuda:3")

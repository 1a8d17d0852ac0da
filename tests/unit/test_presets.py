"""node/model/presets.py: preset shapes against their published parameter counts, the even split of
layers over block stages, presets in TOML and on the command line, and the training shape, stage
count and gossip timeout a preset fills (the memory estimate: tests/unit/test_memory_estimate.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from node.config import ConfigError, ModelConfig, SwarmConfig, TrainingConfig
from node.model.llama import build_stage
from node.model.parameters import count_parameters, count_stage_parameters
from node.model.presets import (
    PRESETS,
    PresetName,
    load_config,
    preset_of,
    valid_block_stage_counts,
)


def preset_config(name: PresetName, block_stages: int | None = None, **overrides) -> SwarmConfig:
    """The preset's swarm: at its own stage count unless `block_stages` says."""
    stages = {} if block_stages is None else {"num_stages": block_stages + 1}
    return load_config(**{"model.preset": name.value, **stages, **overrides})


def meta_stage_parameters(config: SwarmConfig, stage: int) -> int:
    """Parameters of the module build_stage gives, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        module = build_stage(config.model, stage, config.seed)
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
    assert per_stage == [count_stage_parameters(config.model, stage) for stage in range(config.num_stages)]
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
    totals = {name: count_parameters(c.model, c.num_stages) for name, c in configs.items()}
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
        config = preset_config(name)
        assert preset_of(config.model, config.num_stages) == name
    custom = load_config(**{"model.preset": "15m", "model.vocab_size": 512})
    assert preset_of(custom.model, custom.num_stages) is None


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
        node.config.read_config(write_toml(tmp_path, '[model]\npreset = "15m"\n'))


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
    # the learning rate falls as 1 / width from 6e-4 at 125m's 576; tiny keeps the default; a written one wins
    rates = {name: load_config(**{"model.preset": name.value}).training.learning_rate for name in PresetName}
    assert rates[PresetName.TINY] == TrainingConfig.learning_rate
    assert rates[PresetName.MOBILELLM_125M] == 6e-4 and rates[PresetName.STORIES_15M] == 1.2e-3
    assert (
        rates[PresetName.MOBILELLM_350M] < rates[PresetName.MOBILELLM_125M] and rates[PresetName.MOBILELLM_1B] == 2.7e-4
    )
    assert load_config(**{"model.preset": "125m", "training.learning_rate": 1e-3}).training.learning_rate == 1e-3
    for name in (PresetName.MOBILELLM_125M, PresetName.MOBILELLM_350M, PresetName.MOBILELLM_1B):
        config = load_config(**{"model.preset": name.value})
        assert config.training.sequence_length == config.model.max_position_embeddings == 2048
    assert load_config(**{"model.preset": "125m"}).model.layers_per_stage == 10  # 3 block stages


def test_a_preset_leaves_the_gossip_section_alone():
    """A round's time follows its payload at run time (gossip_wire.round_budget), not the preset."""
    for name in PresetName:
        assert load_config(**{"model.preset": name.value}).gossip == SwarmConfig().gossip


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

"""node/config: validation, loading, replace, hashing, and docs/config.md generated from the
field docstrings. The default config's hash is pinned: peers of an older version must agree."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import node.config as config_module
from node.config import (
    SECTION_TYPES,
    ConfigError,
    GossipConfig,
    GossipMode,
    HeartbeatConfig,
    ModelConfig,
    Precision,
    RecoveryStrategy,
    RoutingMode,
    SwarmConfig,
    TrainingConfig,
    read_config,
)
from node.config.reference import field_docs, render_reference
from protocol.tensors import Compression
from protocol.version import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "config.md"
REGENERATE = ".venv/bin/python -m node.config > docs/config.md"
DEFAULT_HASH = "59ec1b61ced24c40"  # model.embedding_init_std + protocol 8 (subspace token anchors at std 0.5) + protocol 7 (a stage's state carries AdamW's moments) + protocol 6 (subspace hop codecs, FORWARD without targets) + protocol 5 (spot-checks replay a committed layer; [verification] tolerances per precision, receipts) + protocol 4 (gossip codec: phi_bits 3, phi_step 16, delta_block) + routing, precision, tokenizer_hash, the order-2 markov source, [validation], [verification], max_staleness_steps 2, stashed_weights 4, slow_link_compression int8 with max_in_flight 32: changing it splits old and new peers
SECTIONS = SECTION_TYPES
TOP_LEVEL = [f.name for f in dataclasses.fields(SwarmConfig) if f.name not in SECTIONS]


def all_keys() -> list[str]:
    """Every settable key, as `read_config` overrides spell it: `seed`, `gossip.mode`, ..."""
    return TOP_LEVEL + [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)]


def get(config: SwarmConfig, key: str) -> Any:
    section, _, name = key.rpartition(".")
    return getattr(getattr(config, section) if section else config, name)


def with_value(key: str, value: Any) -> SwarmConfig:
    section, _, name = key.rpartition(".")
    return SwarmConfig().replace(**({section: {name: value}} if section else {name: value}))


# ------------------------------------------------------------------------------------------------
# Defaults, enums and the hash that old peers compute


def test_the_default_config_hash_is_unchanged_so_older_peers_still_agree():
    assert SwarmConfig().config_hash() == DEFAULT_HASH
    assert read_config().config_hash() == DEFAULT_HASH


def test_the_hash_is_sha256_of_the_canonical_json_with_the_protocol_version():
    config = SwarmConfig()
    canonical = json.dumps(
        {"protocol_version": PROTOCOL_VERSION, **config.to_dict()}, sort_keys=True, separators=(",", ":")
    )
    assert config.config_hash() == hashlib.sha256(canonical.encode()).hexdigest()[:16]


def test_the_hash_includes_the_protocol_version(monkeypatch):
    monkeypatch.setattr(config_module, "PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
    assert SwarmConfig().config_hash() != DEFAULT_HASH


def test_enum_fields_hold_members_of_their_enums_and_travel_as_plain_strings():
    config = SwarmConfig()
    assert type(config.gossip.mode) is GossipMode and config.gossip.mode is GossipMode.NOLOCO
    assert type(config.recovery.strategy) is RecoveryStrategy and config.recovery.strategy is RecoveryStrategy.CHECKFREE
    assert (
        type(config.training.wire_compression) is Compression and config.training.wire_compression is Compression.FP16
    )
    raw = config.to_dict()
    for value in (raw["gossip"]["mode"], raw["recovery"]["strategy"], raw["training"]["wire_compression"]):
        assert type(value) is str
    assert config.gossip.pull is None and config.gossip.pull_coefficient == config.gossip.outer_lr


def test_a_config_is_immutable():
    config = SwarmConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.num_stages = 4  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.gossip.inner_steps = 1  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------
# Hashing


def reversed_dict(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: reversed_dict(v) if isinstance(v, dict) else v for k, v in reversed(list(raw.items()))}


def test_the_hash_does_not_depend_on_key_order_or_on_a_transport_round_trip():
    config = SwarmConfig().replace(num_stages=4, gossip={"pull": 0.3, "mode": "diloco"})
    shuffled = reversed_dict(config.to_dict())
    assert list(shuffled) != list(config.to_dict())
    assert SwarmConfig.from_dict(shuffled).config_hash() == config.config_hash()
    # what a joiner does with the record it reads from the DHT
    assert SwarmConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert SwarmConfig.from_dict(json.loads(json.dumps(config.to_dict()))).config_hash() == config.config_hash()


def test_an_integer_written_for_a_float_hashes_like_the_float():
    assert (
        SwarmConfig.from_dict({"training": {"learning_rate": 1}}).config_hash()
        == SwarmConfig.from_dict({"training": {"learning_rate": 1.0}}).config_hash()
    )


def other_value(key: str, value: Any) -> Any:
    """A valid value different from `value` for `key`."""
    special = {
        "model.hidden_size": 128,
        "model.num_attention_heads": 8,
        "model.num_key_value_heads": 2,
        "data.tokenizer_hash": "0123456789abcdef",  # 16 hex digits, as prepare-data writes it
        "data.manifest_hash": "ab" * 32,  # a sha256 in hex
        "data.markov_order": 1,  # order 3 over 16 tokens would exceed the chain's context limit
        "training.min_in_flight": 2,  # more than the default max_in_flight 4 would be refused
        "gossip.delta_block": 128,  # blocks of 4-bit values pair up in bytes: even sizes only
        "gossip.phi_bits": 8,  # 4 or 8
    }
    if key in special:
        return special[key]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (GossipMode, RecoveryStrategy, RoutingMode, Compression, Precision)):
        return next(member for member in type(value) if member != value)
    if value is None:
        return 0.5
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, int):
        return value + 1
    return value * 1.5 if value > 0 else value + 0.25  # 1.5x: stays inside every bound below


@pytest.mark.parametrize("key", all_keys())
def test_the_hash_changes_when_any_field_changes(key):
    default = SwarmConfig()
    changed = with_value(key, other_value(key, get(default, key)))
    assert get(changed, key) != get(default, key)
    assert changed.config_hash() != default.config_hash()


def test_every_field_change_gives_a_distinct_hash():
    hashes = {with_value(key, other_value(key, get(SwarmConfig(), key))).config_hash() for key in all_keys()}
    assert len(hashes) == len(all_keys()) and DEFAULT_HASH not in hashes


# ------------------------------------------------------------------------------------------------
# Validation: each `need` rule of `validate`, with the nearest accepted value beside it

RULES = [
    # (key, rejected value, accepted value, part of the message)
    ("swarm_id", "", "s", "swarm_id must be 1..64 characters"),
    ("swarm_id", "x" * 65, "x" * 64, "swarm_id must be 1..64 characters"),
    ("swarm_id", "my swarm", "my-swarm_2.b", "swarm_id may hold letters, digits, - _ . only"),
    ("swarm_id", "a/b", "a.b", "swarm_id may hold letters, digits, - _ . only"),
    ("num_stages", 1, 2, "num_stages counts stage 0 and must be in 2..64"),
    ("data.manifest_hash", "AB" * 32, "ab" * 32, "data.manifest_hash must be empty or 64 lowercase hex"),
    ("data.manifest_hash", "ab" * 8, "", "data.manifest_hash must be empty or 64 lowercase hex"),
    ("num_stages", 65, 64, "num_stages counts stage 0 and must be in 2..64"),
    ("model.num_attention_heads", 3, 8, "hidden_size must be divisible by num_attention_heads"),
    ("model.num_key_value_heads", 3, 2, "num_key_value_heads must divide num_attention_heads"),
    ("model.hidden_size", 12, 16, "head dimension must be even (rotary embedding)"),
    ("model.layers_per_stage", 0, 1, "layers_per_stage >= 1 and vocab_size >= 2"),
    ("model.vocab_size", 1, 2, "layers_per_stage >= 1 and vocab_size >= 2"),
    ("training.sequence_length", 257, 256, "sequence_length exceeds max_position_embeddings"),
    ("model.max_position_embeddings", 63, 64, "sequence_length exceeds max_position_embeddings"),
    ("training.microbatch_size", 0, 1, "batch sizes must be >= 1"),
    ("training.microbatches_per_step", 0, 1, "batch sizes must be >= 1"),
    ("training.min_in_flight", 0, 1, "batch sizes must be >= 1"),
    ("training.max_in_flight", 3, 4, "training.max_in_flight must be >= training.min_in_flight"),
    ("training.hop_timeout", 0.0, 0.01, "hop_timeout, grad_clip > 0; max_retries, stashed_weights >= 0"),
    ("training.max_retries", -1, 0, "hop_timeout, grad_clip > 0; max_retries, stashed_weights >= 0"),
    ("training.stashed_weights", -1, 0, "hop_timeout, grad_clip > 0; max_retries, stashed_weights >= 0"),
    ("training.grad_clip", 0.0, 0.01, "hop_timeout, grad_clip > 0; max_retries, stashed_weights >= 0"),
    ("gossip.inner_steps", 0, 1, "gossip: inner_steps >= 1, timeout > 0, norm factor > 1"),
    ("gossip.round_timeout", 0.0, 0.01, "gossip: inner_steps >= 1, timeout > 0, norm factor > 1"),
    ("gossip.phi_bits", 6, 2, "gossip: phi_bits 2, 3, 4 or 8, phi_step > 0, delta_block even and >= 2"),
    ("gossip.phi_step", 0.0, 0.5, "gossip: phi_bits 2, 3, 4 or 8, phi_step > 0, delta_block even and >= 2"),
    ("gossip.delta_block", 63, 2, "gossip: phi_bits 2, 3, 4 or 8, phi_step > 0, delta_block even and >= 2"),
    ("gossip.max_norm_factor", 1.0, 1.01, "gossip: inner_steps >= 1, timeout > 0, norm factor > 1"),
    ("recovery.lr_scale", 0.0, 0.01, "recovery: lr_scale > 0, waits >= 0"),
    ("recovery.lost_grace", -0.5, 0.0, "recovery: lr_scale > 0, waits >= 0"),
    ("recovery.rebalance_wait", -0.5, 0.0, "recovery: lr_scale > 0, waits >= 0"),
    ("heartbeat.period", 0.0, 0.01, "heartbeat: 0 < period < ttl"),
    ("heartbeat.period", 15.0, 14.9, "heartbeat: 0 < period < ttl"),
    ("heartbeat.ttl", 4.0, 5.1, "heartbeat: 0 < period < ttl"),
    ("data.source", "", "corpus.txt", "data.source must be set"),
    ("data.markov_order", 0, 1, "data: markov_order and markov_alphabet must be >= 1"),
    ("data.markov_alphabet", 0, 1, "data: markov_order and markov_alphabet must be >= 1"),
    ("data.markov_alphabet", 33, 32, "the markov chain has 1089 contexts"),
    ("validation.interval", -0.5, 0.0, "validation: interval >= 0 (0: off), batches in 1..256"),
    ("validation.batches", 0, 1, "validation: interval >= 0 (0: off), batches in 1..256"),
    ("validation.batches", 257, 256, "validation: interval >= 0 (0: off), batches in 1..256"),
    ("verification.rate", -0.01, 0.0, "verification: 0 <= rate <= raised_rate <= 1"),
    ("verification.rate", 0.26, 0.25, "verification: 0 <= rate <= raised_rate <= 1"),
    ("verification.raised_rate", 1.01, 1.0, "verification: 0 <= rate <= raised_rate <= 1"),
    ("verification.raised_seconds", -1.0, 0.0, "verification: 0 <= rate <= raised_rate <= 1"),
    ("verification.ban_seconds", -1.0, 0.0, "verification: 0 <= rate <= raised_rate <= 1"),
    ("verification.strikes_to_ban", 0, 1, "verification: strikes_to_ban >= 1"),
    ("verification.strike_half_life", 0.0, 0.01, "verification: strikes_to_ban >= 1"),
    ("verification.max_concurrent", 0, 1, "verification: strikes_to_ban >= 1"),
    ("verification.audit_seconds", 0.0, 0.01, "verification: strikes_to_ban >= 1"),
    ("verification.fp32_tolerance", 0.0, 1e-6, "verification: the tolerances and receipt_seconds > 0"),
    ("verification.fp16_tolerance", 0.0, 1e-6, "verification: the tolerances and receipt_seconds > 0"),
    ("verification.bf16_tolerance", 0.0, 1e-6, "verification: the tolerances and receipt_seconds > 0"),
    ("verification.receipt_seconds", 0.0, 0.01, "verification: the tolerances and receipt_seconds > 0"),
    ("verification.max_receipts", 0, 1, "verification: the tolerances and receipt_seconds > 0"),
]


@pytest.mark.parametrize("key, bad, good, message", RULES, ids=[f"{r[0]}={r[1]!r}"[:40] for r in RULES])
def test_each_validation_rule_rejects_a_bad_value_and_accepts_the_nearest_good_one(key, bad, good, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        with_value(key, bad)
    assert get(with_value(key, good), key) == good


def test_validation_runs_on_direct_construction_too():
    with pytest.raises(ConfigError, match="num_stages"):
        SwarmConfig(num_stages=1)
    with pytest.raises(ConfigError, match="heartbeat"):
        SwarmConfig(heartbeat=HeartbeatConfig(period=20.0, ttl=15.0))


def test_unknown_keys_are_refused_with_their_place():
    with pytest.raises(ConfigError, match=re.escape("config: unknown keys ['bogus']")):
        SwarmConfig.from_dict({"bogus": 1})
    with pytest.raises(ConfigError, match=re.escape("model: unknown keys ['hiden_size']")):
        SwarmConfig.from_dict({"model": {"hiden_size": 64}})
    with pytest.raises(ConfigError, match=re.escape("config: unknown keys ['optimizer']")):
        SwarmConfig.from_dict({"optimizer": {}})


def test_a_section_or_the_config_must_be_a_table():
    with pytest.raises(ConfigError, match="model: expected a table, got int"):
        SwarmConfig.from_dict({"model": 3})
    with pytest.raises(ConfigError, match="config: expected a table, got list"):
        SwarmConfig.from_dict([("seed", 1)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"num_stages": "3"}, "num_stages: expected int, got str"),
        ({"num_stages": 3.0}, "num_stages: expected int, got float"),
        ({"swarm_id": 5}, "swarm_id: expected str, got int"),
        ({"training": {"learning_rate": "fast"}}, "training.learning_rate: expected float, got str"),
        ({"recovery": {"checkfree_plus": 1}}, "recovery.checkfree_plus: expected bool, got int"),
        ({"recovery": {"checkfree_plus": "yes"}}, "recovery.checkfree_plus: expected bool, got str"),
        ({"gossip": {"pull": "half"}}, "gossip.pull: expected float, got str"),
        ({"model": {"vocab_size": [256]}}, "model.vocab_size: expected int, got list"),
    ],
)
def test_wrong_types_are_refused_with_the_key_and_both_types(raw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        SwarmConfig.from_dict(raw)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"seed": True}, "seed: expected int, got bool"),
        ({"model": {"layers_per_stage": False}}, "model.layers_per_stage: expected int, got bool"),
        ({"heartbeat": {"period": True}}, "heartbeat.period: expected float, got bool"),
        ({"gossip": {"pull": False}}, "gossip.pull: expected float, got bool"),
    ],
)
def test_a_bool_is_never_taken_for_a_number(raw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        SwarmConfig.from_dict(raw)


def test_numbers_accepted_where_a_float_or_an_optional_float_is_expected():
    config = SwarmConfig.from_dict(
        {"training": {"learning_rate": 1}, "gossip": {"pull": 0}, "recovery": {"checkfree_plus": False}}
    )
    assert config.training.learning_rate == 1.0 and type(config.training.learning_rate) is float
    assert config.gossip.pull == 0.0 and type(config.gossip.pull) is float and config.gossip.pull_coefficient == 0.0
    assert config.recovery.checkfree_plus is False
    assert SwarmConfig.from_dict({"gossip": {"pull": None}}).gossip.pull is None


@pytest.mark.parametrize(
    "key, bad, choices",
    [
        ("gossip.mode", "gossip", "noloco, diloco, none"),
        ("recovery.strategy", "CheckFree", "checkfree, copy, random, zero, checkpoint"),
        ("training.wire_compression", "zstd", "none, fp16, bf16, int8"),
        ("gossip.mode", 1, "noloco, diloco, none"),
    ],
)
def test_an_invalid_enum_value_names_the_key_and_lists_the_choices(key, bad, choices):
    with pytest.raises(ConfigError, match=re.escape(f"{key}: {bad!r} is not one of {choices}")):
        with_value(key, bad)


def test_enum_values_are_accepted_as_strings_or_members():
    assert with_value("gossip.mode", "diloco").gossip.mode is GossipMode.DILOCO
    assert with_value("gossip.mode", GossipMode.NONE).gossip.mode is GossipMode.NONE
    assert with_value("recovery.strategy", "copy").recovery.strategy is RecoveryStrategy.COPY
    assert with_value("training.wire_compression", "int8").training.wire_compression is Compression.INT8


# ------------------------------------------------------------------------------------------------
# read_config: defaults < TOML file < overrides; replace


TOML = """\
num_stages = 4
seed = 7

[training]
learning_rate = 0.01
wire_compression = "int8"

[gossip]
mode = "diloco"
"""


def test_load_config_layers_defaults_then_the_toml_file_then_overrides(tmp_path):
    path = tmp_path / "swarm.toml"
    path.write_text(TOML)
    from_file = read_config(path)
    assert (from_file.num_stages, from_file.seed) == (4, 7)
    assert from_file.training.learning_rate == 0.01 and from_file.training.wire_compression is Compression.INT8
    assert from_file.gossip.mode is GossipMode.DILOCO
    # a section in the file replaces only the keys it names
    assert from_file.training.microbatch_size == TrainingConfig().microbatch_size
    assert from_file.gossip.inner_steps == GossipConfig().inner_steps
    assert from_file.swarm_id == SwarmConfig().swarm_id and from_file.model == ModelConfig()

    flagged = read_config(
        path, num_stages=5, swarm_id="other", **{"training.learning_rate": 0.02, "heartbeat.ttl": 30.0}
    )
    assert (flagged.num_stages, flagged.swarm_id, flagged.seed) == (5, "other", 7)
    assert flagged.training.learning_rate == 0.02 and flagged.training.wire_compression is Compression.INT8
    assert flagged.heartbeat == HeartbeatConfig(period=5.0, ttl=30.0)
    assert read_config(None, **{"gossip.inner_steps": 3}).gossip.inner_steps == 3


def test_none_overrides_are_ignored_like_flags_left_out(tmp_path):
    path = tmp_path / "swarm.toml"
    path.write_text(TOML)
    assert read_config(
        path, num_stages=None, seed=None, **{"heartbeat.ttl": None, "training.learning_rate": None}
    ) == read_config(path)
    assert read_config(None, swarm_id=None, **{"heartbeat.period": None}) == SwarmConfig()


def test_load_config_validates_the_merged_result(tmp_path):
    path = tmp_path / "swarm.toml"
    path.write_text("[heartbeat]\nperiod = 10.0\n")
    assert read_config(path).heartbeat.period == 10.0
    with pytest.raises(ConfigError, match="heartbeat: 0 < period < ttl"):
        read_config(path, **{"heartbeat.ttl": 8.0})
    path.write_text("[model]\nhiden_size = 64\n")
    with pytest.raises(ConfigError, match=re.escape("model: unknown keys ['hiden_size']")):
        read_config(path)
    path.write_text("model = 3\n")
    with pytest.raises(ConfigError, match="model: expected a table"):
        read_config(path)


def test_an_unreadable_or_malformed_toml_file_is_a_config_error_naming_it(tmp_path):
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError, match=re.escape(str(missing))):
        read_config(missing)
    broken = tmp_path / "broken.toml"
    broken.write_text("num_stages = = 3\n")
    with pytest.raises(ConfigError, match=re.escape(str(broken))):
        read_config(broken)


def test_replace_overrides_top_level_values_and_merges_section_fields():
    base = SwarmConfig()
    changed = base.replace(num_stages=4, gossip={"inner_steps": 7}, recovery={"strategy": "copy"})
    assert changed.num_stages == 4 and changed.gossip.inner_steps == 7
    assert changed.recovery.strategy is RecoveryStrategy.COPY
    assert changed.gossip.outer_lr == base.gossip.outer_lr and changed.recovery.lr_scale == base.recovery.lr_scale
    assert changed.model == base.model and base.num_stages == 3  # the original is untouched
    assert base.replace() == base
    with pytest.raises(ConfigError, match="num_stages"):
        base.replace(num_stages=1)
    with pytest.raises(ConfigError, match="unknown keys"):
        base.replace(gossip={"inner_step": 7})
    with pytest.raises(ConfigError, match="unknown keys"):
        base.replace(stages=4)


def test_to_dict_and_from_dict_round_trip():
    config = SwarmConfig().replace(seed=3, gossip={"pull": 0.25}, data={"source": "corpus.txt"})
    assert SwarmConfig.from_dict(config.to_dict()) == config
    assert SwarmConfig.from_dict({}) == SwarmConfig()


# ------------------------------------------------------------------------------------------------
# Field docstrings and docs/config.md


def test_every_config_field_has_a_one_line_docstring():
    docs = field_docs()
    problems = []
    for cls in (SwarmConfig, *SECTIONS.values()):
        for spec in dataclasses.fields(cls):
            doc = docs.get(cls.__name__, {}).get(spec.name, "")
            if not doc:
                problems.append(f"{cls.__name__}.{spec.name}: no docstring (a string literal on the line after it)")
            elif "\n" in doc:
                problems.append(f"{cls.__name__}.{spec.name}: docstring spans several lines")
    assert not problems, "\n".join(problems)


def test_docs_config_md_is_the_generated_reference():
    expected = render_reference()
    actual = REFERENCE.read_text(encoding="utf-8") if REFERENCE.exists() else ""
    if actual != expected:
        diff = "".join(
            list(
                difflib.unified_diff(
                    actual.splitlines(keepends=True), expected.splitlines(keepends=True), "docs/config.md", "generated"
                )
            )[:60]
        )
        pytest.fail(f"docs/config.md is out of date; regenerate it with `{REGENERATE}`\n{diff}")


def test_the_documented_regeneration_command_prints_the_reference():
    result = subprocess.run(
        [sys.executable, "-m", "node.config"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == render_reference()


def test_the_reference_has_one_row_per_field_and_lists_enum_members():
    text = render_reference()
    for section, cls in [("Top level", SwarmConfig), *((f"[{s}]", c) for s, c in SECTIONS.items())]:
        assert f"## {section}\n" in text
        body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
        for spec in dataclasses.fields(cls):
            if spec.name in SECTIONS:
                continue
            assert re.search(rf"^\| `{spec.name}` \|", body, re.M), f"no row for {section} {spec.name}"
    for key, enum_type in (("mode", GossipMode), ("strategy", RecoveryStrategy), ("wire_compression", Compression)):
        row = re.search(rf"^\| `{key}` \|.*$", text, re.M).group(0)  # type: ignore[union-attr]
        assert "one of " + ", ".join(f"`{m.value}`" for m in enum_type) in row
        for member in enum_type:
            assert re.search(rf"^\| `{member.value}` \|", text, re.M)
    assert "| `pull` | float, or unset | unset |" in text
    assert "| `checkfree_plus` | bool | `true` |" in text


def test_the_documented_bootstrap_flags_set_the_documented_keys(monkeypatch):
    import node.cli as cli

    documented = dict(re.findall(r"^\| `(--[a-z-]+)` \| `([a-z_.]+)` \|$", render_reference(), re.M))
    assert documented, "the reference lists no `node bootstrap` flag"
    seen: list[dict[str, Any]] = []

    def fake_load_config(path, **overrides):
        seen.append(overrides)
        raise ConfigError("stop before starting a node")

    monkeypatch.setattr(cli, "load_config", fake_load_config)
    monkeypatch.setattr(cli, "configure_logging", lambda level: None)
    assert cli.main(["bootstrap"]) == 2
    assert set(seen[-1]) == set(documented.values()), "node bootstrap's config flags and docs/config.md differ"
    for flag, key in documented.items():
        assert cli.main(["bootstrap", flag, "7"]) == 2
        assert {k for k, v in seen[-1].items() if v is not None} == {key}, flag
        assert str(seen[-1][key]) in ("7", "7.0"), flag

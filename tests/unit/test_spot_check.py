"""Spot-checks, the pure rules (node/pipeline/spot_check.py), a stage's boundaries layer by layer
(node/stage/layers.py) and their replay (node/pipeline/layer_replay.py): what a check compares, and the tolerance that separates an honest
replica's rounding from a fault. The exchange over the wire is tests/unit/test_verifier.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from dht.records import PeerRecord, RecordError, VerificationReport
from node.config import Precision, SwarmConfig, VerificationConfig
from node.model.llama import build_stage
from node.pipeline.layer_replay import replay_layer
from node.pipeline.spot_check import (
    CheckRate,
    Finding,
    RecomputeTolerance,
    StrikeBook,
    arrived_as,
    digest,
    is_digest,
    parse_precision,
    probe_direction,
    update_error,
)
from node.stage.layers import LayerLayout, stage_boundaries
from node.stage.precision import StagePrecision
from protocol.tensors import Compression, decode_tensor, encode_tensor
from tests.helpers.clock import FakeClock
from tests.helpers.faulty_node import FaultKind, make_faulty

SETTINGS = VerificationConfig()
TOLERANCE = RecomputeTolerance.from_settings(SETTINGS)


def with_layers(layers: int) -> SwarmConfig:
    config = SwarmConfig()
    return dataclasses.replace(config, model=dataclasses.replace(config.model, layers_per_stage=layers))


# ---- comparing what crossed the wire ------------------------------------------------------------


def test_a_tensor_arrives_as_one_of_the_codecs_makes_it_and_nothing_else_passes() -> None:
    torch.manual_seed(0)
    sent = torch.randn(2, 8, 64)
    for codec in Compression:
        assert arrived_as(sent, decode_tensor(encode_tensor(sent, codec)))
    nudged = sent.clone()
    nudged[0, 0, 0] = torch.nextafter(nudged[0, 0, 0], torch.tensor(1e9))  # one ulp on one element
    assert not arrived_as(sent, nudged)
    assert not arrived_as(sent, 1.5 * sent)
    assert not arrived_as(sent, sent[:1]) and not arrived_as(sent, sent.double())


def test_the_error_is_measured_on_the_layer_s_update_not_on_the_residual_stream() -> None:
    start = torch.ones(1000)
    update = torch.full((1000,), 0.01)
    out, scaled = start + update, start + 1.05 * update
    assert update_error(scaled, out, start).item() == pytest.approx(0.05, rel=1e-3)
    assert (scaled - out).norm() / out.norm() < 1e-3  # what a comparison of the outputs would see
    zero = torch.zeros(10)
    assert update_error(zero, zero, torch.ones(10)).item() == 0.0  # a layer that adds nothing (all weights 0)


def test_digests_bind_shape_and_every_bit() -> None:
    x = torch.randn(4, 8)
    assert digest(x) == digest(x.clone()) and is_digest(digest(x))
    assert digest(x) != digest(x.reshape(8, 4))
    y = x.clone()
    y[1, 1] = torch.nextafter(y[1, 1], torch.tensor(1e9))
    assert digest(x) != digest(y)
    with pytest.raises(ValueError):
        digest(x.double())
    assert not is_digest("zz" * 16) and not is_digest(digest(x)[:-1])


def test_a_replica_declares_a_concrete_precision() -> None:
    assert parse_precision("bf16") is Precision.BF16 and parse_precision("fp32") is Precision.FP32
    assert parse_precision("auto") is None and parse_precision("fp8") is None
    assert TOLERANCE.of(Precision.FP32) < TOLERANCE.of(Precision.FP16) < TOLERANCE.of(Precision.BF16)


# ---- one layer at a time ------------------------------------------------------------------------


def test_the_boundaries_layer_by_layer_are_the_stage_s_own_forward_and_backward() -> None:
    config = with_layers(3)
    stage = build_stage(config.model, 1, config.seed)
    layout = LayerLayout(config.model)
    named = dict(stage.named_parameters())
    hidden = torch.randn(2, 16, config.model.hidden_size)
    grad = torch.randn_like(hidden)
    leaf = hidden.clone().requires_grad_(True)
    output = stage(leaf)
    (grad_input,) = torch.autograd.grad(output, [leaf], grad)
    forward, backward = stage_boundaries(stage, layout, named, hidden, grad, StagePrecision(Precision.FP32, "cpu"))
    assert backward is not None and len(forward) == len(backward) == 4
    assert torch.equal(forward[-1], output.detach()) and torch.equal(backward[0], grad_input)
    for index in range(3):
        weights = layout.unflatten(layout.flatten(layout.of_stage(named, index)))
        errors = replay_layer(layout, weights, forward[index], forward[index + 1], backward[index + 1], backward[index])
        assert errors == (0.0, 0.0)
    with pytest.raises(ValueError):
        layout.unflatten(torch.zeros(layout.numel + 1))


def scaled_layer_errors(config: SwarmConfig, precision: Precision, fault: FaultKind | None) -> tuple[float, float]:
    """One layer computed as a replica in `precision` would (faulty or not), replayed in fp32."""
    torch.manual_seed(1)
    stage = build_stage(config.model, 1, config.seed)
    if fault is not None:
        make_faulty(stage, fault)
    layout = LayerLayout(config.model)
    named = {name: p.detach() for name, p in stage.named_parameters()}
    hidden = torch.randn(4, 32, config.model.hidden_size)
    grad = 1e-3 * torch.randn_like(hidden)
    forward, backward = stage_boundaries(stage, layout, named, hidden, grad, StagePrecision(precision, "cpu"))
    assert backward is not None
    errors = replay_layer(layout, layout.of_stage(named, 0), forward[0], forward[1], backward[1], backward[0])
    assert errors[1] is not None
    return errors[0], errors[1]


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.FP16, Precision.BF16])
def test_an_honest_layer_is_within_its_precision_s_tolerance_and_a_scaled_one_far_outside(precision) -> None:
    """The margins (docs/verification.md, "The tolerance"): honest rounding well inside, every
    Linear output x1.5 far outside. The x1.01 and x1.05 figures are in the benchmark."""
    config = SwarmConfig()
    allowed = TOLERANCE.of(precision)
    honest = scaled_layer_errors(config, precision, None)
    assert max(honest) < allowed / 3, honest
    faulty = scaled_layer_errors(config, precision, FaultKind.SCALE)
    assert min(faulty) > 10 * allowed, faulty


def test_a_liar_s_own_scaled_weights_reproduce_its_outputs() -> None:
    """Why a commitment is needed: every Linear output x1.5 is exactly the layer at weights x1.5,
    so a replica free to show any weights after the layer is named would pass the replay."""
    config = SwarmConfig()
    stage = build_stage(config.model, 1, config.seed)
    make_faulty(stage, FaultKind.SCALE)
    layout = LayerLayout(config.model)
    named = {name: p.detach() for name, p in stage.named_parameters()}
    hidden = torch.randn(2, 16, config.model.hidden_size)
    forward, _ = stage_boundaries(stage, layout, named, hidden, None, StagePrecision(Precision.FP32, "cpu"))
    honest_weights = layout.of_stage(named, 0)
    shown = {name: w * 1.5 if name.endswith("_proj.weight") else w for name, w in honest_weights.items()}
    assert replay_layer(layout, honest_weights, forward[0], forward[1])[0] > 1.0
    assert replay_layer(layout, shown, forward[0], forward[1])[0] < TOLERANCE.of(Precision.FP32)


# ---- strikes and rates ------------------------------------------------------------------------


def test_strikes_decay_so_a_rare_fault_is_forgiven() -> None:
    clock = FakeClock()
    book = StrikeBook(strikes_to_ban=3, half_life=600.0, clock=clock)
    assert not book.strike("a") and not book.strike("a")
    assert book.strike("a")  # three in a row: banned, and the score starts again
    assert book.score("a") == 0.0
    for _ in range(10):  # one strike an hour never adds up to three
        assert not book.strike("b")
        clock.now += 3600.0
    assert book.score("b") < 0.05
    assert "b" not in book.scores()


def test_strikes_a_few_seconds_apart_still_add_up_to_a_ban() -> None:
    clock = FakeClock()
    book = StrikeBook(strikes_to_ban=3, half_life=600.0, clock=clock)
    for _ in range(2):
        assert not book.strike("a")
        clock.now += 20.0
    assert book.strike("a")  # 3 strikes in 40 s: 2.93 after decay, within the margin


def test_an_unanswered_check_raises_that_peer_s_rate_for_a_while() -> None:
    clock = FakeClock()
    rate = CheckRate(0.02, 0.25, 300.0, clock=clock)
    rate.raise_for("a")
    assert rate.of("a") == 0.25 and rate.of("b") == 0.02
    clock.now += 301.0
    assert rate.of("a") == 0.02


def test_evidence_is_every_finding_but_passed_and_the_probe_is_a_unit_direction() -> None:
    assert [f for f in Finding if not f.is_evidence] == [Finding.PASSED]
    probe = probe_direction(torch.Size([2, 3, 4]), torch.Generator().manual_seed(1))
    assert probe.shape == (2, 3, 4) and probe.norm().item() == pytest.approx(1.0)


def test_a_verification_report_is_validated_like_any_record_field() -> None:
    report = VerificationReport(
        checks=3, failed=1, unanswered=2, check_seconds=0.25, strikes={"peer-a": 1.5}, bans=["peer-b"]
    )
    record = PeerRecord("me", 1, verification=report)
    assert PeerRecord.from_wire(record.to_wire()).verification == report
    for bad in (
        {"strikes": {f"p{i}": 1.0 for i in range(17)}},
        {"strikes": {"p": float("nan")}},
        {"bans": "peer"},
        {"checks": -1},
        {"largest_error": float("inf")},
        {"check_seconds": -1.0},
    ):
        with pytest.raises(RecordError):
            VerificationReport.from_wire(bad)


def test_a_fault_only_alters_the_block_stage_it_was_put_in() -> None:
    config = SwarmConfig()
    faulty, honest = build_stage(config.model, 1, config.seed), build_stage(config.model, 1, config.seed)
    make_faulty(faulty, FaultKind.SCALE)
    hidden = torch.randn(1, 4, config.model.hidden_size)
    assert not torch.allclose(faulty(hidden), honest(hidden))
    linear = nn.Linear(4, 4, bias=False)  # any other Linear (a checker's replay, stage 0's head) is honest
    x = torch.randn(3, 4)
    assert torch.equal(linear(x), x @ linear.weight.T)

"""node/averaging/gossip_codec.py: what a NoLoCo round puts on the wire, and the outer step on it.

4-bit Delta round trips within half a quantization step; error feedback delivers the whole
progress over rounds; a round moves under 2 bytes a parameter at the real presets' shapes; the pull
acts on the sampled phi coordinates only and is the exact step at stride 1; what a partner could
send wrong (sizes, NaN scales) is refused.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.averaging.gossip_codec import GossipCodec, PhiSample, dequantize4, quantize4
from node.averaging.gossip_wire import MIN_GOSSIP_BANDWIDTH, TRANSFER_SLACK, GossipWire
from node.averaging.noloco import OuterState, outer_step
from node.averaging.outer_replica import OuterReplica
from node.config import GossipConfig
from node.model.parameters import count_stage_parameters
from node.model.presets import load_config


@settings(max_examples=60, deadline=None)
@given(
    numel=st.integers(min_value=1, max_value=700),
    block=st.sampled_from([2, 8, 64, 100]),
    scale=st.floats(min_value=1e-8, max_value=1e4),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_4_bit_codes_round_trip_within_half_a_step_of_their_block(numel, block, scale, seed):
    x = torch.randn(numel, generator=torch.Generator(device="cpu").manual_seed(seed), device="cpu") * scale
    codes, scales = quantize4(x, block)
    blocks = math.ceil(numel / block)
    assert codes.dtype == torch.uint8 and codes.numel() == blocks * block // 2
    assert scales.dtype == torch.float32 and scales.numel() == blocks
    y = dequantize4(codes, scales, numel, block)
    step = scales.repeat_interleave(block)[:numel]  # each value's block scale (absmax / 7)
    assert torch.all((x - y).abs() <= step / 2 * (1 + 1e-5) + 1e-30)


def test_an_all_zero_block_stays_zero_and_sizes_that_do_not_match_are_refused():
    x = torch.zeros(130, device="cpu")
    x[:64] = torch.linspace(-1, 1, 64)
    codes, scales = quantize4(x, 64)
    assert torch.equal(dequantize4(codes, scales, 130, 64)[64:], torch.zeros(66))
    with pytest.raises(ValueError, match="do not encode"):
        dequantize4(codes[:-1], scales, 130, 64)
    with pytest.raises(ValueError, match="do not encode"):
        dequantize4(codes, scales, 200, 64)
    with pytest.raises(ValueError, match="even"):
        quantize4(x, 63)


def test_error_feedback_delivers_all_of_the_progress_over_rounds():
    """Sent over R rounds, the decoded Deltas add up to the R Deltas within one quantization step:
    what rounding leaves out of one round goes out with the next."""
    codec = GossipCodec(block=64)
    g = torch.Generator(device="cpu").manual_seed(0)
    deltas = [torch.randn(40, 37, generator=g, device="cpu") * 1e-3 for _ in range(12)]
    residual = [torch.zeros(40, 37)]
    delivered = torch.zeros(40, 37)
    plain = torch.zeros(40, 37)
    for delta in deltas:
        wire, sent, residual = codec.encode_delta([delta], residual)
        assert torch.equal(sent[0], codec.decode_delta(wire, [delta.shape])[0])  # what the partner decodes
        delivered += sent[0]
        plain += codec.decode_delta(codec.encode_delta([delta], [torch.zeros_like(delta)])[0], [delta.shape])[0]
    total = torch.stack(deltas).sum(0)
    assert torch.allclose(delivered + residual[0], total, atol=1e-9)  # nothing lost, the rest still to send
    last_step = wire[1].max()  # the last round's largest block scale: one quantization step
    assert (delivered - total).abs().max() <= last_step / 2 * (1 + 1e-5)  # within half a step of the last round
    assert (delivered - total).norm() < 0.5 * (plain - total).norm()  # far closer than without feedback


@pytest.mark.parametrize("preset", ["15m", "125m"])
def test_a_round_moves_under_two_bytes_a_parameter_at_the_real_presets(preset):
    config = load_config(**{"model.preset": preset})
    codec = GossipCodec(config.gossip.delta_block, config.gossip.phi_stride)
    for stage in (0, 1):
        parameters = count_stage_parameters(config, stage)
        # the stage's tensors' sizes, as the replica lays them out (numel per parameter tensor)
        from node.model.llama import build_stage

        with torch.device("meta"):
            numels = [p.numel() for p in build_stage(config, stage).parameters()]
        assert sum(numels) == parameters
        one_way = codec.layout(numels, PhiSample(3, codec.phi_stride)).nbytes
        assert 2 * one_way / parameters <= 2.0, (stage, 2 * one_way / parameters)
        assert 2 * one_way / parameters == pytest.approx(2 * codec.bytes_per_parameter(), rel=0.01)


def test_the_pull_acts_on_the_sampled_coordinates_and_is_the_exact_step_at_stride_1():
    g = torch.Generator(device="cpu").manual_seed(1)
    shapes = [(6, 5), (7,)]
    phi = [torch.randn(s, generator=g, device="cpu") for s in shapes]
    partner = [p + torch.randn(p.shape, generator=g, device="cpu") for p in phi]
    own_delta = [torch.randn(s, generator=g, device="cpu") * 0.1 for s in shapes]
    partner_delta = [torch.randn(s, generator=g, device="cpu") * 0.1 for s in shapes]
    state = OuterState(phi=phi)
    exact = outer_step(state, own_delta, [partner], [partner_delta], 0.5, 0.7, 0.7)
    whole = PhiSample(0, 1)
    sampled_all = outer_step(state, own_delta, [whole.take(partner)], [partner_delta], 0.5, 0.7, 0.7, whole)
    assert all(torch.allclose(a, b) for a, b in zip(exact.phi, sampled_all.phi))
    sample = PhiSample(2, 3)
    partial = outer_step(state, own_delta, [sample.take(partner)], [partner_delta], 0.5, 0.7, 0.7, sample)
    no_pull = outer_step(state, own_delta, [partner], [partner_delta], 0.5, 0.7, 0.0)
    for k in range(len(shapes)):
        flat, pulled, unpulled = partial.phi[k].reshape(-1), exact.phi[k].reshape(-1), no_pull.phi[k].reshape(-1)
        sampled = torch.zeros_like(flat, dtype=torch.bool)
        sampled[2::3] = True
        assert torch.allclose(flat[sampled], pulled[sampled])  # the sampled coordinates: pulled as before
        assert torch.allclose(flat[~sampled], unpulled[~sampled])  # the others: Delta only, no pull


def test_a_partner_whose_scales_hold_a_nan_is_refused_as_not_finite():
    module = torch.nn.Linear(16, 8)
    replica = OuterReplica(module, GossipConfig())
    with torch.no_grad():
        module.weight.add_(0.01)
    sample = PhiSample(1, GossipConfig().phi_stride)
    start = replica.capture_start(inner_step=5, sample=sample)
    received = [t.clone() for t in start.wire]
    received[len(replica.params) + 1][0] = math.nan  # the first tensor's first Delta scale
    phi, delta = replica.receive(received, sample)
    reason, measures = replica.check_partner(start, phi, delta)
    assert reason is not None and "NaN or Inf" in reason and measures is None


def test_a_round_budget_is_the_payload_at_the_link_rate_on_top_of_the_round_timeout():
    module = torch.nn.Linear(1024, 1024)
    replica = OuterReplica(module, GossipConfig())
    rates = {"fast": 100e6}
    transport = SimpleNamespace(channels=SimpleNamespace(peer_link_rate=lambda peer: rates.get(peer)))
    wire = GossipWire(transport, GossipConfig(), replica)
    sample = PhiSample(0, 10)
    payload = replica.wire_layout(sample).nbytes
    assert payload < replica.total_numel  # under a byte a parameter one way
    unknown = wire.round_budget(sample, "stranger")
    assert unknown == pytest.approx(GossipConfig().round_timeout + TRANSFER_SLACK * payload / MIN_GOSSIP_BANDWIDTH)
    assert wire.round_budget(sample, "fast") == pytest.approx(
        GossipConfig().round_timeout + TRANSFER_SLACK * payload / 100e6
    )
    rates["slow"] = 1e3  # a measured rate is never taken below the floor
    assert wire.round_budget(sample, "slow") == pytest.approx(unknown)

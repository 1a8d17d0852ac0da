"""node/averaging/gossip_codec.py: what a NoLoCo round puts on the wire, and the outer step on it.

4-bit Delta round trips within half a quantization step; error feedback delivers the whole
progress over rounds; phi decodes against the receiver's own phi to within half a grid step while
the replicas are close, and never lands further than the grid's reach from it whatever was sent; a
round moves at most 2 bytes a parameter at the real presets' shapes; what a partner could send wrong
(sizes, NaN scales) is refused.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.averaging.gossip_codec import GossipCodec, PhiDither, dequantize4, dither, phi_steps, quantize4
from node.averaging.gossip_wire import MIN_GOSSIP_BANDWIDTH, TRANSFER_SLACK, GossipWire
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
        wire, sent, residual = codec.encode([delta], residual, [], None)
        assert torch.equal(sent[0], codec.decode(wire, [delta], None)[1][0])  # what the partner decodes
        delivered += sent[0]
        plain += codec.decode(codec.encode([delta], [torch.zeros_like(delta)], [], None)[0], [delta], None)[1][0]
    total = torch.stack(deltas).sum(0)
    assert torch.allclose(delivered + residual[0], total, atol=1e-9)  # nothing lost, the rest still to send
    last_step = wire[1].max()  # the last round's largest block scale: one quantization step
    assert (delivered - total).abs().max() <= last_step / 2 * (1 + 1e-5)  # within half a step of the last round
    assert (delivered - total).norm() < 0.5 * (plain - total).norm()  # far closer than without feedback


@pytest.mark.parametrize("preset", ["15m", "125m"])
def test_a_round_moves_at_most_two_bytes_a_parameter_at_the_real_presets(preset):
    config = load_config(**{"model.preset": preset})
    g = config.gossip
    codec = GossipCodec(g.delta_block, g.phi_bits, g.phi_step)
    for stage in (0, 1):
        parameters = count_stage_parameters(config.model, stage)
        # the stage's tensors' sizes, as the replica lays them out (numel per parameter tensor)
        from node.model.llama import build_stage

        with torch.device("meta"):
            numels = [p.numel() for p in build_stage(config.model, stage, config.seed).parameters()]
        assert sum(numels) == parameters
        one_way = codec.layout(numels, with_phi=True).nbytes
        assert 2 * one_way / parameters <= 2.0, (stage, 2 * one_way / parameters)
        assert 2 * one_way / parameters == pytest.approx(2 * codec.bytes_per_parameter(), rel=0.01)
        assert codec.layout(numels, with_phi=False).nbytes < 0.6 * parameters  # a DiLoCo round: Delta alone


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(min_value=1, max_value=3000),
    bits=st.sampled_from([2, 3, 4, 8]),
    step=st.sampled_from([0.25, 1.0, 2.0]),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
)
def test_phi_decodes_within_half_a_step_while_the_replicas_are_close_and_within_reach_whatever_is_sent(
    numel, bits, step, seed
):
    g = torch.Generator(device="cpu").manual_seed(seed)
    phi = torch.randn(numel, generator=g, device="cpu") * 0.02
    scales = quantize4(torch.randn(numel, generator=g, device="cpu") * 1e-3, 64)[1]
    steps = phi_steps(scales, numel, 64, step)
    key, reach = PhiDither(seed), 2 ** (bits - 1)
    residues = key.residues(phi, steps, bits)
    assert residues.dtype == torch.uint8 and residues.numel() == math.ceil(numel * bits / 8)
    # the receiver's phi, under reach - 1 steps from the sender's: the decoding is exact to half a step
    close = phi + (torch.rand(numel, generator=g, device="cpu").double() * 2 - 1).mul(steps * (reach - 1)).float()
    decoded, edge = key.decode(residues, close, steps, bits)
    assert int(edge) <= int(((close - phi).double().abs() >= steps * (reach / 2 - 1)).sum())  # only the far ones
    assert torch.all((decoded.double() - phi.double()).abs() <= steps / 2 * (1 + 1e-6) + 1e-9)
    # far off (or garbage residues): the decoded value stays within the grid's reach of our own
    far = phi + torch.randn(numel, generator=g, device="cpu") * steps.max().float() * 100
    garbage = torch.randint(0, 256, residues.shape, generator=g, device="cpu", dtype=torch.uint8)
    for own, sent in ((far, residues), (close, garbage)):
        decoded, edge = key.decode(sent, own, steps, bits)
        assert torch.all((decoded.double() - own.double()).abs() <= steps * (reach + 1))
        if numel >= 2000:  # uniform over the 2**bits offsets: 1/2 + 2**-bits of them in the reach's outer half
            assert abs(int(edge) / numel - (0.5 + 2.0**-bits)) < 0.1


def test_the_dither_is_a_pure_function_of_seed_and_position():
    cpu = torch.device("cpu")
    whole = dither(0, 5000, 7, cpu)
    assert torch.equal(whole, torch.cat([dither(0, 1234, 7, cpu), dither(1234, 5000, 7, cpu)]))  # piece by piece
    assert not torch.equal(whole, dither(0, 5000, 8, cpu))
    assert whole.min() >= -0.5 and whole.max() < 0.5 and abs(float(whole.mean())) < 0.02


def test_a_round_decodes_the_partners_phi_and_delta_from_its_wire():
    g = torch.Generator(device="cpu").manual_seed(1)
    codec = GossipCodec()
    phi = [torch.randn(s, generator=g, device="cpu") * 0.02 for s in ((40, 33), (70,))]
    delta = [torch.randn(p.shape, generator=g, device="cpu") * 1e-3 for p in phi]
    own = [p + d * 0.25 for p, d in zip(phi, delta)]  # a replica that drifted by a quarter of a Delta
    key = PhiDither(99)
    wire, sent, _ = codec.encode(delta, [torch.zeros_like(d) for d in delta], phi, key)
    assert [tuple(t.shape) for t in wire] == [s for s in codec.layout([p.numel() for p in phi], True).shapes]
    got_phi, got_delta, edge_share = codec.decode(wire, own, key)
    assert edge_share == 0.0  # a quarter of a Delta apart: well within the reach
    for k, (p, q, d, e) in enumerate(zip(phi, got_phi, sent, got_delta)):
        assert torch.equal(d, e)
        half_step = phi_steps(wire[3 * k + 1], p.numel(), codec.block, codec.phi_step) / 2
        assert torch.all((p - q).reshape(-1).double().abs() <= half_step * (1 + 1e-6))
    with pytest.raises(ValueError, match="wire tensors"):
        codec.decode(wire[:-1], own, key)


def test_a_partner_whose_scales_hold_a_nan_is_refused_as_not_finite():
    module = torch.nn.Linear(16, 8)
    replica = OuterReplica(dict(module.named_parameters()), GossipConfig())
    with torch.no_grad():
        module.weight.add_(0.01)
    start = replica.capture_start(inner_step=5, key=PhiDither(1))
    received = [t.clone() for t in start.wire]
    received[1][0] = math.nan  # the first tensor's first Delta scale (codes, scales, phi residues)
    phi, delta, edge_share = replica.receive(received, start)
    reason, measures = replica.check_partner(start, phi, delta, edge_share=edge_share)
    assert reason is not None and "NaN or Inf" in reason and measures is None


def test_a_round_budget_is_the_payload_at_the_link_rate_on_top_of_the_round_timeout():
    module = torch.nn.Linear(1024, 1024)
    replica = OuterReplica(dict(module.named_parameters()), GossipConfig())
    rates = {"fast": 100e6}
    transport = SimpleNamespace(channels=SimpleNamespace(peer_link_rate=lambda peer: rates.get(peer)))
    wire = GossipWire(transport, GossipConfig(), replica)
    key = PhiDither(0)
    payload = replica.wire_layout(True).nbytes
    assert payload < 1.1 * replica.total_numel  # about a byte a parameter one way
    unknown = wire.round_budget(key, "stranger")
    assert unknown == pytest.approx(GossipConfig().round_timeout + TRANSFER_SLACK * payload / MIN_GOSSIP_BANDWIDTH)
    assert wire.round_budget(key, "fast") == pytest.approx(
        GossipConfig().round_timeout + TRANSFER_SLACK * payload / 100e6
    )
    rates["slow"] = 1e3  # a measured rate is never taken below the floor
    assert wire.round_budget(key, "slow") == pytest.approx(unknown)

"""node/stage/precision.py and its use in the stage worker: bf16/fp16 autocast gradients against
the fp32 reference, fp32 master weights / optimizer / outer state, fp16's loss scaler, `auto`."""

from __future__ import annotations

import pytest
import torch

from node.averaging.outer_replica import OuterReplica
from node.config import ConfigError, GossipConfig, Precision, SwarmConfig
from node.model.data import open_source
from node.stage.access import live_parameters
from node.stage.precision import INIT_SCALE, LossScaler, StagePrecision, resolve_precision
from node.stage.stage_worker import StageWorker
from tests.helpers.chain import chain_microbatch

BASE = SwarmConfig(num_stages=3)

# Measured on this CPU (docs/model.md "Precision") for the default model at initialisation, 8 x 64
# tokens, 3 seeds: bf16 autocast gives parameter gradients within 0.89 % (relative L2, worst single
# tensor, a k_proj or a norm weight of the last block stage) and 0.55 % (all gradients together)
# of the fp32 ones; fp16 within 0.11 % and 0.06 %. bf16 keeps 8 mantissa bits (unit roundoff
# 2**-9 = 0.2 %), fp16 11 bits (2**-12): the errors are a few roundoffs, as expected. The bounds
# below leave 3x-4x margin for other seeds and CPUs' kernels; the lower bound proves the compute
# really ran in low precision (fp32 against itself is bit-identical here).
TOLERANCE = {Precision.BF16: (0.03, 0.02), Precision.FP16: (0.005, 0.002)}  # (worst tensor, global)
LOW_PRECISION_FOOTPRINT = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


def cfg(precision: Precision | str, **training: object) -> SwarmConfig:
    return BASE.replace(training={"precision": str(precision), **training})


def batch(seed: int, b: int = 8, t: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, BASE.model.vocab_size, (b, t + 1), generator=g)
    return seqs[:, :-1], seqs[:, 1:]


def chained_grads(precision: Precision, seed: int) -> tuple[float, dict[str, torch.Tensor], list[StageWorker]]:
    """One microbatch through three chained workers (no step: accumulation only)."""
    ws = [StageWorker(cfg(precision, microbatches_per_step=1000), s) for s in range(3)]
    tokens, targets = batch(seed)
    key = ("t", seed)
    h = ws[0].embed(key, tokens)
    for w in ws[1:]:
        h = w.forward(key, h)
        assert h.dtype == torch.float32  # what goes on the wire: fp32, wire_compression decides the rest
    loss, g = ws[0].head_loss_backward(key, h, targets)
    for w in reversed(ws[1:]):
        g = w.backward(key, g)
        assert g.dtype == torch.float32
    ws[0].embed_backward(key, g)
    grads = {f"{s}.{n}": p.grad.clone() for s, w in enumerate(ws) for n, p in w.module.named_parameters()}
    return loss, grads, ws


def relative_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    worst = max(float((got[n] - ref[n]).norm() / ref[n].norm()) for n in ref)
    num = sum(float((got[n] - ref[n]).norm()) ** 2 for n in ref)
    den = sum(float(ref[n].norm()) ** 2 for n in ref)
    return worst, (num / den) ** 0.5


def close(ws: list[StageWorker]) -> None:
    for w in ws:
        w.close()


# ------------------------------------------------------------------------------------------------
# Resolution of `auto`


def test_auto_is_fp32_on_cpu_and_explicit_values_are_kept():
    assert resolve_precision(Precision.AUTO, "cpu") is Precision.FP32
    for p in (Precision.FP32, Precision.BF16, Precision.FP16):
        assert resolve_precision(p, "cpu") is p
    w = StageWorker(cfg("auto"), 1)
    assert w.precision.precision is Precision.FP32 and w.precision.autocast().__class__.__name__ == "nullcontext"
    w.close()


def test_auto_is_bf16_on_a_cuda_device_with_native_bf16_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision(Precision.AUTO, "cuda:0") is Precision.BF16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    # emulated bf16 is slow: an older GPU computes in fp16 with its loss scale instead
    assert resolve_precision(Precision.AUTO, "cuda:0") is Precision.FP16


def test_precision_is_a_config_enum_and_auto_is_the_default():
    assert SwarmConfig().training.precision is Precision.AUTO
    assert SwarmConfig().to_dict()["training"]["precision"] == "auto"
    assert cfg("bf16").training.precision is Precision.BF16
    with pytest.raises(ConfigError, match=r"training\.precision"):
        cfg("fp8")


# ------------------------------------------------------------------------------------------------
# Gradients against the fp32 reference


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16])
def test_chained_stage_gradients_equal_the_fp32_reference_within_tolerance(precision):
    worst_bound, global_bound = TOLERANCE[precision]
    for seed in range(2):
        ref_loss, ref, ref_ws = chained_grads(Precision.FP32, seed)
        loss, got, ws = chained_grads(precision, seed)
        close(ref_ws + ws)
        worst, overall = relative_errors(got, ref)
        assert worst < worst_bound and overall < global_bound, (precision, seed, worst, overall)
        assert overall > LOW_PRECISION_FOOTPRINT, "no trace of low-precision compute: autocast did not run"
        assert loss == pytest.approx(ref_loss, abs=1e-3)


def test_one_block_stage_alone_matches_fp32_for_the_same_input_and_gradient():
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(4, 32, BASE.model.hidden_size, generator=g)
    grad_out = torch.randn(4, 32, BASE.model.hidden_size, generator=g) * 1e-3
    results = {}
    for precision in (Precision.FP32, Precision.BF16):
        w = StageWorker(cfg(precision, microbatches_per_step=1000), 2)
        out = w.forward("k", hidden)
        grad_in = w.backward("k", grad_out)
        results[precision] = (out, grad_in, {n: p.grad.clone() for n, p in w.module.named_parameters()})
        w.close()
    (out32, in32, p32), (out16, in16, p16) = results[Precision.FP32], results[Precision.BF16]
    assert float((out16 - out32).norm() / out32.norm()) < 0.02
    assert float((in16 - in32).norm() / in32.norm()) < 0.02
    worst, overall = relative_errors(p16, p32)
    assert worst < TOLERANCE[Precision.BF16][0] and LOW_PRECISION_FOOTPRINT < overall < TOLERANCE[Precision.BF16][1]


# ------------------------------------------------------------------------------------------------
# What stays fp32


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16])
def test_master_weights_optimizer_state_and_outer_state_stay_fp32(precision):
    ws = [StageWorker(cfg(precision, microbatches_per_step=1), s) for s in range(3)]
    replicas = [OuterReplica(live_parameters(w), GossipConfig()) for w in ws]
    for i in range(3):  # three optimizer steps on every stage
        chain_microbatch(ws, ("s", i), *batch(i, b=2, t=16))
    for w, replica in zip(ws, replicas):
        assert w.inner_step == 3
        assert all(p.dtype == torch.float32 for p in w.module.parameters())
        states = list(w.optimizer.state.values())
        assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)
        assert all(v.dtype == torch.float32 for v in w.state_dict().values())  # what gossip and rebuilds send
        start = replica.capture_start(w.inner_step)
        new_state = replica.pairwise_step(start, [], [])  # NoLoCo's lone step
        assert all(t.dtype == torch.float32 for t in [*new_state.phi, *new_state.momentum, *start.delta])
        assert replica.apply(start, new_state)
        assert all(p.dtype == torch.float32 for p in w.module.parameters())
    close(ws)


# ------------------------------------------------------------------------------------------------
# fp16's loss scaler


def test_the_scaler_halves_on_overflow_and_doubles_after_a_clean_run():
    scaler = LossScaler(enabled=True, init_scale=1024.0, growth_interval=3)
    scaler.update(found_inf=True)
    assert scaler.scale == 512.0 and scaler.skipped == 1
    for _ in range(2):
        scaler.update(found_inf=False)
    assert scaler.scale == 512.0
    scaler.update(found_inf=False)
    assert scaler.scale == 1024.0
    for _ in range(20):
        scaler.update(found_inf=True)
    assert scaler.scale == 1.0  # never below 1: that would shrink gradients, not protect them
    off = LossScaler(enabled=False)
    off.update(found_inf=True)
    assert off.scale == 1.0 and off.skipped == 0


def test_bf16_and_fp32_do_not_scale():
    for precision in (Precision.FP32, Precision.BF16):
        p = StagePrecision(precision, "cpu")
        assert not p.scaler.enabled and p.scaler.scale == 1.0
    assert StagePrecision(Precision.FP16, "cpu").scaler.scale == INIT_SCALE


def test_an_fp16_backward_that_overflows_is_skipped_the_scale_drops_and_the_gradients_stay_right():
    _, ref, ref_ws = chained_grads(Precision.FP32, 0)
    close(ref_ws)
    ws = [StageWorker(cfg(Precision.FP16, microbatches_per_step=1000), s) for s in range(3)]
    huge = 2.0**40  # gradients ~1e-5 x 2**40 ~ 1e7: far over fp16's 65504, every matmul overflows
    ws[1].precision.scaler.scale = huge
    tokens, targets = batch(0)
    key = ("t", 0)
    h = ws[2].forward(key, ws[1].forward(key, ws[0].embed(key, tokens)))
    _, g = ws[0].head_loss_backward(key, h, targets)
    g = ws[1].backward(key, ws[2].backward(key, g))  # no RejectedInput: an overflow is not hostile
    ws[0].embed_backward(key, g)
    scaler = ws[1].precision.scaler
    assert scaler.skipped >= 1 and scaler.scale < huge  # the overflowing attempts were discarded
    assert ws[0].precision.scaler.skipped == ws[2].precision.scaler.skipped == 0  # and stayed local
    got = {f"{s}.{n}": p.grad for s, w in enumerate(ws) for n, p in w.module.named_parameters()}
    assert all(torch.isfinite(v).all() for v in got.values())
    worst, overall = relative_errors(got, ref)  # the retried attempt is unscaled like any other
    assert worst < TOLERANCE[Precision.FP16][0] and overall < TOLERANCE[Precision.FP16][1]
    assert ws[1].microbatches_done == 1 and ws[1].gradient_gate.samples == 1
    close(ws)


def test_an_fp16_step_with_inf_gradients_is_skipped_and_an_overflow_can_not_poison_a_step():
    """The step-level net under the per-microbatch scaler: a non-finite accumulated gradient skips
    the optimizer step (weights untouched, skipped_steps counted), whatever the precision."""
    w = StageWorker(cfg(Precision.FP16, microbatches_per_step=1), 1)
    before = {n: p.detach().clone() for n, p in w.module.named_parameters()}
    for p in w.module.parameters():
        p.grad = torch.full_like(p, float("inf"))
    w.accumulated = w.config.training.microbatches_per_step - 1
    w._finish(0.01)
    assert w.skipped_steps == 1 and w.inner_step == 0
    assert all(torch.equal(before[n], p) for n, p in w.module.named_parameters())
    w.close()


# ------------------------------------------------------------------------------------------------
# Training


def test_chained_stages_train_in_bf16_on_cpu():
    config = cfg(Precision.BF16, microbatches_per_step=1, warmup_steps=2)  # short: bf16 is slow on CPU
    ws = [StageWorker(config, s) for s in range(3)]
    source = open_source(config, None, stream_id=1)
    losses = []
    for i in range(30):  # 30 optimizer steps
        losses.append(chain_microbatch(ws, ("b", i), *source.next_batch(8, 32)))
    close(ws)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)  # from ln(256) = 5.5 toward the chain's floor (1.10)

"""node/stage/stage_worker.py: pipeline == single process (grads and AdamW step), loss falls, clipping,
bad inputs, activation bookkeeping, lr schedule, staleness across a step, executor."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch

from node.config import SwarmConfig
from node.model.data import open_source
from node.model.llama import ReferenceModel
from node.stage.stage_worker import ADAM_BETAS, ADAM_EPS, StageWorker, UnknownMicrobatch, lr_at, step_size
from tests.helpers.chain import chain_microbatch

BASE = SwarmConfig(num_stages=3)


pytestmark = pytest.mark.usefixtures("one_thread")


def cfg(**training: object) -> SwarmConfig:
    return BASE.replace(training=training) if training else BASE


def batch(config: SwarmConfig, b: int = 2, t: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, config.model.vocab_size, (b, t + 1), generator=g)
    return seqs[:, :-1], seqs[:, 1:]


def workers(config: SwarmConfig, **kw: object) -> list[StageWorker]:
    return [StageWorker(config, s, **kw) for s in range(config.num_stages)]


def close_all(ws: list[StageWorker]) -> None:
    for w in ws:
        w.close()


def test_a_worker_refuses_a_stage_outside_the_swarm() -> None:
    # the upper bound is the worker's to check: build_stage knows the model's shape, not the stage count
    for stage in (-1, BASE.num_stages):
        with pytest.raises(ValueError, match="out of range"):
            StageWorker(BASE, stage)


# ------------------------------------------------------------------------------------------------
# 1. Correctness against the single-process reference


def test_pipeline_grads_and_step_match_reference() -> None:
    config = cfg(microbatches_per_step=3, warmup_steps=2, weight_decay=0.1, grad_clip=0.5)
    mps = config.training.microbatches_per_step
    ws = workers(config)
    ref = ReferenceModel(config.model, config.num_stages, config.seed)
    ref_stages = [ref.edge, *ref.blocks]
    opts = [
        torch.optim.AdamW(
            m.parameters(), lr=lr_at(config.training, 0), betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.1
        )
        for m in ref_stages
    ]
    data = [batch(config, seed=i) for i in range(mps)]
    try:
        for i, (tok, tgt) in enumerate(data):
            loss = chain_microbatch(ws, ("peer", i), tok, tgt)
            ref_loss = ref(tok, tgt)
            (ref_loss / mps).backward()
            assert loss == pytest.approx(ref_loss.item(), abs=1e-6)
            if i == mps - 2:  # everything accumulated but the step not fired yet
                for w, m in zip(ws, ref_stages):
                    assert w.inner_step == 0 and w.accumulated == mps - 1
                    for (name, p), q in zip(w.module.named_parameters(), m.parameters()):
                        # the last microbatch is still missing on both sides
                        assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-5, rtol=0), name
        for w, m, opt in zip(ws, ref_stages, opts):
            norm = torch.nn.utils.clip_grad_norm_(list(m.parameters()), config.training.grad_clip)
            opt.step()
            assert w.inner_step == 1 and w.accumulated == 0 and w.microbatches_done == mps
            assert w.last_grad_norm == pytest.approx(min(float(norm), 0.5), rel=1e-4)
            assert all(p.grad is None for p in w.module.parameters())
            for (name, p), q in zip(w.module.named_parameters(), m.parameters()):
                assert torch.allclose(p, q, atol=1e-6, rtol=0), name
    finally:
        close_all(ws)


def test_backward_after_an_intervening_step_uses_the_weights_its_forward_ran_on() -> None:
    config = cfg(microbatches_per_step=2)
    w = StageWorker(config, 1)
    try:
        xa, xb, xc = (torch.randn(2, 8, 64) for _ in range(3))
        weights_of_a = copy.deepcopy(w.module)
        for key, x in (("a", xa), ("b", xb), ("c", xc)):
            w.forward(key, x)
        assert w.stashes.made == 1  # one weight version, one copy for all three
        w.backward("b", torch.randn(2, 8, 64))
        w.backward("c", torch.randn(2, 8, 64))  # steps: the live weights move on
        assert w.inner_step == 1
        forwards = []
        hook = w.module.register_forward_hook(lambda *_: forwards.append(1))
        g = torch.randn(2, 8, 64)
        grad_in = w.backward("a", g)  # would raise "modified by an inplace operation" without a stash
        hook.remove()
        assert not forwards  # no second forward
        x = xa.clone().requires_grad_(True)
        weights_of_a(x).backward(g)
        assert torch.allclose(grad_in, x.grad, atol=1e-6)
        for live, old in zip(w.module.parameters(), weights_of_a.parameters(), strict=True):
            assert not torch.equal(live, old)  # the step did change them ...
            assert torch.allclose(live.grad, old.grad, atol=1e-6)  # ... and a's gradient is at a's weights
        assert len(w.stashes) == 0  # every microbatch of that version is done: the copy is freed
    finally:
        w.close()


@pytest.mark.parametrize("stashed_weights", [0, 1])
def test_past_the_stash_limit_the_backward_recomputes_at_the_current_weights(stashed_weights: int) -> None:
    config = cfg(microbatches_per_step=1, stashed_weights=stashed_weights)
    w = StageWorker(config, 1)
    try:
        xa, xb, xc = (torch.randn(2, 8, 64) for _ in range(3))
        w.forward("a", xa)
        w.forward("b", xb)
        w.backward("b", torch.randn(2, 8, 64))  # steps; a still holds its stash (if any)
        w.forward("c", xc)  # a new version, but the limit is reached: c runs on the live weights
        assert w.stashes.made == stashed_weights
        w.backward("a", torch.randn(2, 8, 64))  # steps again: the weights c's graph saved change in place
        assert w.inner_step == 2
        current = copy.deepcopy(w.module)
        g = torch.randn(2, 8, 64)
        grad_in = w.backward("c", g)  # would raise "modified by an inplace operation" without recompute
        x = xc.clone().requires_grad_(True)
        current(x).backward(g)
        assert torch.allclose(grad_in, x.grad, atol=1e-6)
        w.forward("d", xa)  # a's copy is gone with a: room for a new one
        assert w.stashes.made == 2 * stashed_weights
    finally:
        w.close()


@pytest.mark.parametrize(
    ("per_step", "staleness", "stored", "expected"),
    [(2, 2, 0, 2), (2, 2, 4, 2), (2, 2, 5, 3), (2, 2, 16, 8), (1, 1, 3, 3), (4, 1, 2, 4)],
)
def test_a_stage_holding_more_microbatches_takes_larger_steps(per_step, staleness, stored, expected) -> None:
    training = cfg(microbatches_per_step=per_step, max_staleness_steps=staleness).training
    assert step_size(training, stored) == expected
    # a microbatch behind `stored` others waits about stored / step_size steps: within the budget
    assert stored / step_size(training, stored) <= staleness


def test_a_larger_step_uses_the_mean_of_its_microbatches_gradients() -> None:
    config = cfg(microbatches_per_step=1, max_staleness_steps=1, grad_clip=1e9)
    w = StageWorker(config, 1)
    try:
        reference = copy.deepcopy(w.module)
        xs = {key: torch.randn(2, 8, 64) for key in "abc"}
        gs = {key: torch.randn(2, 8, 64) for key in "abc"}
        for key, x in xs.items():
            w.forward(key, x)
        w.backward("a", gs["a"])  # b and c still stored: steps of 2, so no step yet
        assert w.inner_step == 0 and w.accumulated == 1
        w.backward("b", gs["b"])  # one stored (c): 2 accumulated >= 1, a step of 2
        assert w.inner_step == 1 and w.accumulated == 0
        for key in "ab":
            reference(xs[key]).backward(gs[key])
        mean_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()])) / 2
        assert w.last_grad_norm == pytest.approx(float(mean_norm), rel=1e-5)
        w.backward("c", gs["c"])  # nothing else in flight: back to steps of microbatches_per_step
        assert w.inner_step == 2
    finally:
        w.close()


# ------------------------------------------------------------------------------------------------
# 2. Training works


def test_loss_falls_on_synthetic_source() -> None:
    config = cfg(microbatch_size=8, sequence_length=32, microbatches_per_step=2, warmup_steps=10, total_steps=100)
    source = open_source(config, None, stream_id=1)
    ws = workers(config)
    losses = []
    try:
        for i in range(200):
            tok, tgt = source.next_batch(8, 32)
            losses.append(chain_microbatch(ws, ("p", i), tok, tgt))
        assert all(w.inner_step == 100 for w in ws)
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        assert first > math.log(256) - 0.3
        assert last < 2.5, (first, last)  # floor ~1.10; reaches ~1.6
        assert all(w.num_stored == 0 for w in ws)
        assert all(w.throughput > 0 for w in ws)
    finally:
        close_all(ws)


# ------------------------------------------------------------------------------------------------
# 3. Clipping


@pytest.mark.parametrize("clip", [0.01, 1e6])
def test_grad_norm_recorded_after_clipping(clip: float) -> None:
    config = cfg(microbatches_per_step=1, grad_clip=clip)
    w = StageWorker(config, 1)
    try:
        x, g = torch.randn(2, 8, 64), torch.randn(2, 8, 64)
        m = copy.deepcopy(w.module)
        m(x).backward(g)
        total = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in m.parameters()))
        w.forward("k", x)
        w.backward("k", g)
        assert w.last_grad_norm is not None and w.last_grad_norm <= clip
        assert w.last_grad_norm == pytest.approx(min(total, clip), rel=1e-4)
        if clip < 1:
            assert total > clip  # the clipping branch really ran
    finally:
        w.close()


def test_non_finite_gradient_skips_the_step() -> None:
    w = StageWorker(cfg(microbatches_per_step=1), 1)
    try:
        before = w.state_dict()
        for p in w.module.parameters():
            p.grad = torch.full_like(p, float("nan"))
        w._step()
        assert w.skipped_steps == 1 and w.inner_step == 0 and w.last_grad_norm is None
        assert all(torch.equal(before[k], v) for k, v in w.state_dict().items())
        assert all(p.grad is None for p in w.module.parameters())
    finally:
        w.close()


# ------------------------------------------------------------------------------------------------
# 4. Bad inputs


def test_bad_block_inputs_raise_and_worker_keeps_working() -> None:
    config = cfg(microbatches_per_step=1)
    w = StageWorker(config, 1)
    try:
        bad = [
            torch.randn(2, 8, 32),  # wrong hidden size
            torch.randn(8, 64),  # wrong rank
            torch.randn(2, 257, 64),  # longer than max_position_embeddings
            torch.randn(9, 8, 64),  # batch above microbatch_size
            torch.zeros(2, 8, 64, dtype=torch.long),  # not floating point
            torch.full((2, 8, 64), float("nan")),
            torch.full((2, 8, 64), 1e39, dtype=torch.float64),  # overflows float32 -> inf
            "not a tensor",
        ]
        for x in bad:
            with pytest.raises(ValueError):
                w.forward("k", x)  # type: ignore[arg-type]
        assert w.num_stored == 0
        with pytest.raises(UnknownMicrobatch) as info:
            w.backward("nope", torch.randn(2, 8, 64))
        assert isinstance(info.value, KeyError) and "nope" in str(info.value)
        with pytest.raises(ValueError):
            w.embed("k", torch.zeros(2, 8, dtype=torch.long))  # edge-stage call on a block stage

        # fp16 from the wire is accepted and cast; a wrong-shape gradient keeps the entry
        out = w.forward("k", torch.randn(2, 8, 64).half())
        assert out.dtype == torch.float32 and out.shape == (2, 8, 64)
        with pytest.raises(ValueError):
            w.backward("k", torch.randn(2, 4, 64))
        with pytest.raises(ValueError):
            w.backward("k", torch.full((2, 8, 64), float("inf")))
        assert w.num_stored == 1
        grad_in = w.backward("k", torch.randn(2, 8, 64).bfloat16())
        assert grad_in.shape == (2, 8, 64) and torch.isfinite(grad_in).all() and w.inner_step == 1

        # through the executor: the error reaches the caller, the thread lives on
        fut = w.executor.submit(w.forward, "e", torch.randn(2, 8, 3))
        with pytest.raises(ValueError):
            fut.result()
        assert w.executor.submit(w.forward, "e", torch.randn(2, 8, 64)).result().shape == (2, 8, 64)
    finally:
        w.close()


def test_bad_edge_inputs_raise_and_worker_keeps_working() -> None:
    config = cfg(microbatches_per_step=1)
    ws = workers(config)
    w0 = ws[0]
    try:
        for tok in (
            torch.full((2, 8), 256),  # out of vocab
            torch.full((2, 8), -1),
            torch.zeros(2, 8),  # float tokens
            torch.zeros(2, 8, dtype=torch.bool),
            torch.zeros(2, 8, 3, dtype=torch.long),
        ):
            with pytest.raises(ValueError):
                w0.embed("k", tok)
        with pytest.raises(ValueError):
            w0.forward("k", torch.randn(2, 8, 64))  # block-stage call on stage 0
        with pytest.raises(UnknownMicrobatch):
            w0.head_loss_backward("k", torch.randn(2, 8, 64), torch.zeros(2, 8, dtype=torch.long))
        tok, tgt = batch(config, t=8)
        h = w0.embed("k", tok)
        with pytest.raises(ValueError):
            w0.embed_backward("k", torch.randn(2, 8, 64))  # before the head
        with pytest.raises(ValueError):
            w0.head_loss_backward("k", h, torch.full((2, 8), 999))
        with pytest.raises(ValueError):
            w0.head_loss_backward("k", h, tgt[:, :4])
        with pytest.raises(ValueError):
            w0.head_loss_backward("k", h[:, :4], tgt[:, :4])
        w0.drop("k")
        assert chain_microbatch(ws, ("ok", 0), tok, tgt) > 0
        assert all(w.inner_step == 1 for w in ws)
    finally:
        close_all(ws)


# ------------------------------------------------------------------------------------------------
# 5. Stored activations


def test_drop_expire_and_bound() -> None:
    config = cfg()
    w = StageWorker(config, 2, max_stored=3)
    try:
        for i in range(5):
            w.forward(("p", i), torch.randn(1, 4, 64))
        assert w.num_stored == 3 and w.evicted == 2
        with pytest.raises(UnknownMicrobatch):
            w.backward(("p", 0), torch.randn(1, 4, 64))  # the oldest went first
        w.drop(("p", 4))
        w.drop(("p", 99))  # unknown: no error
        assert w.num_stored == 2
        assert w.expire(3600.0) == 0 and w.num_stored == 2
        assert w.expire(0.0) == 2 and w.num_stored == 0
        # drop from the event-loop thread while the executor owns the compute
        w.executor.submit(w.forward, "x", torch.randn(1, 4, 64)).result()
        w.drop("x")
        with pytest.raises(UnknownMicrobatch):
            w.executor.submit(w.backward, "x", torch.randn(1, 4, 64)).result()
        for i in range(50):  # a stream of microbatches whose backward never comes
            w.forward(("dead", i), torch.randn(1, 4, 64))
            assert w.num_stored <= 3
    finally:
        w.close()


# ------------------------------------------------------------------------------------------------
# 6. Learning-rate schedule


def test_lr_schedule_and_scale() -> None:
    config = cfg(learning_rate=1e-2, warmup_steps=10, total_steps=110, min_lr_ratio=0.1, microbatches_per_step=1)
    assert lr_at(config.training, 0) == pytest.approx(1e-3)
    assert lr_at(config.training, 4) == pytest.approx(5e-3)
    assert lr_at(config.training, 9) == pytest.approx(1e-2)  # end of warmup
    assert lr_at(config.training, 10) == pytest.approx(1e-2)  # cosine starts at the peak
    assert lr_at(config.training, 60) == pytest.approx(1e-2 * (0.1 + 0.9 * 0.5))  # half way down
    assert lr_at(config.training, 110) == pytest.approx(1e-3)
    assert lr_at(config.training, 10_000) == pytest.approx(1e-3)  # flat afterwards
    values = [lr_at(config.training, s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))

    w = StageWorker(config, 1, lr_scale=1.1)
    try:
        assert w.current_lr == pytest.approx(1.1e-3)
        w.set_lr_scale(1.2)
        assert w.current_lr == pytest.approx(1.2e-3)
        for bad in (0, -1, float("nan"), float("inf")):
            with pytest.raises(ValueError):
                w.set_lr_scale(bad)
        w.forward("k", torch.randn(1, 4, 64))
        w.backward("k", torch.randn(1, 4, 64))
        assert w.optimizer.param_groups[0]["lr"] == pytest.approx(1.2e-3)  # the step used it
        assert w.current_lr == pytest.approx(1.2 * 2e-3)
    finally:
        w.close()


# ------------------------------------------------------------------------------------------------
# State, optimizer reset, throughput, close


def test_state_dict_roundtrip_reset_and_close() -> None:
    config = cfg(microbatches_per_step=2)
    a, b = StageWorker(config, 1), StageWorker(config, 2)
    try:
        sd = a.state_dict()
        with pytest.raises(ValueError):
            b.load_state_dict({k: v for k, v in list(sd.items())[1:]})
        with pytest.raises(ValueError):
            b.load_state_dict({k: v[..., :1] if v.dim() else v for k, v in sd.items()})
        b.forward("k", torch.randn(1, 4, 64))
        b.backward("k", torch.randn(1, 4, 64))
        assert b.accumulated == 1
        b.load_state_dict(sd)  # fresh optimizer: accumulated grads are discarded
        assert b.accumulated == 0 and all(p.grad is None for p in b.module.parameters())
        assert all(torch.equal(sd[k], v) for k, v in b.state_dict().items())
        sd["layers.0.mlp.up_proj.weight"].zero_()  # a copy: the worker is untouched
        assert not torch.equal(b.state_dict()["layers.0.mlp.up_proj.weight"], sd["layers.0.mlp.up_proj.weight"])

        b.forward("k", torch.randn(1, 4, 64))
        b.backward("k", torch.randn(1, 4, 64))
        b.forward("k", torch.randn(1, 4, 64))
        b.backward("k", torch.randn(1, 4, 64))
        assert b.inner_step == 1 and len(b.optimizer.state) > 0
        b.reset_optimizer()
        assert len(b.optimizer.state) == 0 and b.inner_step == 1

        tp = a.measure_throughput(2, 8, repeats=1)
        assert tp > 0 and a.throughput == tp and a.num_stored == 0
        assert all(p.grad is None for p in a.module.parameters())
    finally:
        a.close()
        b.close()
    with pytest.raises(RuntimeError):
        a.executor.submit(lambda: None)
    with pytest.raises(RuntimeError):
        a.forward("k", torch.randn(1, 4, 64))
    a.close()  # idempotent


# ---------------------------------------------------------------------------------------------
# Hostile gradients are dropped at the door; the step's honest accumulation survives


def _grads(worker: StageWorker) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in worker.module.parameters()]


def test_a_huge_gradient_is_dropped_alone_and_the_step_keeps_the_honest_ones():
    config = cfg(microbatches_per_step=2)
    block = StageWorker(config, 1)
    try:
        hidden = torch.randn(2, 16, config.model.hidden_size)
        block.forward(("o", 1), hidden)
        block.forward(("o", 2), hidden)
        block.forward(("o", 3), hidden)
        block.backward(("o", 1), torch.randn(2, 16, config.model.hidden_size) * 1e-3)
        honest = _grads(block)
        assert block.accumulated == 1
        with pytest.raises(ValueError, match="not finite"):  # finite on the wire, overflows in backward
            block.backward(("o", 2), torch.full((2, 16, config.model.hidden_size), 3e38))
        after = _grads(block)
        assert all(torch.equal(a, b) for a, b in zip(honest, after))
        assert block.accumulated == 1 and block.skipped_steps == 0
        block.backward(("o", 3), torch.randn(2, 16, config.model.hidden_size) * 1e-3)
        assert block.inner_step == 1 and block.skipped_steps == 0
    finally:
        block.close()


def test_an_absurdly_large_but_finite_gradient_is_refused_once_the_gate_has_a_yardstick():
    from node.stage.admission import GATE_WARMUP_SAMPLES

    config = cfg(microbatches_per_step=1)
    block = StageWorker(config, 1)
    try:
        hidden = torch.randn(2, 16, config.model.hidden_size)
        for i in range(GATE_WARMUP_SAMPLES):
            block.forward(("o", i), hidden)
            block.backward(("o", i), torch.randn(2, 16, config.model.hidden_size) * 1e-3)
        steps = block.inner_step
        block.forward(("o", 99), hidden)
        with pytest.raises(ValueError, match="typical"):
            block.backward(("o", 99), torch.randn(2, 16, config.model.hidden_size) * 1e3)
        assert block.inner_step == steps
        block.backward(("o", 99), torch.randn(2, 16, config.model.hidden_size) * 2e-3)  # still stored: retried
        assert block.inner_step == steps + 1
    finally:
        block.close()


def test_the_gate_judges_a_collapsed_yardstick_by_its_floor():
    from node.stage.admission import ABSURD_NORM_FACTOR, TYPICAL_NORM_FLOOR, GradientGate, RejectedInput

    gate = GradientGate()
    for _ in range(20):  # gradients that collapsed, as in a diverging swarm
        gate.accept(7e-11)
    honest_recovery = torch.full((4, 4), 1.5e-7 / 4)  # norm 1.5e-7: over 2000x the typical
    assert gate.check("g", honest_recovery) == pytest.approx(1.5e-7)
    with pytest.raises(RejectedInput, match="typical"):
        gate.check("g", torch.full((4, 4), 2 * ABSURD_NORM_FACTOR * TYPICAL_NORM_FLOOR / 4))
    # a healthy yardstick keeps the plain ratio: 0.01 typical refuses 11, accepts 9
    healthy = GradientGate()
    for _ in range(20):
        healthy.accept(0.01)
    assert healthy.check("g", torch.full((1,), 9.0)) == 9.0
    with pytest.raises(RejectedInput, match=r"1000x the typical 0\.01"):
        healthy.check("g", torch.full((1,), 11.0))


def test_stage_zero_refuses_a_non_finite_embedding_gradient_without_touching_its_accumulation():
    config = cfg(microbatches_per_step=2)
    edge = StageWorker(config, 0)
    try:
        tokens, targets = batch(config)
        for i in (1, 2):
            hidden = edge.embed(("me", i), tokens)
            edge.head_loss_backward(("me", i), hidden, targets)
        edge.embed_backward(("me", 1), torch.randn(*hidden.shape) * 1e-3)
        honest = _grads(edge)
        with pytest.raises(ValueError):
            edge.embed_backward(("me", 2), torch.full(hidden.shape, 3e38))
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(honest, _grads(edge)))
        assert edge.accumulated == 1 and edge.skipped_steps == 0
    finally:
        edge.close()

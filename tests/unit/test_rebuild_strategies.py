"""node/recovery/rebuild.py on real stage workers, sources faked (no network): a neighbour without a
gradient norm weighs 1.0 in the CheckFree average, and strategy `zero` makes a block stage the
identity with zero gradients, which it stays through optimizer steps (docs/recovery.md)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from node.config import SwarmConfig
from node.model.llama import build_stage
from node.recovery import rebuild
from node.recovery.checkfree import checkfree_average
from node.stage.stage_worker import StageWorker
from protocol.stage_state import StageState

pytestmark = pytest.mark.usefixtures("one_thread")


def config(num_stages: int, strategy: str, **training: object) -> SwarmConfig:
    return SwarmConfig(num_stages=num_stages).replace(recovery={"strategy": strategy}, training=training)


def rebuild_with(
    cfg: SwarmConfig, worker: StageWorker, sources: dict[int, StageState], monkeypatch: pytest.MonkeyPatch
) -> rebuild.RebuildResult:
    async def fake_fetch(plan, transport, peers_by_stage, expect, rng):
        assert set(plan.sources) == set(sources)
        return {s: rebuild.FetchedSource(s, f"peer-{s}", state) for s, state in sources.items()}

    monkeypatch.setattr(rebuild, "fetch_sources", fake_fetch)

    async def main() -> rebuild.RebuildResult:
        return await rebuild.rebuild_stage(
            config=cfg, stage=worker.stage, worker=worker, transport=None, peers_by_stage={}, rng=random.Random(0)
        )

    return asyncio.run(main())


def test_a_neighbour_that_never_stepped_weighs_one_in_the_average(monkeypatch):
    cfg = config(4, "checkfree")  # block stages 1..3: stage 2 is a middle stage
    prev = build_stage(cfg.model, 1, cfg.seed).state_dict()
    nxt = build_stage(cfg.model, 3, cfg.seed).state_dict()
    sources = {
        1: StageState(stage=1, weights=prev, inner_step=40, grad_norm=None),  # joined, no step yet
        3: StageState(stage=3, weights=nxt, inner_step=40, grad_norm=0.5),
    }
    worker = StageWorker(cfg, 2)
    try:
        result = rebuild_with(cfg, worker, sources, monkeypatch)
        expected = checkfree_average(prev, nxt, 1.0, 0.5)
        loaded = worker.state_dict()
        assert all(torch.equal(loaded[k], expected[k]) for k in expected)
        # not the near-copy of stage 3 that a norm of 0.0 (weight 1e-4) would have made
        copy_like = checkfree_average(prev, nxt, 0.0, 0.5)
        assert not torch.allclose(loaded["layers.0.mlp.down_proj.weight"], copy_like["layers.0.mlp.down_proj.weight"])
        assert "|g|=?" in result.detail and result.lr_scale == pytest.approx(cfg.recovery.lr_scale)
    finally:
        worker.close()


def test_a_zeroed_stage_is_the_identity_and_stays_so_while_the_others_train(monkeypatch):
    # weight decay on: decoupled decay of a zero weight is zero too
    cfg = config(3, "zero", microbatches_per_step=1, weight_decay=0.1)
    workers = [StageWorker(cfg, stage) for stage in range(3)]
    try:
        result = rebuild_with(cfg, workers[1], {}, monkeypatch)
        assert result.plan.action == "zero" and result.lr_scale == 1.0 and "every parameter zero" in result.detail
        assert all(not w.any() for w in workers[1].state_dict().values())
        before = [w.state_dict() for w in workers]
        g = torch.Generator().manual_seed(0)
        for index in range(4):
            seqs = torch.randint(0, cfg.model.vocab_size, (2, 17), generator=g)
            key = ("origin", index)
            hidden = workers[0].embed(key, seqs[:, :-1])
            out = workers[1].forward(key, hidden)
            assert torch.equal(out, hidden)  # x + attn(0) + mlp(0): the residual stream passes through
            out = workers[2].forward(key, out)
            _, grad = workers[0].head_loss_backward(key, out, seqs[:, 1:])
            grad = workers[2].backward(key, grad)
            grad_in = workers[1].backward(key, grad)
            assert torch.equal(grad_in, grad)  # and the gradient passes through unchanged
            workers[0].embed_backward(key, grad_in)
        assert workers[1].inner_step == 4 and workers[1].last_grad_norm == 0.0  # it stepped, on zero gradients
        assert all(not w.any() for w in workers[1].state_dict().values())
        for stage in (0, 2):  # the surviving stages did train
            after = workers[stage].state_dict()
            assert any(not torch.equal(after[k], before[stage][k]) for k in after)
    finally:
        for worker in workers:
            worker.close()


def test_zero_rebuilds_stage_0_from_a_fresh_init(monkeypatch):
    cfg = config(3, "zero")
    worker = StageWorker(cfg, 0)
    try:
        result = rebuild_with(cfg, worker, {}, monkeypatch)
        assert result.plan.action == "fresh"
        weights = worker.state_dict()
        assert all(w.any() for w in weights.values())
        # a new seed: not the swarm's original initialisation
        original = build_stage(cfg.model, 0, cfg.seed).state_dict()
        assert not torch.equal(weights["embed_tokens.weight"], original["embed_tokens.weight"])
    finally:
        worker.close()

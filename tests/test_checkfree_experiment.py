"""CheckFree's recovery experiment in miniature, deterministic, in one process (no networking).

Blagoev et al. (2025) lose a middle stage and rebuild it by (a) the gradient-norm-weighted average
of its two neighbours (CheckFree), (b) a copy of a neighbour, (c) a fresh random init, and report
(a) < (b) < (c) in loss/perplexity. Here: stage 0 (edge) + 4 block stages of the project's model
(node/model.py) trained with the project's StageWorker, stage 2 lost after TRAIN_STEPS steps and
rebuilt through node/checkfree.plan_rebuild + execute_rebuild, loss measured on fixed held-out
batches right after the rebuild and after RECOVERY_STEPS more steps (rebuilt stage at lr x 1.1).

Data: a second-order Markov chain (next token depends on the last two tokens). The project's
synthetic source is first order, and on it no block stage matters: any function of the current
token is already representable by the embedding alone, so losing/rebuilding a block changes the
loss by less than the batch noise (measured: the three strategies within 0.012 nats of each other,
see docs/recovery.md). With a second-order chain the blocks must carry the previous token
(attention) and combine it (MLP): skipping stage 2 costs ~0.35-0.4 nats.

What this model family shows, and what is asserted (figures in docs/recovery.md):
- CheckFree's average beats copying a neighbour right after the rebuild, by 0.08-0.14 nats in every
  setting tried (asserted with a 0.03 margin);
- a fresh block is N(0, 0.02) inside a pre-norm residual stream: it is nearly the identity, so
  "random" costs what skipping the stage costs (asserted: within 0.03 nats of skipping), which
  here is *less* than copying and about equal to CheckFree. The paper's copy < random is not
  reproduced at this scale; it is reported, not asserted.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest
import torch

from node.checkfree import execute_rebuild, plan_rebuild, recovered_lr_scale
from node.config import load_config
from node.model import build_stage
from node.stage_worker import StageWorker

TRAIN_STEPS = 300
RECOVERY_STEPS = 20
LOST = 2
NUM_STAGES = 5  # stage 0 + block stages 1..4
SEQ, BATCH = 32, 8


class SecondOrderMarkov:
    """x_t ~ P[x_{t-2}, x_{t-1}, :]: `branching` successors per pair of tokens, Dirichlet(1) weights."""

    def __init__(self, vocab: int, branching: int, seed: int, stream: int) -> None:
        chain = np.random.default_rng(seed)
        self.vocab, self.branching = vocab, branching
        self.successors = chain.integers(0, vocab, size=(vocab, vocab, branching))
        self.cumulative = np.cumsum(chain.dirichlet(np.ones(branching), size=(vocab, vocab)), axis=-1)
        self.rng = np.random.default_rng(10_000 + stream)

    def next_batch(self, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = np.empty((batch, seq + 1), dtype=np.int64)
        x[:, :2] = self.rng.integers(0, self.vocab, size=(batch, 2))
        for t in range(2, seq + 1):
            k = (self.cumulative[x[:, t - 2], x[:, t - 1]] <= self.rng.random((batch, 1))).sum(axis=1)
            x[:, t] = self.successors[x[:, t - 2], x[:, t - 1], np.minimum(k, self.branching - 1)]
        tokens = torch.from_numpy(x)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def experiment_config(seed: int):
    return load_config(None, swarm_id="checkfree-experiment", seed=seed, num_stages=NUM_STAGES, **{
        "model.vocab_size": 32, "model.hidden_size": 64, "model.intermediate_size": 128,
        "model.num_attention_heads": 4, "model.num_key_value_heads": 4,
        "training.microbatch_size": BATCH, "training.sequence_length": SEQ, "training.microbatches_per_step": 1,
        "training.learning_rate": 3e-3, "training.warmup_steps": 20, "training.total_steps": 2000,
        "recovery.checkfree_plus": False,  # a middle stage: plain CheckFree, normal pipeline order
    })


class Pipeline:
    """The stages chained in one process, each with its own StageWorker (optimizer, clipping, grad norm)."""

    def __init__(self, config) -> None:
        self.config = config
        self.workers = [StageWorker(config, stage) for stage in range(NUM_STAGES)]

    def train_step(self, key, tokens, targets) -> float:
        w = self.workers
        hidden = w[0].embed(key, tokens)
        for stage in range(1, NUM_STAGES):
            hidden = w[stage].forward(key, hidden)
        loss, grad = w[0].head_loss_backward(key, hidden, targets)
        for stage in reversed(range(1, NUM_STAGES)):
            grad = w[stage].backward(key, grad)
        w[0].embed_backward(key, grad)
        return loss

    @torch.no_grad()
    def eval_loss(self, batches, skip: int | None = None) -> float:
        losses = []
        for tokens, targets in batches:
            hidden = self.workers[0].module.embed(tokens)
            for stage in range(1, NUM_STAGES):
                if stage != skip:
                    hidden = self.workers[stage].module(hidden)
            losses.append(float(self.workers[0].module.loss(hidden, targets)))
        return sum(losses) / len(losses)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


def run_experiment(seed: int) -> dict[str, float]:
    torch.manual_seed(seed)
    config = experiment_config(seed)
    held_out = SecondOrderMarkov(32, 2, seed, stream=999)
    eval_batches = [held_out.next_batch(16, SEQ) for _ in range(8)]
    pipe = Pipeline(config)
    try:
        source = SecondOrderMarkov(32, 2, seed, stream=1)
        for step in range(TRAIN_STEPS):
            pipe.train_step(("train", step), *source.next_batch(BATCH, SEQ))
        results = {"no_failure": pipe.eval_loss(eval_batches), "skip_stage": pipe.eval_loss(eval_batches, skip=LOST)}
        # the moment of the failure: what survives is the neighbours' weights and last clipped grad norms
        weights = [w.state_dict() for w in pipe.workers]
        optimizers = [copy.deepcopy(w.optimizer.state_dict()) for w in pipe.workers]
        fetched = {s: (weights[s], pipe.workers[s].last_grad_norm) for s in (LOST - 1, LOST + 1)}
        results["grad_norms"] = (fetched[LOST - 1][1], fetched[LOST + 1][1])
        for strategy in ("checkfree", "copy", "random"):
            for worker, sd, opt in zip(pipe.workers, weights, optimizers):  # every run starts from the same point
                worker.load_state_dict(sd, fresh_optimizer=False)
                worker.optimizer.load_state_dict(copy.deepcopy(opt))
                worker.inner_step = TRAIN_STEPS
            plan = plan_rebuild(LOST, NUM_STAGES, strategy, checkfree_plus=False)
            rebuilt = execute_rebuild(plan, fetched, lambda: build_stage(config, LOST, init_seed=seed + 1000).state_dict(), None)
            pipe.workers[LOST].load_state_dict(rebuilt, fresh_optimizer=True)
            pipe.workers[LOST].set_lr_scale(recovered_lr_scale(config.recovery.lr_scale, plan))
            results[strategy] = pipe.eval_loss(eval_batches)
            recovery = SecondOrderMarkov(32, 2, seed, stream=2)  # the same batches for every strategy
            for step in range(RECOVERY_STEPS):
                pipe.train_step(("recover", strategy, step), *recovery.next_batch(BATCH, SEQ))
            results[f"{strategy}_recovered"] = pipe.eval_loss(eval_batches)
            pipe.workers[LOST].set_lr_scale(1.0)
        return results
    finally:
        pipe.close()


@pytest.mark.timeout(120)
def test_checkfree_average_beats_copy_and_random_is_a_skipped_stage():
    torch.set_num_threads(1)
    start = time.perf_counter()
    r = run_experiment(seed=0)
    print("\ncheckfree experiment (nats):", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()},
          f"{time.perf_counter() - start:.1f} s")

    # the setting is meaningful: stage 2 carries real function, training converged past the ln V start
    assert r["no_failure"] < np.log(32) - 1.0
    assert r["skip_stage"] > r["no_failure"] + 0.15
    # every rebuild hurts, and CheckFree's average hurts less than copying a neighbour (the paper's
    # central comparison; margins 0.08-0.14 nats over 7 settings tried)
    for strategy in ("checkfree", "copy", "random"):
        assert r[strategy] > r["no_failure"], strategy
    assert r["checkfree"] < r["copy"] - 0.03
    # a fresh N(0, 0.02) block in a pre-norm residual stream is about the identity: "random" costs
    # what skipping the stage costs (which is why it does not come out last here, unlike the paper)
    assert abs(r["random"] - r["skip_stage"]) < 0.03
    # all strategies keep training from the rebuilt state (the loss falls back towards no_failure)
    for strategy in ("checkfree", "copy", "random"):
        assert r[f"{strategy}_recovered"] < r[strategy] - 0.1, strategy

"""CheckFree's recovery experiment in miniature, deterministic, in one process (no networking).

The CheckFree authors (docs/algorithms.md, "What the authors report") lose a middle stage and rebuild it by (a) the gradient-norm-weighted average
of its two neighbours (CheckFree), (b) a copy of a neighbour, (c) a fresh random init, and report
(a) < (b) < (c) in loss/perplexity. Here: stage 0 (edge) + 4 block stages of the project's model
(node/model/llama.py) trained with the project's StageWorker, stage 2 lost after TRAIN_STEPS steps and
rebuilt through node/recovery/checkfree.py's plan_rebuild + execute_rebuild, loss measured on fixed held-out
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
- under repeated failures (run_repeated_failures, the paper's protocol in miniature): CheckFree's
  rebuild hurts less than a copy right after the rebuilds in all 9 grid settings (asserted); the
  end-of-run order and copy < random flip across the grid (reported, not asserted).
"""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest
import torch

from node.config import RecoveryStrategy, read_config
from node.model.llama import build_stage
from node.recovery.checkfree import execute_rebuild, plan_rebuild, recovered_lr_scale
from node.simulate.sources import SecondOrderMarkov
from node.stage.stage_worker import StageWorker
from tests.helpers.chain import chain_microbatch

TRAIN_STEPS = 300
RECOVERY_STEPS = 20
LOST = 2
NUM_STAGES = 5  # stage 0 + block stages 1..4
SEQ, BATCH = 32, 8

# the neighbour-based and fresh-init strategies compared (checkpoint has nothing to compare here)
STRATEGIES = (RecoveryStrategy.CHECKFREE, RecoveryStrategy.COPY, RecoveryStrategy.RANDOM)


def experiment_config(seed: int):
    return read_config(
        None,
        swarm_id="checkfree-experiment",
        seed=seed,
        num_stages=NUM_STAGES,
        **{
            "model.vocab_size": 32,
            "model.hidden_size": 64,
            "model.intermediate_size": 128,
            "model.num_attention_heads": 4,
            "model.num_key_value_heads": 4,
            "training.microbatch_size": BATCH,
            "training.sequence_length": SEQ,
            "training.microbatches_per_step": 1,
            "training.learning_rate": 3e-3,
            "training.warmup_steps": 20,
            "training.total_steps": 2000,
            "recovery.checkfree_plus": False,  # a middle stage: plain CheckFree, normal pipeline order
        },
    )


class Pipeline:
    """The stages chained in one process, each with its own StageWorker (optimizer, clipping, grad norm)."""

    def __init__(self, config) -> None:
        self.config = config
        self.num_stages = config.num_stages
        self.workers = [StageWorker(config, stage) for stage in range(self.num_stages)]

    def train_step(self, key, tokens, targets) -> float:
        return chain_microbatch(self.workers, key, tokens, targets)

    @torch.no_grad()
    def eval_loss(self, batches, skip: int | None = None) -> float:
        losses = []
        for tokens, targets in batches:
            hidden = self.workers[0].module.embed(tokens)
            for stage in range(1, self.num_stages):
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
        for strategy in STRATEGIES:
            for worker, sd, opt in zip(pipe.workers, weights, optimizers):  # every run starts from the same point
                worker.load_state_dict(sd, fresh_optimizer=False)
                worker.optimizer.load_state_dict(copy.deepcopy(opt))
                worker.inner_step = TRAIN_STEPS
            plan = plan_rebuild(LOST, NUM_STAGES, strategy, checkfree_plus=False)
            rebuilt = execute_rebuild(
                plan, fetched, lambda: build_stage(config.model, LOST, seed + 1000).state_dict(), None
            )
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
    print(
        "\ncheckfree experiment (nats):",
        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()},
        f"{time.perf_counter() - start:.1f} s",
    )

    # the setting is meaningful: stage 2 carries real function, training converged past the ln V start
    assert r["no_failure"] < np.log(32) - 1.0
    assert r["skip_stage"] > r["no_failure"] + 0.15
    # every rebuild hurts, and CheckFree's average hurts less than copying a neighbour (the paper's
    # central comparison; margins 0.08-0.14 nats over 7 settings tried)
    for strategy in STRATEGIES:
        assert r[strategy] > r["no_failure"], strategy
    assert r["checkfree"] < r["copy"] - 0.03
    # a fresh N(0, 0.02) block in a pre-norm residual stream is about the identity: "random" costs
    # what skipping the stage costs (which is why it does not come out last here, unlike the paper)
    assert abs(r["random"] - r["skip_stage"]) < 0.03
    # all strategies keep training from the rebuilt state (the loss falls back towards no_failure)
    for strategy in STRATEGIES:
        assert r[f"{strategy}_recovered"] < r[strategy] - 0.1, strategy


# ------------------------------------------------------------------------------------------------
# Repeated failures, closer to the paper's protocol: train, then keep training while middle stages
# fail with a fixed per-iteration probability (one seeded schedule shared by every strategy); each
# failure is rebuilt at once with the strategy under test (fresh optimizer, lr x 1.1 for
# checkfree/copy from then on). Loss on fixed held-out batches right after every rebuild and at the end.

# copy - checkfree, grid minima over 9 settings (docs/recovery.md): 0.0095 nats in mean loss right
# after the rebuilds (pretrain 100), 0.0131 in mean jump at the rebuild (5 block stages); asserted at ~half
MARGIN_AFTER = 0.005
MARGIN_DAMAGE = 0.006


def repeated_config(seed: int, hidden: int, layers: int, block_stages: int, total_steps: int):
    return read_config(
        None,
        swarm_id="checkfree-repeated",
        seed=seed,
        num_stages=block_stages + 1,
        **{
            "model.vocab_size": 32,
            "model.hidden_size": hidden,
            "model.intermediate_size": 2 * hidden,
            "model.num_attention_heads": 4,
            "model.num_key_value_heads": 4,
            "model.layers_per_stage": layers,
            "training.microbatch_size": BATCH,
            "training.sequence_length": SEQ,
            "training.microbatches_per_step": 1,
            "training.learning_rate": 3e-3,
            "training.warmup_steps": 20,
            "training.total_steps": total_steps,
            "recovery.checkfree_plus": False,
        },
    )


def failure_schedule(seed: int, steps: int, fail_prob: float, block_stages: int) -> list[tuple[int, int]]:
    """(step, stage): before step t of the failure phase, with probability fail_prob, one middle
    stage (2..S-1, the ones CheckFree can rebuild without CheckFree+) is lost with all its replicas."""
    rng = np.random.default_rng(20_000 + seed)
    fails = rng.random(steps) < fail_prob
    stages = rng.integers(2, block_stages, size=steps)  # 2..S-1
    return [(t, int(stages[t])) for t in range(steps) if fails[t]]


def run_repeated_failures(
    seed: int,
    hidden: int = 64,
    layers: int = 1,
    block_stages: int = 4,
    pretrain: int = 200,
    steps: int = 200,
    fail_prob: float = 0.03,
) -> dict:
    """Pretrain `pretrain` steps (shared), then `steps` more per strategy under the failure schedule.

    Returns per strategy: `after` (loss right after each rebuild), `before` (loss just before each
    failure, same trajectory), `final`; plus `no_failure` (final loss without failures), `schedule`.
    """
    torch.manual_seed(seed)
    config = repeated_config(seed, hidden, layers, block_stages, pretrain + steps)
    num_stages = block_stages + 1
    held_out = SecondOrderMarkov(32, 2, seed, stream=999)
    eval_batches = [held_out.next_batch(16, SEQ) for _ in range(8)]
    schedule = failure_schedule(seed, steps, fail_prob, block_stages)
    pipe = Pipeline(config)
    try:
        source = SecondOrderMarkov(32, 2, seed, stream=1)
        for step in range(pretrain):
            pipe.train_step(("train", step), *source.next_batch(BATCH, SEQ))
        weights = [w.state_dict() for w in pipe.workers]
        optimizers = [copy.deepcopy(w.optimizer.state_dict()) for w in pipe.workers]
        results: dict = {"pretrained": pipe.eval_loss(eval_batches), "schedule": schedule}
        for strategy in (None, *STRATEGIES):
            for worker, sd, opt in zip(pipe.workers, weights, optimizers):  # every run starts from the same point
                worker.load_state_dict(sd, fresh_optimizer=False)
                worker.optimizer.load_state_dict(copy.deepcopy(opt))
                worker.inner_step = pretrain
                worker.set_lr_scale(1.0)
            failures = dict(schedule) if strategy else {}
            before, after, rebuilds = [], [], 0
            phase = SecondOrderMarkov(32, 2, seed, stream=2)  # the same batches for every strategy
            for step in range(steps):
                lost = failures.get(step)
                if lost is not None:
                    before.append(pipe.eval_loss(eval_batches))
                    fetched = {
                        s: (pipe.workers[s].state_dict(), pipe.workers[s].last_grad_norm) for s in (lost - 1, lost + 1)
                    }
                    plan = plan_rebuild(lost, num_stages, strategy, checkfree_plus=False)
                    init_seed = seed + 1000 + rebuilds
                    rebuilt = execute_rebuild(
                        plan, fetched, lambda: build_stage(config.model, lost, init_seed).state_dict(), None
                    )
                    pipe.workers[lost].load_state_dict(rebuilt, fresh_optimizer=True)
                    pipe.workers[lost].set_lr_scale(recovered_lr_scale(config.recovery.lr_scale, plan))
                    after.append(pipe.eval_loss(eval_batches))
                    rebuilds += 1
                pipe.train_step(("phase", strategy, step), *phase.next_batch(BATCH, SEQ))
            final = pipe.eval_loss(eval_batches)
            if strategy is None:
                results["no_failure"] = final
            else:
                results[strategy] = {"before": before, "after": after, "final": final}
        return results
    finally:
        pipe.close()


@pytest.mark.timeout(240)
def test_repeated_failures_checkfree_rebuild_hurts_less_than_copy():
    """The paper's protocol in miniature (grid and figures in docs/recovery.md): h64, 1 layer per
    stage, 4 block stages, 200 steps, then 200 more while stage 2 or 3 fails with probability 0.03
    per iteration (10 failures here). ~30 s of CPU on an idle core.

    Asserted: only what held in every setting of the grid. CheckFree's rebuild costs less than a
    copy, right after each rebuild (mean loss after the rebuilds and mean jump at the rebuild).
    Not asserted, because it flips across the grid: the final ordering (checkfree < copy and
    random < copy at the end with 4 block stages; copy < checkfree < random with 5) and copy < random.
    """
    torch.set_num_threads(1)
    start = time.process_time()
    r = run_repeated_failures(seed=0, hidden=64, layers=1, block_stages=4, pretrain=200, steps=200, fail_prob=0.03)
    after = {s: float(np.mean(r[s]["after"])) for s in STRATEGIES}
    damage = {s: float(np.mean(np.subtract(r[s]["after"], r[s]["before"]))) for s in STRATEGIES}
    final = {s: r[s]["final"] for s in STRATEGIES}
    print(
        f"\nrepeated failures (nats), {len(r['schedule'])} failures, no_failure {r['no_failure']:.4f}:",
        {"after": after, "damage": damage, "final": final},
        f"{time.process_time() - start:.1f} s CPU",
    )

    assert len(r["schedule"]) >= 5
    assert r["no_failure"] < r["pretrained"] - 0.3  # the phase trains: failures interrupt real learning
    # every strategy pays for the failures, on average at each rebuild and at the end
    for s in STRATEGIES:
        assert damage[s] > 0.0, s
        assert final[s] > r["no_failure"] + 0.1, s
    # CheckFree's average hurts less than copying a neighbour right after the rebuilds: mean loss
    # after the rebuilds and mean jump at the rebuild (grid minima MARGIN_* below, asserted at ~half)
    assert after["checkfree"] < after["copy"] - MARGIN_AFTER
    assert damage["checkfree"] < damage["copy"] - MARGIN_DAMAGE

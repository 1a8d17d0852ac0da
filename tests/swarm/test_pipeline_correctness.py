"""The swarm computes what one process computes: same gradients, same loss curve.

One peer per stage (so routing is deterministic), uncompressed activations, real libp2p streams.
"""

from __future__ import annotations

import time

import pytest
import torch

from node.config import read_config
from node.model.data import open_source
from node.model.llama import ReferenceModel
from node.stage.stage_worker import StageWorker
from protocol import MicrobatchPurpose
from tests.helpers.chain import chain_microbatch
from tests.helpers.inprocess_swarm import run_in_swarm


def exact_config(microbatches_per_step: int):
    return read_config(
        None,
        swarm_id="correctness",
        num_stages=3,
        **{
            "training.wire_compression": "none",
            "training.slow_link_compression": "none",  # bit-exact on any link
            "training.microbatches_per_step": microbatches_per_step,
            "training.min_in_flight": 1,
            "training.max_in_flight": 1,
            "training.microbatch_size": 4,
            "training.sequence_length": 32,
            "recovery.checkfree_plus": False,
            "heartbeat.period": 1.0,
            "heartbeat.ttl": 10.0,
        },
    )


@pytest.mark.timeout(120)
def test_swarm_gradients_equal_single_process_gradients():
    config = exact_config(microbatches_per_step=1000)  # accumulate only: no step during the test
    source = open_source(config, None, stream_id=7)
    batches = [source.next_batch(4, 32) for _ in range(2)]

    async def swarm_grads(peers):
        for tokens, targets in batches:
            loss = await peers[0].service.pipeline.run_microbatch(tokens, targets)
            assert loss is not None
        # every hop went over direct links (node/p2p/direct.py), not through p2pd
        assert [peer.network.direct.opened for peer in peers] == [2, 2, 2]
        assert [peer.network.direct.accepted for peer in peers] == [2, 2, 2]
        return [{name: p.grad.clone() for name, p in peer.service.worker.module.named_parameters()} for peer in peers]

    grads = run_in_swarm(config, [0, 1, 2], swarm_grads)

    reference = ReferenceModel(config.model, config.num_stages, config.seed)
    for tokens, targets in batches:
        (reference(tokens, targets) / config.training.microbatches_per_step).backward()
    modules = [reference.edge, *reference.blocks]
    for stage, module in enumerate(modules):
        for name, param in module.named_parameters():
            assert torch.allclose(grads[stage][name], param.grad, atol=1e-6, rtol=1e-4), (stage, name)


@pytest.mark.timeout(180)
def test_swarm_training_follows_single_process_loss_curve():
    config = exact_config(microbatches_per_step=1)
    source = open_source(config, None, stream_id=11)
    batches = [source.next_batch(4, 32) for _ in range(8)]

    async def swarm_losses(peers):
        return [await peers[0].service.pipeline.run_microbatch(t, y) for t, y in batches]

    swarm = run_in_swarm(config, [0, 1, 2], swarm_losses)

    # the same stages, optimizers and schedule chained in one process, no network
    workers = [StageWorker(config, stage) for stage in range(3)]
    single = []
    for index, (tokens, targets) in enumerate(batches):
        single.append(chain_microbatch(workers, ("local", index), tokens, targets))
    for worker in workers:
        worker.close()

    assert all(loss is not None for loss in swarm)
    assert swarm == pytest.approx(single, rel=1e-4, abs=1e-5)
    assert single[-1] < single[0]  # it is training, not just evaluating


@pytest.mark.timeout(120)
def test_a_microbatch_lost_mid_pipeline_is_retried_at_once_not_at_the_deadline():
    config = exact_config(microbatches_per_step=1000).replace(training={"hop_timeout": 30.0})
    source = open_source(config, None, stream_id=3)
    tokens, targets = source.next_batch(4, 32)

    async def run(peers):
        last_stage = peers[2].service.worker
        real_forward, calls = last_stage.forward, []

        def fail_once(key, hidden):
            calls.append(key)
            if len(calls) == 1:
                raise ValueError("simulated bad activations")
            return real_forward(key, hidden)

        last_stage.forward = fail_once
        pipeline = peers[0].service.pipeline
        started = time.monotonic()
        loss = await pipeline.run_microbatch(tokens, targets)
        return loss, time.monotonic() - started, pipeline.stats.retried, len(calls)

    loss, seconds, retried, calls = run_in_swarm(config, [0, 1, 2], run)
    assert loss is not None and retried == 1 and calls == 2
    # the stage that failed told the origin: far sooner than the 90 s deadline (3 x hop_timeout)
    assert seconds < 15, seconds


@pytest.mark.timeout(120)
def test_evaluation_microbatches_give_the_reference_loss_and_train_nothing():
    """Validation's microbatches (protocol/microbatch_header.py) take the normal stage order even with
    CheckFree+ on, return the loss of the whole model in one process, and leave every peer as it
    was: no stored activations, no gradients, no step, no training statistic."""
    config = exact_config(microbatches_per_step=1).replace(recovery={"checkfree_plus": True})
    batches = [open_source(config, None, stream_id=13).next_batch(4, 32) for _ in range(3)]

    async def run(peers):
        pipeline = peers[0].service.pipeline
        losses = [await pipeline.run_microbatch(t, y, MicrobatchPurpose.EVAL) for t, y in batches]
        workers = [peer.service.worker for peer in peers]
        untouched = all(
            w.num_stored == 0 and w.inner_step == 0 and w.microbatches_done == 0 and w.evicted == 0
            and all(p.grad is None for p in w.module.parameters())
            for w in workers
        )  # fmt: skip
        stats = pipeline.stats
        return losses, untouched, (stats.completed, len(stats.losses), stats.retried, len(pipeline.in_flight))

    losses, untouched, stats = run_in_swarm(config, [0, 1, 2], run)
    reference = ReferenceModel(
        config.model, config.num_stages, config.seed
    )  # every stage at its initial weights, chained in the normal order
    with torch.no_grad():
        expected = [float(reference(t, y)) for t, y in batches]
    assert losses == pytest.approx(expected, abs=1e-5)
    assert untouched and stats == (0, 0, 0, 0)

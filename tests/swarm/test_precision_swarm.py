"""A small swarm trains in bf16 on CPU: three real peers (one per stage) over libp2p on loopback,
every stage computing under bf16 autocast, the weights staying fp32 (node/stage/precision.py)."""

from __future__ import annotations

import time

import pytest
import torch

from node.config import Precision, read_config
from node.model.data import open_source
from tests.helpers.inprocess_swarm import run_in_swarm

MICROBATCHES = 30


@pytest.mark.timeout(240)
def test_a_swarm_trains_in_bf16_on_cpu():
    config = read_config(
        None,
        swarm_id="precision",
        num_stages=3,
        **{
            "training.precision": "bf16",
            "training.microbatches_per_step": 1,
            "training.warmup_steps": 2,  # a short run: reach the peak learning rate at once
            "training.min_in_flight": 1,
            "training.max_in_flight": 1,
            "training.microbatch_size": 8,
            "training.sequence_length": 32,
            "recovery.checkfree_plus": False,
            "heartbeat.period": 1.0,
            "heartbeat.ttl": 10.0,
        },
    )
    source = open_source(config, None, stream_id=2)
    batches = [source.next_batch(8, 32) for _ in range(MICROBATCHES)]

    async def train(peers) -> tuple[list[float | None], float, list]:
        workers = [peer.service.worker for peer in peers]
        start = time.perf_counter()
        losses = [await peers[0].service.pipeline.run_microbatch(t, y) for t, y in batches]
        return losses, time.perf_counter() - start, workers

    losses, seconds, workers = run_in_swarm(config, [0, 1, 2], train)
    assert all(loss is not None for loss in losses), losses
    assert all(w.precision.precision is Precision.BF16 for w in workers)
    assert all(w.inner_step == MICROBATCHES for w in workers)  # every stage stepped on every microbatch
    assert all(p.dtype == torch.float32 for w in workers for p in w.module.parameters())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    tokens_per_second = MICROBATCHES * 8 * 32 / seconds
    print(f"bf16 swarm: loss {first:.3f} -> {last:.3f} in {MICROBATCHES} steps, {tokens_per_second:.0f} tokens/s")
    assert last < first - 1.0, (first, last)  # from ln(256) = 5.5 toward the chain's floor (1.10)

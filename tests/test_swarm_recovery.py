"""Losing every peer of a stage and getting it back (node/recovery.py, node/rebalance.py).

Fast part: the detection, move and rollback rules on plain records, and a stage service left and
entered again for another stage in one process (real p2pd). Multi-process part: real swarms on
loopback (tiny model, heartbeat 1 s / TTL 4 s, lost_grace 2 s) where `kill -9` takes out a whole
stage and a joiner or a moving peer rebuilds it. With PIPESWARM_DEBUG_DIR set, the rebuilding peer
writes what it fetched and what it loaded (plain tensors); the tests recompute the CheckFree rule
on those inputs with their own arithmetic.
"""

from __future__ import annotations

import asyncio
import glob
import math
import random
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from dht.records import PeerRecord, SwarmEvent
from node.checkfree import plan_rebuild
from node.checkpoints import checkpoint_root, save_checkpoint
from node.config import SwarmConfig
from node.local_swarm import NodeProcess, Swarm, peers_by_stage, wait_for
from node.rebalance import Move, Rebalancer, plan_move
from node.recovery import LostStageTracker, lost_stages_from_events, must_rebuild, rebuild_stage
from node.stage_worker import StageWorker
from node.transport import TransportError
from protocol import MessageKind
from node.status import stage_status


def peer(pid: str, stage: int, state: str = "online", inner_step: int = 10, throughput: float = 1.0) -> PeerRecord:
    return PeerRecord(peer_id=pid, stage=stage, state=state, inner_step=inner_step, throughput=throughput)


# ------------------------------------------------------------------------------------------------
# Rules on plain records


def test_a_stage_is_lost_only_after_the_grace_and_only_once_the_swarm_has_trained():
    tracker = LostStageTracker(num_stages=3, lost_grace=2.0)
    untrained = {0: [peer("a", 0, inner_step=0)], 1: [], 2: [peer("c", 2, inner_step=0)]}
    tracker.observe(untrained, now=0.0)
    assert tracker.lost_stages(now=100.0) == set()  # start-up: an empty stage is just empty
    trained = {0: [peer("a", 0)], 1: [peer("b", 1, state="leaving")], 2: [peer("c", 2)]}
    tracker.observe(trained, now=10.0)
    assert tracker.lost_stages(now=11.9) == set() and tracker.lost_for(1, 11.9) == 0.0
    assert tracker.lost_stages(now=12.0) == {1}
    assert tracker.lost_for(1, 15.0) == pytest.approx(3.0)
    tracker.observe({**trained, 1: [peer("d", 1, state="rebuilding", inner_step=0)]}, now=16.0)
    assert tracker.lost_stages(now=30.0) == set()  # a rebuilding peer holds the stage again


def test_a_joiner_rebuilds_only_a_stage_nobody_online_holds_in_a_trained_swarm():
    swarm = {0: [peer("a", 0)], 1: [peer("me", 1, state="joining", inner_step=0)], 2: [peer("c", 2)]}
    assert must_rebuild(swarm, 1, "me")
    assert not must_rebuild({**swarm, 1: [*swarm[1], peer("b", 1)]}, 1, "me")  # download from b instead
    fresh = {s: [peer(p.peer_id, s, p.state, inner_step=0) for p in peers] for s, peers in swarm.items()}
    assert not must_rebuild(fresh, 1, "me")


def test_status_reads_lost_from_the_latest_event_and_flags_unrecoverable():
    swarm = {0: [peer("a", 0)], 1: [], 2: [], 3: [peer("d", 3)]}
    events = [SwarmEvent(1.0, "lost", "a", 1, ""), SwarmEvent(2.0, "rebuild", "x", 1, ""),
              SwarmEvent(3.0, "lost", "a", 2, ""), SwarmEvent(0.5, "lost", "a", 3, "")]
    # stage 1's latest event is its rebuild (it is empty again, but not yet declared lost again);
    # stage 3 has a live peer whatever old events say
    assert lost_stages_from_events(swarm, events, 4) == {2}
    assert lost_stages_from_events(swarm, [*events, SwarmEvent(4.0, "lost", "a", 1, "")], 4) == {1, 2}
    assert stage_status([], lost=True) == "lost"
    assert stage_status([], lost=True, unrecoverable=True) == "unrecoverable"
    assert stage_status([peer("a", 0)]) == "single"


def test_one_peer_of_the_most_populated_stage_moves_to_a_stage_lost_past_the_wait():
    swarm = {0: [peer("a", 0)], 1: [], 2: [peer("z", 2), peer("c", 2)], 3: [peer("d", 3)]}
    assert plan_move(swarm, 4, {1: 1.0}, rebalance_wait=3.0, unrecoverable_reason=None) is None  # not yet
    assert plan_move(swarm, 4, {1: 3.0}, 3.0, None) == Move(target=1, donor=2, peer_id="c")
    assert plan_move(swarm, 4, {1: 9.0}, 3.0, "stages 1 and 2 lost together") is None
    # a stage with a single peer is never emptied to fill another
    assert plan_move({**swarm, 2: [peer("c", 2)]}, 4, {1: 9.0}, 3.0, None) is None
    # a joiner already on its way keeps the stage
    assert plan_move({**swarm, 1: [peer("j", 1, state="joining")]}, 4, {1: 9.0}, 3.0, None) is None
    # ties in peer count: the stage with more throughput gives
    tied = {**swarm, 3: [peer("d", 3, throughput=5.0), peer("e", 3, throughput=5.0)]}
    assert plan_move(tied, 4, {1: 9.0}, 3.0, None) == Move(1, 3, "d")


def test_a_move_is_made_only_when_two_checks_agree():
    rebalancer, move = Rebalancer(confirm_after=1.0), Move(1, 2, "c")
    assert rebalancer.check(move, 0.0) is None
    assert rebalancer.check(move, 0.5) is None
    assert rebalancer.check(None, 0.8) is None  # a joiner showed up: forget the pending move
    assert rebalancer.check(move, 1.0) is None
    assert rebalancer.check(move, 2.1) == move
    assert rebalancer.check(Move(3, 2, "c"), 2.2) is None  # another move starts its own wait


def test_checkpoint_strategy_reloads_the_last_save_with_its_step_and_a_fresh_optimizer(tmp_path):
    config = SwarmConfig(num_stages=3).replace(recovery={"strategy": "checkpoint", "checkpoint_dir": str(tmp_path)})
    root = checkpoint_root(tmp_path, config.swarm_id)
    saved = {k: v + 0.5 for k, v in StageWorker(config, 1).state_dict().items()}
    save_checkpoint(root, 1, {k: v - 1.0 for k, v in saved.items()}, inner_step=5)
    save_checkpoint(root, 1, saved, inner_step=10)  # the newest save wins
    worker = StageWorker(config, 1)
    worker.optimizer.state["marker"] = {"old": 1}
    swarm = {0: [peer("a", 0, inner_step=37)], 1: [], 2: [peer("c", 2, inner_step=40)]}

    async def run():
        return await rebuild_stage(config=config, stage=1, worker=worker, transport=None, peers_by_stage=swarm,
                                   rng=random.Random(0))

    try:
        result = asyncio.run(run())
        assert result.plan.action == "checkpoint" and result.inner_step == 10 and worker.inner_step == 10
        assert worker.lr_scale == 1.0  # a rollback is the real stage, no catch-up factor
        assert "marker" not in worker.optimizer.state
        for name, value in worker.state_dict().items():
            assert torch.equal(value, saved[name]), name
    finally:
        worker.close()


# ------------------------------------------------------------------------------------------------
# A stage service entered again for another stage, in one process


def test_a_peer_can_leave_its_stage_service_and_serve_another_stage_in_the_same_process():
    from tests.inprocess_swarm import inprocess_swarm
    from node.network import start_network
    from node.stage_service import ServiceOptions, running_service
    from dht.heartbeat import Heartbeat
    from dht.registry import SwarmRegistry

    config = SwarmConfig(num_stages=3).replace(heartbeat={"period": 1.0, "ttl": 4.0}, gossip={"mode": "none"})

    async def run():
        async with inprocess_swarm(config, [0, 2]) as peers:
            anchor_addrs = await peers[0].network.visible_maddrs()
            network = await start_network(host="127.0.0.1", initial_peers=anchor_addrs)
            try:
                me = PeerRecord(peer_id=network.peer_id, stage=1, state="joining")
                heartbeat = Heartbeat(SwarmRegistry(network.dht, config.swarm_id), lambda: me, 1.0, 4.0)
                for stage in (1, 2, 1):  # leave and enter again, twice
                    me.stage, me.state = stage, "joining"
                    async with running_service(network, config, me, heartbeat, ServiceOptions(device="cpu")) as service:
                        assert me.state == "online" and service.worker.stage == stage
                        # another peer reaches this peer's forward handler, answered by the new stage's
                        # service (hop 2 of order [stage, other] expects `other`: a refusal naming `stage`)
                        client = peers[0].service.transport
                        other = 3 - stage
                        message = client.message(MessageKind.FORWARD, {
                            "order": [stage, other], "path": ["x", peers[0].record.peer_id], "hop": 2,
                            "origin": "x", "microbatch_id": 1}, {"hidden": torch.zeros(1, 4, 64)})
                        with pytest.raises(TransportError, match=f"serves stage {stage} "):
                            await client.request(network.peer_id, "forward", message, timeout=10)
                # without the scope's cleanup, the same protocol cannot be registered twice
                async def noop(*_):
                    return None
                name = "/pipeswarm/test/dup"
                await network.p2p.add_binary_stream_handler(name, noop)
                with pytest.raises(Exception):
                    await network.p2p.add_binary_stream_handler(name, noop)
                await network.p2p.remove_binary_stream_handler(name)
            finally:
                await network.shutdown()

    asyncio.run(run())

"""Each tensor path of a peer at the real `15m` preset shapes keeps to its stage's device.

The paths (issue: a home GPU and a real-size model): training forward/backward and the host reads
they cost, evaluation, the weight fingerprint, a NoLoCo exchange (host copies for the wire, the
partner's tensors on the device, the outer step), outer-state export and import, a state download,
a CheckFree rebuild, CheckFree+ edge copies, spot-check receipts, openings and replays, what a donor
serves for `node export`, and a simulated swarm (node/simulate/: `make experiments DEVICE=cuda`). Everything computed must be on the worker's device; everything handed to
the wire must be on the host.

The device is the CPU here. `PIPESWARM_TEST_DEVICE=cuda` runs the same tests on a GPU (`make
gpu-check` does): the CPU cannot tell a CPU tensor from a GPU one, a GPU can.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dht.records import PeerRecord, PeerState
from node.averaging.fingerprint import WeightFingerprint
from node.averaging.gossip_codec import PhiDither
from node.averaging.outer_replica import OuterReplica
from node.config import GossipConfig, SwarmConfig, VerificationConfig
from node.model.presets import load_config
from node.pipeline.check_server import CheckServer
from node.pipeline.layer_replay import replay_layer
from node.pipeline.receipts import ReceiptBook, ReceiptKeeper
from node.pipeline.spot_check import RecomputeTolerance
from node.recovery import edge_copies as edge_copies_module
from node.recovery import rebuild as rebuild_module
from node.recovery.edge_copies import EdgeCopies, edge_parts_for, refresh_edge_copies
from node.recovery.rebuild import FetchedSource, rebuild_stage
from node.recovery.state_transfer import adopt_state, capture_state, state_provider
from node.runtime.device import DeviceTransfers, canonical_device, resolve_device
from node.stage.access import live_parameters
from node.stage.forward_only import eval_forward
from node.stage.stage_worker import StageWorker
from protocol.stage_state import StageState, StatePart, check_header, decode_payload, encode_state
from tests.helpers.known_peers import KnownPeers
from tests.helpers.workers import stage_workers

DEVICE = os.environ.get("PIPESWARM_TEST_DEVICE", "cpu")
if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"PIPESWARM_TEST_DEVICE={DEVICE} but torch sees no CUDA device", allow_module_level=True)
SEQ = 64  # the preset's model shapes; short sequences keep the stage-0 head's 32,000 logits cheap on a CPU


def preset_config(layers: int | None = None) -> SwarmConfig:
    """The 15m preset cut into 4 stages (3 block stages of 2 layers), microbatches of 2 x SEQ tokens."""
    overrides = {"model.preset": "15m", "num_stages": 4, "training.microbatch_size": 2}
    overrides |= {"training.sequence_length": SEQ, "training.microbatches_per_step": 1}
    if layers is not None:
        overrides["model.layers_per_stage"] = layers
    return load_config(**overrides)


CONFIG = preset_config()


pytestmark = pytest.mark.usefixtures("one_thread")


def on_device(tensors, device: torch.device) -> bool:
    device = canonical_device(device)  # `cuda` is `cuda:0` here; a tensor's device has its index
    return all(t.device == device for t in tensors)


def on_host(tensors) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def test_a_stage_device_carries_its_index_as_tensors_do(monkeypatch):
    """`--device cuda` is the current GPU with its index: torch says `cuda != cuda:0`, and every
    device-path check compares a tensor's device (always indexed) with the stage's."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert canonical_device("cuda") == torch.device("cuda", 1)
    assert canonical_device("cuda:3") == torch.device("cuda", 3)
    assert canonical_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert DeviceTransfers("cuda").device == torch.device("cuda", 1)


def hidden(config: SwarmConfig, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(config.training.microbatch_size, SEQ, config.model.hidden_size, generator=g, device="cpu")


class HostReads(TorchDispatchMode):
    """Counts the reads of a tensor value by the host (`.item()`, `float()`, `bool()`, `.tolist()`):
    on a GPU each one waits for the device. AdamW's step counters are left out: torch keeps them on
    the host on purpose (not capturable, not fused: fused kernels do not bump the parameters'
    version counters, which the worker's recompute-after-a-step rule reads), so their reads cost
    the GPU nothing."""

    def __init__(self, host_scalars: list[torch.Tensor]) -> None:
        super().__init__()
        self.exempt = {id(t) for t in host_scalars}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and id(args[0]) not in self.exempt:
            self.count += 1
        return func(*args, **(kwargs or {}))


def optimizer_steps(worker: StageWorker) -> list[torch.Tensor]:
    return [state["step"] for state in worker.optimizer.state.values() if "step" in state]


def block_microbatch_reads(layers: int) -> tuple[int, int, int]:
    """Host reads of a block stage's forward, its backward, and an optimizer step, with `layers` layers."""
    config = preset_config(layers)
    with stage_workers(config, 1, device=DEVICE) as (worker,):
        counts = []
        for key in range(2):
            with HostReads(optimizer_steps(worker)) as forward:
                out = worker.forward(key, hidden(config, key))
            with HostReads(optimizer_steps(worker)) as backward:
                worker.backward(key, torch.ones_like(out) * 1e-3)  # microbatches_per_step 1: steps here
            counts.append((forward.count, backward.count))
        assert worker.inner_step == 2
        return counts[1][0], counts[1][1], len(list(worker.module.parameters()))


def test_a_microbatch_reads_the_device_a_fixed_number_of_times_whatever_the_stage_size():
    """No per-tensor host sync on the hot path: the reads of a forward, and of a backward with its
    optimizer step, do not grow with the number of parameter tensors."""
    small = block_microbatch_reads(layers=1)
    large = block_microbatch_reads(layers=4)
    assert large[2] > 3 * small[2]  # 4x the layers, so ~4x the parameter tensors
    assert small[:2] == large[:2], f"host reads grew with the stage: {small[:2]} -> {large[:2]}"
    # forward: the input's finiteness (on the host) and the output's copy; backward: the incoming
    # gradient's finiteness and norm (host), the fused check of its gradients, the step's norm
    assert small[0] <= 2 and small[1] <= 4, small


def test_training_and_evaluation_compute_on_the_device_and_answer_on_the_host():
    with stage_workers(CONFIG, *range(CONFIG.num_stages), device=DEVICE) as workers:
        device = workers[0].device
        g = torch.Generator(device="cpu").manual_seed(1)
        tokens = torch.randint(0, CONFIG.model.vocab_size, (2, SEQ + 1), generator=g, device="cpu")
        h = workers[0].embed("k", tokens[:, :-1])
        assert on_host([h])
        for worker in workers[1:]:
            h = worker.forward("k", h)
            assert on_host([h])
            stored = worker.store.get("k", "block")
            assert on_device([stored.inputs, stored.output], device)
        loss, grad = workers[0].head_loss_backward("k", h, tokens[:, 1:])
        assert on_host([grad]) and loss > 0
        for worker in reversed(workers[1:]):
            grad = worker.backward("k", grad)
            assert on_host([grad])
        workers[0].embed_backward("k", grad)
        assert all(w.inner_step == 1 for w in workers)
        assert all(on_device(w.module.parameters(), device) for w in workers)
        assert on_host([eval_forward(workers[1], hidden(CONFIG))])


def test_the_fingerprint_is_computed_on_the_device_and_agrees_with_the_cpu():
    with stage_workers(CONFIG, 1, device=DEVICE) as (worker,):
        params = list(worker.module.parameters())
        fingerprint = WeightFingerprint([p.shape for p in params], seed=7)
        here = fingerprint(params)
        on_cpu = fingerprint([p.detach().to("cpu") for p in params])
        assert len(here) == 8 and here == pytest.approx(on_cpu, rel=1e-4, abs=1e-6)


def test_a_noloco_exchange_sends_host_copies_and_steps_on_the_device():
    with stage_workers(CONFIG, 2, 2, device=DEVICE) as (a, b):
        device = a.device
        replicas = [OuterReplica(live_parameters(w), GossipConfig()) for w in (a, b)]
        for worker, seed in ((a, 3), (b, 4)):  # some inner progress on each replica
            out = worker.forward("k", hidden(CONFIG, seed))
            worker.backward("k", torch.full_like(out, 1e-3))
        key = PhiDither(3)
        starts = [r.capture_start(w.inner_step, key) for r, w in zip(replicas, (a, b))]
        for start in starts:
            assert start.has_progress
            assert on_host(start.wire)  # encoded on the device, copied to the host for the wire
            assert on_device(start.state.phi + start.delta + start.theta + start.residual, device)
        # the wire: b's tensors land in a's host buffers, which a moves to its device and decodes
        buffers = replicas[0].host_buffers(True)
        assert on_host(buffers) and [t.shape for t in buffers] == [t.shape for t in starts[1].wire]
        for buffer, sent in zip(buffers, starts[1].wire):
            buffer.copy_(sent)
        phi, delta, _edge_share = replicas[0].receive(buffers, starts[0])
        assert on_device(phi + delta, device)
        reason, measures = replicas[0].check_partner(starts[0], phi, delta)
        assert reason is None and measures is not None
        new_state = replicas[0].pairwise_step(starts[0], [phi], [delta])
        assert on_device(new_state.phi + new_state.momentum, device)
        assert replicas[0].apply(starts[0], new_state)
        assert on_device(list(a.module.parameters()) + replicas[0].residual, device)


def test_an_outer_state_downloaded_to_the_host_is_imported_onto_the_device():
    with stage_workers(CONFIG, 1, 1, device=DEVICE) as (a, b):
        source, target = (
            OuterReplica(live_parameters(a), GossipConfig()),
            OuterReplica(live_parameters(b), GossipConfig()),
        )
        exported = a.transfers.state_to_host(source.export_outer(), copy=False)
        assert on_host(exported.values())
        target.import_outer(exported, round=5)
        assert target.state.round == 5
        assert on_device(target.state.phi + target.state.momentum, b.device)


def test_a_state_download_is_captured_on_the_host_and_adopted_onto_the_device():
    with stage_workers(CONFIG, 3, 3, device=DEVICE) as (donor, joiner):

        async def transfer() -> StageState:
            state = await capture_state(donor)
            assert on_host(state.weights.values())
            meta, payload = encode_state(state, StatePart.STAGE)
            layout = check_header(meta, 3, StatePart.STAGE, 1 << 32, None)
            received = decode_payload(payload, layout, meta)
            await adopt_state(joiner, received)
            return received

        received = asyncio.run(transfer())
        for name, value in joiner.module.state_dict().items():
            assert value.device == joiner.device
            assert torch.equal(value.to("cpu"), received.weights[name])


def test_a_checkfree_rebuild_averages_on_the_device(monkeypatch):
    config = CONFIG
    with stage_workers(config, 1, 3, 2, device=DEVICE) as (one, three, lost):
        neighbours = {1: one, 3: three}
        sources = {
            s: FetchedSource(s, f"peer-{s}", StageState(stage=s, weights=w.state_dict(), inner_step=9, grad_norm=0.5))
            for s, w in neighbours.items()
        }

        async def fetched(*args, **kwargs):
            return sources

        monkeypatch.setattr(rebuild_module, "fetch_sources", fetched)
        result = asyncio.run(
            rebuild_stage(config=config, stage=2, worker=lost, transport=None, peers_by_stage={}, rng=random.Random(0))
        )
        assert result.inner_step == 9 and lost.inner_step == 9
        weights = lost.module.state_dict()
        assert on_device(weights.values(), lost.device)
        name = next(iter(weights))
        expected = (sources[1].state.weights[name] + sources[3].state.weights[name]) / 2  # equal norms: equal weights
        assert torch.allclose(weights[name].to("cpu"), expected, atol=1e-6)


def test_edge_copies_are_kept_on_the_device_and_served_from_the_host(monkeypatch):
    with stage_workers(CONFIG, 0, 1, device=DEVICE) as (edge, holder):
        embed = {"embed_tokens.weight": edge.state_dict()["embed_tokens.weight"]}

        async def downloaded(*args, **kwargs):
            return StageState(stage=0, weights=embed, inner_step=4)

        monkeypatch.setattr(edge_copies_module, "download_from_any", downloaded)
        copies = EdgeCopies(stage=1, parts=edge_parts_for(1, CONFIG.num_stages))
        stage0 = PeerRecord(peer_id="edge", stage=0, state=PeerState.ONLINE, inner_step=4)

        async def refresh_and_serve() -> StageState:
            refreshed = await refresh_edge_copies(
                copies, None, [stage0], 1, random.Random(0), worker=holder, force=True
            )
            assert refreshed == [StatePart.EMBED]
            assert on_device(copies.merged_state().weights.values(), holder.device)
            me = dataclasses.replace(stage0, stage=1)
            return await state_provider(holder, me, copies)(StatePart.EDGE_COPY)

        served = asyncio.run(refresh_and_serve())
        assert on_host(served.weights.values())
        assert torch.equal(served.weights["embed_tokens.weight"], embed["embed_tokens.weight"])


def test_spot_check_receipts_and_openings_are_host_copies_and_the_replay_runs_on_the_device():
    with stage_workers(CONFIG, 1, device=DEVICE) as (worker,):
        keeper = ReceiptKeeper(worker, ReceiptBook(8, 30.0))
        server = CheckServer(VerificationConfig(), None, keeper, KnownPeers())  # type: ignore[arg-type]
        output = keeper.forward("mb", "token", hidden(CONFIG))
        keeper.backward("mb", 1e-3 * torch.randn(output.shape, device="cpu"))
        receipt = keeper.book.get("mb")
        assert receipt is not None and receipt.weights is not None
        assert on_host([receipt.received, receipt.sent, receipt.grad_received, receipt.grad_sent])
        assert on_device(receipt.weights.named.values(), worker.device)  # the forward's stash, kept as it was
        commitment = server._boundaries("checker", receipt)  # two layers: the boundary between them recomputed
        assert commitment.backward is not None and on_host(commitment.forward + commitment.backward)
        shown = server.opened_layer(commitment.weights, 1)
        assert on_host([shown])
        to_device = worker.transfers.to_device
        weights = server.layout.unflatten(to_device(shown))
        assert on_device(weights.values(), worker.device)
        boundaries = (commitment.forward[1], commitment.forward[2], commitment.backward[2], commitment.backward[1])
        errors = replay_layer(server.layout, weights, *(to_device(t) for t in boundaries))
        allowed = RecomputeTolerance.from_settings(VerificationConfig()).of(worker.precision.precision)
        assert errors[0] < allowed and errors[1] is not None and errors[1] < allowed


def test_what_a_donor_serves_for_an_export_is_a_host_copy():
    with stage_workers(CONFIG, 0, device=DEVICE) as (worker,):
        me = PeerRecord(peer_id="donor", stage=0, state=PeerState.ONLINE)
        provide = state_provider(worker, me)
        for part in (StatePart.STAGE, StatePart.WEIGHTS, StatePart.HEAD):
            served = asyncio.run(provide(part))
            assert on_host(served.weights.values()) and on_host(served.moments.values())
        live = worker.module.state_dict()["lm_head.weight"]
        assert served.weights["lm_head.weight"].data_ptr() != live.data_ptr()  # a copy: training goes on


def test_a_simulated_swarm_trains_averages_rebuilds_and_evaluates_on_the_device():
    """node/simulate/ at its own small model: workers, outer states and held-out batches on the
    device; hops, rounds and a CheckFree rebuild through the host as a real peer's go."""
    from node.config import RecoveryStrategy
    from node.simulate.recovery import rebuild
    from node.simulate.settings import SimSettings
    from node.simulate.swarm import SimulatedSwarm, SyncMode

    sim = SimSettings(stages=4, replicas=2, hidden=32, inner_steps=2, compute_ms=100.0, device=DEVICE)
    config = sim.config()
    swarm = SimulatedSwarm(config, sim.replicas, sim.link, sim.compute_seconds, SyncMode.NOLOCO, 0, device=sim.device)
    try:
        held_out = swarm.held_out(1)
        assert on_device([t for batch in held_out for t in batch], DEVICE)
        before = swarm.eval_loss(held_out)
        for _ in range(2):
            swarm.train_iteration()
        assert swarm.synchronise() > 0  # a NoLoCo round on every stage: host wire, device step
        rebuild(swarm, 2, RecoveryStrategy.CHECKFREE, init_seed=1)
        swarm.train_iteration()
        assert math.isfinite(after := swarm.eval_loss(held_out)) and after != before
        assert swarm.divergence() > 0
        for workers, outers in zip(swarm.workers, swarm.outer):
            for worker, outer in zip(workers, outers):
                assert on_device(list(live_parameters(worker).values()) + outer.state.phi + outer.residual, DEVICE)
    finally:
        swarm.close()

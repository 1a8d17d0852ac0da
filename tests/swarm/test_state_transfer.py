"""State transfer over real libp2p streams (in process): a joiner takes a live stage's state and
computes what its donor computes; hostile donors fail cleanly and another donor is used; CheckFree+
edge copies refresh; checkpoints round-trip and are written atomically."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from collections.abc import AsyncIterator, Callable

import pytest
import torch

from dht.records import PeerRecord
from node.config import read_config
from node.p2p.answer_budget import AnswerBudget, BudgetLimits
from node.p2p.network import Network, start_network
from node.p2p.transport import Transport, TransportError
from node.recovery.checkpoints import CHECKPOINT_SUFFIX, load_latest, save_checkpoint, stage_dir
from node.recovery.edge_copies import EdgeCopies, edge_parts_for, refresh_due, refresh_edge_copies
from node.recovery.state_transfer import (
    adopt_state,
    capture_state,
    download_from_any,
    download_state,
    serve_state,
    state_provider,
)
from node.runtime.byte_progress import ByteProgress, Outcome
from node.stage.stage_worker import StageWorker
from protocol import MessageKind, ProtocolError, recv_message, send_message
from protocol.stage_state import StageState, StatePart, encode_state

CHUNK = 16 << 10  # small chunks: a tiny stage still streams as many chunks


def tiny_config():
    return read_config(
        None,
        swarm_id="state-test",
        num_stages=3,
        **{
            "model.hidden_size": 32,
            "model.intermediate_size": 64,
            "model.vocab_size": 64,
            "training.microbatch_size": 4,
            "training.sequence_length": 16,
            "training.microbatches_per_step": 1,
            "training.wire_compression": "none",
            "training.slow_link_compression": "none",  # bit-exact on any link
        },
    )


def train_block(worker: StageWorker, steps: int, seed: int) -> None:
    """A few optimizer steps on random data, so the weights differ from the initial ones."""
    gen = torch.Generator().manual_seed(seed)
    h = worker.config.model.hidden_size
    for i in range(steps):
        x = torch.randn(4, 16, h, generator=gen)
        out = worker.forward(("train", seed, i), x)
        worker.backward(("train", seed, i), torch.randn(out.shape, generator=gen))


def train_edge(worker: StageWorker, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    vocab, h = worker.config.model.vocab_size, worker.config.model.hidden_size
    for i in range(steps):
        key = ("train", seed, i)
        tokens = torch.randint(0, vocab, (4, 16), generator=gen)
        worker.embed(key, tokens)
        _, _ = worker.head_loss_backward(key, torch.randn(4, 16, h, generator=gen), tokens)
        worker.embed_backward(key, torch.randn(4, 16, h, generator=gen))


def record(network: Network, stage: int, throughput: float = 1.0) -> PeerRecord:
    return PeerRecord(peer_id=network.peer_id, stage=stage, state="online", throughput=throughput)


@contextlib.asynccontextmanager
async def networks(count: int) -> AsyncIterator[list[Network]]:
    """`count` libp2p peers on loopback, all bootstrapped from the first."""
    started = [await start_network(host="127.0.0.1")]
    try:
        initial = await started[0].visible_maddrs()
        for _ in range(count - 1):
            started.append(await start_network(host="127.0.0.1", initial_peers=initial))
        yield started
    finally:
        for network in reversed(started):
            await network.shutdown()


def run(coroutine, timeout: float = 90.0):
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


# ------------------------------------------------------------------------------------------------
# Hostile donors: the real encoding, tampered with on the way out


def hostile_handler(transport: Transport, state: StageState, modes: list[str], served: list[str]) -> Callable:
    """Misbehaves as modes[-1] says (the test moves through the modes on one peer)."""

    async def handle(sender, reader, writer) -> None:
        mode = modes[-1]
        served.append(mode)
        request = await recv_message(reader, transport.limits, transport.swarm_id)
        meta, payload = encode_state(state, request.meta["part"], CHUNK)
        rid = request.request_id
        if mode == "oversized":
            # a consistent but enormous header: 2**40 float32s, nothing should be allocated
            meta = {
                **meta,
                "names": ["huge"],
                "shapes": [[1 << 40]],
                "dtypes": ["float32"],
                "total_bytes": 4 << 40,
                "num_weights": 1,
            }
        if mode == "lying_total":
            meta = {**meta, "total_bytes": meta["total_bytes"] + 1}
        await send_message(writer, transport.message(MessageKind.STATE_HEADER, meta, request_id=rid))
        chunks = [payload[o : o + CHUNK].clone() for o in range(0, payload.numel(), CHUNK)]
        if mode == "bad_checksum":
            chunks[1][7] ^= 0xFF  # one flipped byte; the announced checksum is the honest one
        if mode == "truncated":
            chunks = chunks[: len(chunks) // 2]
        if mode == "oversized_chunk":
            chunks[0] = torch.cat([chunks[0], chunks[0]])
        offset = 0
        for index, chunk in enumerate(chunks):
            await send_message(
                writer,
                transport.message(
                    MessageKind.STATE_CHUNK, {"index": index, "offset": offset}, {"chunk": chunk}, request_id=rid
                ),
            )
            offset += chunk.numel()
        if mode != "truncated":  # the truncated donor just closes the stream ("dies")
            await send_message(
                writer, transport.message(MessageKind.STATE_END, {"checksum": meta["checksum"]}, request_id=rid)
            )

    return handle


# ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_joiner_downloads_live_stage_and_computes_like_its_donor():
    config = tiny_config()

    async def scenario():
        donor_worker, joiner_worker = StageWorker(config, 1), StageWorker(config, 1)
        try:
            await donor_worker.compute(train_block, donor_worker, 5, 1)
            donor_worker.set_lr_scale(1.1)  # as if this stage had been rebuilt: joiners must keep it
            async with networks(2) as (donor_net, joiner_net):
                donor_me = record(donor_net, 1)
                donor = Transport(donor_net.p2p, config.swarm_id, 1)
                await serve_state(donor, state_provider(donor_worker, donor_me), chunk_bytes=CHUNK)
                joiner = Transport(joiner_net.p2p, config.swarm_id, 1)
                shapes = {k: tuple(v.shape) for k, v in joiner_worker.module.state_dict().items()}

                # a joiner asking for a stage the donor does not serve is refused, cleanly
                with pytest.raises(TransportError, match="refused"):
                    await download_state(joiner, donor_net.peer_id, 2, "stage", 10.0)
                with pytest.raises(TransportError, match="stage 0"):
                    await download_state(joiner, donor_net.peer_id, 1, "embed", 10.0)

                with ByteProgress(bar=False) as progress:
                    state = await download_from_any(
                        joiner, [donor_me], 1, "stage", random.Random(0), expect=shapes, progress=progress
                    )
                await adopt_state(joiner_worker, state)
        finally:
            donor_worker.close()
            joiner_worker.close()
        return donor_worker, joiner_worker, state, progress

    donor_worker, joiner_worker, state, progress = run(scenario())
    # the progress counted every byte of the payload, in its many chunks
    (shown,) = progress.tasks
    _, payload = encode_state(state, StatePart.STAGE, CHUNK)
    assert payload.numel() > 2 * CHUNK  # three chunks, the last one shorter
    assert shown.done == shown.total == payload.numel() and shown.outcome == Outcome.DONE
    assert state.stage == 1 and state.inner_step == 5 and state.outer == {}
    assert state.grad_norm == pytest.approx(donor_worker.last_grad_norm)
    assert joiner_worker.inner_step == 5 and joiner_worker.lr_scale == pytest.approx(1.1)
    x = torch.randn(2, 16, config.model.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fresh = StageWorker(config, 1)
        fresh.close()
        assert not torch.allclose(fresh.module(x), donor_worker.module(x))  # training moved the donor
        assert torch.equal(joiner_worker.module(x), donor_worker.module(x))


HOSTILE_MODES = {
    "bad_checksum": "checksum mismatch",
    "truncated": "ended",
    "oversized": "max_bytes",
    "lying_total": "total_bytes",
    "oversized_chunk": "chunk 0 has",
}


@pytest.mark.timeout(120)
def test_hostile_donor_fails_cleanly_and_another_donor_is_used():
    config = tiny_config()

    async def scenario():
        worker = StageWorker(config, 2)
        try:
            await worker.compute(train_block, worker, 3, 2)
            honest_state = await capture_state(worker)
            async with networks(3) as (honest_net, hostile_net, joiner_net):
                honest = Transport(honest_net.p2p, config.swarm_id, 2)
                roomy = AnswerBudget(BudgetLimits(per_identity=100, total=100))  # one joiner, ten downloads
                await serve_state(honest, state_provider(worker, record(honest_net, 2)), CHUNK, budget=roomy)
                hostile = Transport(hostile_net.p2p, config.swarm_id, 2)
                modes: list[str] = []
                served: list[str] = []
                await hostile.serve_sessions("state", hostile_handler(hostile, honest_state, modes, served))
                joiner = Transport(joiner_net.p2p, config.swarm_id, 2)
                # the hostile donor announces a huge throughput, so it is tried first
                candidates = [record(hostile_net, 2, throughput=1e9), record(honest_net, 2, throughput=1e-3)]
                results, shown = {}, {}
                for mode, error in HOSTILE_MODES.items():
                    modes.append(mode)
                    with pytest.raises((ProtocolError, TransportError), match=error):
                        await download_state(joiner, hostile_net.peer_id, 2, "stage", 10.0)
                    with ByteProgress(bar=False) as progress:
                        results[mode] = await download_from_any(
                            joiner, candidates, 2, "stage", random.Random(0), timeout=10.0, progress=progress
                        )
                    shown[mode] = [(task.outcome, task.done, task.total) for task in progress.tasks]
                return served, results, honest_state, shown
        finally:
            worker.close()

    served, results, honest_state, shown = run(scenario())
    # a header the joiner refuses starts no progress; a payload that fails ends its progress as failed,
    # then the honest donor's download counts its own bytes from zero to its total
    _, payload = encode_state(honest_state, StatePart.STAGE, CHUNK)
    honest = (Outcome.DONE, payload.numel(), payload.numel())
    assert shown["oversized"] == shown["lying_total"] == [honest]
    assert shown["bad_checksum"] == [(Outcome.FAILED, payload.numel(), payload.numel()), honest]
    assert shown["oversized_chunk"] == [(Outcome.FAILED, 0, payload.numel()), honest]
    truncated, after = shown["truncated"]
    assert truncated[0] == Outcome.FAILED and 0 < truncated[1] < truncated[2] and after == honest
    # each mode: asked once directly, once (and only once) by download_from_any before the honest donor
    assert served == [mode for mode in HOSTILE_MODES for _ in range(2)]
    for mode, state in results.items():
        assert state.weights.keys() == honest_state.weights.keys(), mode
        for name, value in honest_state.weights.items():
            assert torch.equal(state.weights[name], value), (mode, name)


@pytest.mark.timeout(60)
def test_a_requester_past_its_answer_budget_is_refused_before_any_copy_and_goes_to_another_donor():
    config = tiny_config()

    async def scenario():
        worker = StageWorker(config, 1)
        copies: list[StatePart] = []
        provide = state_provider(worker, PeerRecord(peer_id="donor", stage=1, state="online"))

        async def counting(part: StatePart) -> StageState:
            copies.append(part)
            return await provide(part)

        try:
            async with networks(3) as (stingy_net, other_net, joiner_net):
                stingy = Transport(stingy_net.p2p, config.swarm_id, 1)
                await serve_state(stingy, counting, CHUNK, budget=AnswerBudget(BudgetLimits(per_identity=2)))
                other = Transport(other_net.p2p, config.swarm_id, 1)
                await serve_state(other, provide, CHUNK)
                joiner = Transport(joiner_net.p2p, config.swarm_id, 1)
                for _ in range(2):
                    await download_state(joiner, stingy_net.peer_id, 1, "stage", 10.0)
                with pytest.raises(TransportError, match=r"answer budget spent \(2 per identity per 60 s\)"):
                    await download_state(joiner, stingy_net.peer_id, 1, "weights", 10.0)
                # the edge parts are not counted: stage 1 / S peers refresh them at the swarm's pace
                with pytest.raises(TransportError, match="piece of stage 0"):
                    await download_state(joiner, stingy_net.peer_id, 1, "embed", 10.0)
                # the stingy donor announces a huge throughput, so it is asked first, refuses, and the other serves
                candidates = [record(stingy_net, 1, throughput=1e9), record(other_net, 1, throughput=1e-3)]
                state = await download_from_any(joiner, candidates, 1, "stage", random.Random(0), timeout=10.0)
                return copies, state
        finally:
            worker.close()

    copies, state = run(scenario())
    assert copies == [StatePart.STAGE, StatePart.STAGE, StatePart.EMBED]  # nothing copied for a refusal
    assert state.stage == 1 and state.weights


@pytest.mark.timeout(60)
def test_download_from_any_gives_up_after_its_attempts():
    config = tiny_config()

    async def scenario():
        async with networks(2) as (dead_net, joiner_net):
            joiner = Transport(joiner_net.p2p, config.swarm_id, 1)
            # dead_net serves no "state" protocol at all: every attempt fails to open a stream
            candidates = [record(dead_net, 1), PeerRecord(peer_id=dead_net.peer_id, stage=1, state="joining")]
            with pytest.raises(TransportError, match="could not download"):
                await download_from_any(joiner, candidates, 1, "stage", random.Random(0), attempts=3, timeout=5.0)
            with pytest.raises(TransportError, match="no online donor"):
                await download_from_any(joiner, candidates[1:], 1, "stage", random.Random(0))

    run(scenario())


@pytest.mark.timeout(120)
def test_edge_copies_refresh_from_stage0_and_are_served_back():
    config = tiny_config()  # S = 2: stage 1 keeps the embedding, stage 2 the norm + head
    assert edge_parts_for(1, 3) == ("embed",) and edge_parts_for(2, 3) == ("head",)
    assert edge_parts_for(1, 2) == ("embed", "head") and edge_parts_for(0, 3) == ()

    async def scenario():
        edge = StageWorker(config, 0)
        run_on_edge = edge.compute
        try:
            async with networks(3) as (edge_net, head_net, reader_net):
                edge_me = record(edge_net, 0)
                edge_transport = Transport(edge_net.p2p, config.swarm_id, 0)
                await serve_state(edge_transport, state_provider(edge, edge_me), chunk_bytes=CHUNK)
                holder = Transport(head_net.p2p, config.swarm_id, 2)
                copies = EdgeCopies(stage=2, parts=edge_parts_for(2, 3))
                await serve_state(holder, state_provider(StageWorker(config, 2), record(head_net, 2), copies))
                rng = random.Random(0)

                reader = Transport(reader_net.p2p, config.swarm_id, 0)
                with pytest.raises(TransportError, match="no edge copy"):
                    await download_state(reader, head_net.peer_id, 2, "edge_copy", 10.0)

                assert await refresh_edge_copies(copies, holder, [edge_me], interval=3, rng=rng) == ["head"]
                first = {k: v.clone() for k, v in copies.copies["head"].weights.items()}
                await run_on_edge(train_edge, edge, 2, 5)
                edge_me.inner_step = edge.inner_step
                # 2 steps < interval 3: not due yet
                assert await refresh_edge_copies(copies, holder, [edge_me], interval=3, rng=rng) == []
                await run_on_edge(train_edge, edge, 1, 6)
                edge_me.inner_step = edge.inner_step
                assert await refresh_edge_copies(copies, holder, [edge_me], interval=3, rng=rng) == ["head"]
                served = await download_state(reader, head_net.peer_id, 2, "edge_copy", 10.0)
                current = await run_on_edge(lambda: {k: v.clone() for k, v in edge.module.state_dict().items()})
                return first, copies, served, current
        finally:
            edge.close()

    first, copies, served, current = run(scenario())
    head = copies.copies["head"]
    assert head.inner_step == 3 and set(head.weights) == {"norm.weight", "lm_head.weight"}
    assert not torch.equal(first["lm_head.weight"], head.weights["lm_head.weight"])  # it did refresh
    for name in ("norm.weight", "lm_head.weight"):  # kept and served in bfloat16: half of fp32's bytes
        assert torch.equal(head.weights[name], current[name].to(torch.bfloat16))
        assert torch.equal(served.weights[name], current[name].to(torch.bfloat16))
    assert served.inner_step == 3 and "embed_tokens.weight" not in served.weights


def test_refresh_due_counts_stage0_steps():
    peers = [
        PeerRecord(peer_id="a", stage=0, state="online", inner_step=40),
        PeerRecord(peer_id="b", stage=0, state="joining", inner_step=500),
    ]
    assert refresh_due(None, peers, 50)  # no copy yet: fetch at once
    assert not refresh_due(0, peers, 50)  # the joining peer's step does not count
    assert refresh_due(0, [*peers[:1], PeerRecord(peer_id="c", stage=0, state="online", inner_step=50)], 50)
    assert not refresh_due(None, peers[1:], 50)  # no online stage-0 peer: nothing to fetch from


# ------------------------------------------------------------------------------------------------
# Checkpoints


def test_checkpoint_round_trip_keeps_latest_and_skips_corrupt(tmp_path):
    root = tmp_path / "ckpt" / "swarm"
    assert load_latest(root, 1) is None
    weights = {"a": torch.randn(3, 4), "b": torch.randn(5, dtype=torch.bfloat16)}
    save_checkpoint(root, 1, weights, inner_step=50)
    later = {k: v + 1 for k, v in weights.items()}
    path = save_checkpoint(root, 1, later, inner_step=100)
    loaded, step = load_latest(root, 1)
    assert step == 100 and loaded.keys() == later.keys()
    assert all(torch.equal(loaded[k], later[k]) for k in later)
    assert load_latest(root, 2) is None  # per stage

    # a torn newest file (crash mid-write by something that did not use save_checkpoint) is skipped
    path.write_bytes(path.read_bytes()[:100])
    loaded, step = load_latest(root, 1)
    assert step == 50 and torch.equal(loaded["a"], weights["a"])
    # a file holding something else than a checkpoint is skipped too (torch.load weights_only)
    torch.save({"format": "other"}, stage_dir(root, 1) / f"step{200:010d}{CHECKPOINT_SUFFIX}")
    assert load_latest(root, 1)[1] == 50


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    root = tmp_path / "swarm"
    weights = {"w": torch.ones(4)}
    save_checkpoint(root, 0, weights, inner_step=10)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (f.write(b"partial"), crash()))
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(root, 0, {"w": torch.zeros(4)}, inner_step=20)
    monkeypatch.undo()
    # the failed save left neither a new checkpoint nor a temporary file behind
    assert sorted(p.name for p in stage_dir(root, 0).iterdir()) == [f"step{10:010d}{CHECKPOINT_SUFFIX}"]
    loaded, step = load_latest(root, 0)
    assert step == 10 and torch.equal(loaded["w"], torch.ones(4))


def test_checkpoints_keep_only_the_last_few(tmp_path):
    root = tmp_path / "swarm"
    for step in range(1, 6):
        save_checkpoint(root, 3, {"w": torch.full((2,), float(step))}, inner_step=step * 10, keep=2)
    names = sorted(p.name for p in stage_dir(root, 3).iterdir())
    assert names == [f"step{40:010d}{CHECKPOINT_SUFFIX}", f"step{50:010d}{CHECKPOINT_SUFFIX}"]
    assert os.path.basename(str(stage_dir(root, 3))) == "stage3"


# ------------------------------------------------------------------------------------------------
# Through the stage service: a joiner of a live stage, and the CheckFree+ edge copies it keeps


@pytest.mark.timeout(180)
def test_stage_service_joiner_downloads_before_going_online_and_keeps_edge_copies(monkeypatch):
    import node.recovery.stage_entry as stage_entry
    from dht.announcer import PeerAnnouncer
    from dht.registry import SwarmRegistry
    from node.server.stage_service import ServiceOptions, running_service
    from tests.helpers.inprocess_swarm import inprocess_swarm

    config = tiny_config().replace(heartbeat={"period": 1.0, "ttl": 10.0}, recovery={"checkfree_plus": True})
    states_during_join = []
    original_join = stage_entry.join_live_stage

    progress_during_join: list[ByteProgress] = []

    async def observed_join(service, progress: ByteProgress | None = None):
        states_during_join.append(service.me.state)
        if progress is not None:
            progress_during_join.append(progress)
        return await original_join(service, progress=progress)

    monkeypatch.setattr(stage_entry, "join_live_stage", observed_join)
    source = torch.Generator().manual_seed(5)

    async def scenario():
        async with inprocess_swarm(config, stages=[0, 1, 2]) as peers:
            for _ in range(3):
                tokens = torch.randint(0, config.model.vocab_size, (4, 16), generator=source)
                assert await peers[0].service.pipeline.run_microbatch(tokens, tokens) is not None
            assert states_during_join == []  # nobody joined a live stage so far
            network = await start_network(host="127.0.0.1", initial_peers=await peers[0].network.visible_maddrs())
            try:
                me = PeerAnnouncer(
                    SwarmRegistry(network.dht, config.swarm_id), PeerRecord(peer_id=network.peer_id, stage=1), 1.0, 10.0
                )
                await me.announce_now()
                async with running_service(network, config, me, ServiceOptions(device="cpu")) as joined:
                    donor = peers[1].service.worker
                    theirs = await donor.compute(donor.state_dict)
                    mine = await joined.worker.compute(joined.worker.state_dict)
                    steps = (joined.worker.inner_step, donor.inner_step, me.state)
                    # stage 1 keeps a copy of stage 0's embedding (CheckFree+), served as "edge_copy"
                    edge = peers[0].service.worker
                    embed = await edge.compute(edge.state_dict)
                    copy_state = None
                    for _ in range(40):
                        try:
                            copy_state = await download_state(
                                joined.transport, peers[1].network.peer_id, 1, "edge_copy", 10.0
                            )
                            break
                        except TransportError:
                            await asyncio.sleep(0.5)
                    return theirs, mine, steps, embed, copy_state
            finally:
                await network.shutdown()

    theirs, mine, steps, embed, copy_state = run(scenario(), timeout=170)
    assert states_during_join == ["joining"]
    # the join's download showed its bytes (log lines here: no terminal), all of them
    ((shown,),) = [progress.tasks for progress in progress_during_join]
    assert not progress_during_join[0].show_bar
    assert shown.outcome == Outcome.DONE and shown.done == shown.total > 0
    assert steps == (3, 3, "online")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert copy_state is not None and set(copy_state.weights) == {"embed_tokens.weight"}
    # taken when stage 1 came online, before any training step; not due again for 50 stage-0 steps
    from node.model.llama import build_stage

    assert copy_state.inner_step == 0
    initial = (
        build_stage(config.model, 0, config.seed).embed_tokens.weight.detach().to(torch.bfloat16)
    )  # copies are kept in bfloat16
    assert torch.equal(copy_state.weights["embed_tokens.weight"], initial)
    assert not torch.equal(copy_state.weights["embed_tokens.weight"], embed["embed_tokens.weight"].to(torch.bfloat16))

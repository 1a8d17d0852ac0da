"""Validation loss: forward-only evaluation microbatches, the held-out data, the periodic validator,
the record fields that publish it, and where `node status` and the dashboard show it."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch

from dht.records import PeerRecord, PeerState, RecordError
from node.config import SwarmConfig
from node.model.corpus import prepare_corpus
from node.model.data import VALIDATION_STREAM, DataError, open_heldout, open_source, stream_id_from_peer
from node.model.llama import ReferenceModel
from node.monitor.dashboard import DashboardState, render_once
from node.monitor.status import format_table
from node.pipeline.validation import ValidationResult, Validator, heldout_batches, open_validator
from node.stage.admission import RejectedInput
from node.stage.forward_only import eval_embed, eval_forward, eval_loss
from node.stage.stage_worker import StageWorker
from protocol import (
    PURPOSE_KEY,
    Message,
    MessageKind,
    MicrobatchPurpose,
    ProtocolError,
    decode_message,
    encode_message,
    purpose_of,
)

CFG = SwarmConfig()


# ---- forward-only compute ---------------------------------------------------------------------


def test_eval_chain_equals_the_reference_loss_and_changes_no_worker_state():
    workers = [StageWorker(CFG, stage) for stage in range(CFG.num_stages)]
    try:
        tokens, targets = open_source(CFG, None, 5).next_batch(4, 32)
        before = [{k: v.clone() for k, v in w.module.state_dict().items()} for w in workers]
        hidden = eval_embed(workers[0], tokens)
        for worker in workers[1:]:
            hidden = eval_forward(worker, hidden)
        loss = eval_loss(workers[0], hidden, targets)
        with torch.no_grad():
            expected = float(ReferenceModel(CFG.model, CFG.num_stages, CFG.seed)(tokens, targets))
        assert loss == pytest.approx(expected, abs=1e-5)
        assert math.log(CFG.model.vocab_size) - 0.2 < loss < math.log(CFG.model.vocab_size) + 0.2  # at init
        for worker, weights in zip(workers, before):
            assert worker.num_stored == 0 and worker.microbatches_done == 0 and worker.inner_step == 0
            assert all(p.grad is None for p in worker.module.parameters())
            assert all(torch.equal(weights[k], v) for k, v in worker.module.state_dict().items())
    finally:
        for worker in workers:
            worker.close()


def test_eval_inputs_from_the_wire_are_checked_like_training_ones():
    edge, block = StageWorker(CFG, 0), StageWorker(CFG, 1)
    try:
        tokens, targets = open_source(CFG, None, 5).next_batch(2, 16)
        hidden = eval_embed(edge, tokens)
        with pytest.raises(RejectedInput, match="finite"):
            eval_forward(block, torch.full_like(hidden, math.nan))
        with pytest.raises(RejectedInput):
            eval_forward(block, hidden[..., :-1])  # wrong hidden size
        with pytest.raises(RejectedInput, match="shape"):
            eval_loss(edge, hidden[:, :-1], targets)  # a hop returned fewer positions than were sent
        with pytest.raises(RejectedInput):
            eval_embed(edge, torch.full_like(tokens, CFG.model.vocab_size))  # ids out of range
        with pytest.raises(ValueError, match="cannot run"):
            eval_forward(edge, hidden)  # stage 0 holds no blocks
    finally:
        edge.close()
        block.close()


def test_the_purpose_travels_in_forward_meta_and_unknown_ones_are_refused():
    meta = {"microbatch_id": 1, "origin": "o", "path": ["o"], "order": [1, 2], "hop": 1}
    assert purpose_of(meta) is MicrobatchPurpose.TRAIN  # what every older peer sends
    message = Message(MessageKind.FORWARD, "s", 0, 1, {**meta, PURPOSE_KEY: "eval"}, {"hidden": torch.zeros(1, 2, 4)})
    assert purpose_of(decode_message(encode_message(message)).meta) is MicrobatchPurpose.EVAL
    for bad in ("EVAL", "backward", 3, None, ["eval"]):
        with pytest.raises(ProtocolError, match="purpose"):
            purpose_of({**meta, PURPOSE_KEY: bad})


# ---- held-out data ------------------------------------------------------------------------------


def test_the_embedded_chain_validates_on_a_stream_no_peer_trains_on():
    heldout = open_heldout(CFG, None)
    assert VALIDATION_STREAM > max(stream_id_from_peer(f"peer{i}") for i in range(100))
    assert heldout.loss_floor == open_source(CFG, None, 3).loss_floor  # the same chain, so the same floor
    first = heldout_batches(CFG.training, CFG.validation, heldout)
    assert len(first) == CFG.validation.batches
    assert all(x.shape == (8, 64) and torch.equal(x[:, 1:], y[:, :-1]) for x, y in first)
    again = heldout_batches(
        CFG.training, CFG.validation, open_heldout(CFG, None)
    )  # every stage-0 peer draws the same batches
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    trained = open_source(CFG, None, stream_id_from_peer("peer0")).next_batch(8, 64)
    assert not torch.equal(first[0][0], trained[0])


def test_a_prepared_directory_validates_on_its_val_bin(tmp_path):
    lines = [f"line {i} of a small corpus about swarms and stages\n" for i in range(400)]
    (tmp_path / "a.txt").write_text("".join(lines))
    out = tmp_path / "prepared"
    prepared = prepare_corpus([tmp_path / "a.txt"], out, vocab_size=300, val_fraction=0.2, progress=False)
    config = CFG.replace(model={"vocab_size": prepared.vocab_size}, data={"tokenizer_hash": prepared.tokenizer_hash})
    val = np.fromfile(out / "val.bin", dtype=prepared.dtype.numpy).astype(np.int64)
    train = np.fromfile(out / "train.bin", dtype=prepared.dtype.numpy).astype(np.int64)
    windows = {tuple(val[i : i + 65]) for i in range(len(val) - 64)}
    for x, y in heldout_batches(config.training, config.validation, open_heldout(config, str(out))):
        for row_x, row_y in zip(x.tolist(), y.tolist()):
            assert tuple([*row_x, row_y[-1]]) in windows  # every window lies inside val.bin
    assert len(val) > 64 and len(train) > len(val)

    no_val = tmp_path / "no-val"
    short = prepare_corpus([tmp_path / "a.txt"], no_val, vocab_size=300, val_fraction=0.0, progress=False)
    assert short.tokenizer_hash == prepared.tokenizer_hash  # same train text, same tokenizer
    with pytest.raises(DataError, match="val-fraction"):
        open_heldout(config, str(no_val))


def test_a_plain_file_has_no_held_out_part_and_validation_is_skipped(tmp_path):
    (tmp_path / "t.txt").write_text("plain text " * 200)
    with pytest.raises(DataError, match="no held-out part"):
        open_heldout(CFG, str(tmp_path / "t.txt"))
    assert open_validator(CFG, str(tmp_path / "t.txt"), _never, lambda: 0) is None  # training goes on
    off = CFG.replace(validation={"interval": 0.0})
    assert open_validator(off, None, _never, lambda: 0) is None
    assert isinstance(open_validator(CFG, None, _never, lambda: 0), Validator)


async def _never(tokens: torch.Tensor, targets: torch.Tensor) -> float | None:
    raise AssertionError("not called")


# ---- the periodic validator ----------------------------------------------------------------------


def test_a_validation_is_the_mean_over_every_batch_or_nothing():
    batches = [(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long)) for _ in range(3)]
    answers = iter([2.0, 3.0, 4.0, 1.0, None, 9.0])
    step = iter([10, 20])

    async def evaluate(tokens, targets):
        return next(answers)

    async def main():
        validator = Validator(5.0, batches, evaluate, lambda: next(step))
        assert await validator.validate_once() == ValidationResult(3.0, 10)
        assert await validator.validate_once() is None  # the second batch was dropped
        assert validator.latest == ValidationResult(3.0, 10) and validator.failed == 1

    asyncio.run(main())


def test_the_validator_waits_for_a_served_pipeline_then_repeats_until_stopped():
    batch = (torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))
    calls: list[float] = []
    ready = {"now": False}

    async def evaluate(tokens, targets):
        calls.append(asyncio.get_running_loop().time())
        return 1.5

    async def main():
        stop = asyncio.Event()
        validator = Validator(0.05, [batch], evaluate, lambda: 7)
        task = asyncio.create_task(validator.run(stop, lambda: ready["now"]))
        await asyncio.sleep(0.2)
        assert calls == [] and validator.latest is None  # a stage without a peer: nothing sent
        ready["now"] = True
        await asyncio.sleep(1.3)  # the not-ready poll is 1 s, then every 0.05 s
        stop.set()
        await asyncio.wait_for(task, 1.0)
        assert 3 <= len(calls) <= 20 and validator.latest == ValidationResult(1.5, 7)

    asyncio.run(main())
    with pytest.raises(ValueError):
        Validator(0.0, [batch], evaluate, lambda: 0)


# ---- records, status, dashboard -----------------------------------------------------------------


def test_records_carry_the_validation_loss_and_refuse_what_no_loss_can_be():
    record = PeerRecord("peer", 0, PeerState.ONLINE, val_loss=2.5, val_step=40)
    wire = record.to_wire()
    assert PeerRecord.from_wire(wire) == record
    assert PeerRecord.from_wire({k: v for k, v in wire.items() if k not in ("val_loss", "val_step")}).val_loss is None
    for field, bad in (
        ("val_loss", -0.1),
        ("val_loss", math.nan),
        ("val_loss", math.inf),
        ("val_loss", "2.5"),
        ("val_loss", True),
        ("val_step", -1),
        ("val_step", 1.5),
        ("val_step", False),
        ("val_step", 2**70),
    ):
        with pytest.raises(RecordError, match=field):
            PeerRecord.from_wire({**wire, field: bad})


def _snapshot(val_loss: float | None) -> dict:
    peer = {
        **PeerRecord("12D3KooWstage0peer", 0, PeerState.ONLINE, loss=3.25, val_loss=val_loss, val_step=120).to_wire(),
        "expires": 0.0,
    }
    return {
        "time": 0.0,
        "swarm_id": "s",
        "num_stages": 2,
        "config_hash": "abcdef0123456789",
        "model_parameters": 1000,
        "stages": [
            {
                "stage": 0,
                "status": "single",
                "throughput": 1.0,
                "parameters": 1,
                "memory": {"total": 1},
                "peers": [peer],
            },
            {"stage": 1, "status": "empty", "throughput": 0.0, "parameters": 1, "memory": {"total": 1}, "peers": []},
        ],
        "events": [],
    }


def test_status_and_dashboard_show_the_validation_loss_beside_the_training_loss():
    assert "loss 3.250   val 2.875 @120" in format_table(_snapshot(2.875))
    assert "val" not in format_table(_snapshot(None)).split("loss 3.250")[1]
    frame = render_once(_snapshot(2.875), 110)
    assert "held-out 2.875" in frame and "3.250" in frame
    assert [line for line in frame.splitlines() if "val" in line.split() and "loss" in line.split()], frame
    assert "held-out -" in render_once(_snapshot(None), 110)
    state = DashboardState()
    state.update({**_snapshot(2.875), "stages": [{"stage": 0, "peers": [{"stage": 0, "val_loss": "nan?"}]}]})
    assert "held-out -" in render_once(state.snapshot, 110)  # a value of the wrong type is not shown

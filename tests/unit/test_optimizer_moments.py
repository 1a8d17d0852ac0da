"""A joiner takes its donor's AdamW moments with the stage's state (node/stage/inner_optimizer.py
`adam_moments` / `load_adam_moments`, protocol/stage_state.py's "moments." section).

Without them a joiner's first steps moved each weight by about lr where its stage mates moved by a
few hundredths of lr, and its first outer Delta was refused by their plausibility check (docs/recovery.md,
"State transfer"). Here a donor trains on noise-dominated gradients (as a real stage's are), a
joiner adopts its state through the wire codec, and both take the same steps.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from dht.records import PeerRecord, PeerState
from node.model.presets import load_config
from node.recovery.state_transfer import adopt_state, capture_state, state_provider
from node.stage.inner_optimizer import adam_moments, load_adam_moments
from node.stage.stage_worker import StageWorker
from protocol import ProtocolError
from protocol.stage_state import MOMENTS_DTYPE, StageState, StatePart, check_header, decode_payload, encode_state

CONFIG = load_config(None, **{"training.microbatches_per_step": 1, "training.warmup_steps": 5})
STAGE = 1
HIDDEN = CONFIG.model.hidden_size


def train(worker: StageWorker, steps: int, seed: int) -> None:
    """`steps` optimizer steps whose gradients are mostly noise around a small mean, as a stage's are."""
    gen = torch.Generator().manual_seed(seed)
    for i in range(steps):
        x = torch.randn(2, 8, HIDDEN, generator=gen)
        worker.forward((seed, i), x)
        worker.backward((seed, i), 0.05 + torch.randn(2, 8, HIDDEN, generator=gen))


def weights(worker: StageWorker) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in worker.module.parameters()])


def through_the_wire(state: StageState) -> StageState:
    meta, payload = encode_state(state, StatePart.STAGE)
    expect = {name: tuple(t.shape) for name, t in state.weights.items()}
    return decode_payload(payload, check_header(meta, STAGE, StatePart.STAGE, 1 << 32, expect), meta)


def test_a_joiner_with_its_donors_moments_steps_like_its_donor_and_a_fresh_optimizer_does_not():
    donor, joiner, fresh = (StageWorker(CONFIG, STAGE) for _ in range(3))
    try:
        train(donor, 40, seed=1)
        state = asyncio.run(capture_state(donor))
        assert state.optimizer_steps == 40 and len(state.moments) == 2 * len(state.weights)
        assert all(t.dtype == MOMENTS_DTYPE and t.device.type == "cpu" for t in state.moments.values())
        received = through_the_wire(state)
        asyncio.run(adopt_state(joiner, received))
        asyncio.run(adopt_state(fresh, StageState(STAGE, received.weights, inner_step=received.inner_step)))
        assert torch.equal(weights(joiner), weights(donor)) and torch.equal(weights(fresh), weights(donor))

        moved = {}
        for name, worker in (("donor", donor), ("joiner", joiner), ("fresh", fresh)):
            before = weights(worker)
            train(worker, 4, seed=2)  # the same four steps for each
            moved[name] = float((weights(worker) - before).norm())
        print(f"moved over 4 steps: {moved}")
        assert moved["joiner"] == pytest.approx(moved["donor"], rel=0.05)  # bf16 moments: a few bits off
        # what a joiner without them did: 2.5x here, 12-17x in the 15m gpu-check
        assert moved["fresh"] > 2 * moved["donor"]
    finally:
        for worker in (donor, joiner, fresh):
            worker.close()


def trained_moments() -> tuple[StageWorker, dict[str, torch.Tensor], int]:
    worker = StageWorker(CONFIG, STAGE)
    train(worker, 2, seed=3)
    moments, steps = adam_moments(worker.optimizer, worker.module.named_parameters(), torch.float32)
    worker.reset_optimizer()
    return worker, moments, steps


def first(moments: dict[str, torch.Tensor], kind: str) -> str:
    return next(name for name in moments if name.startswith(kind + "."))


@pytest.mark.parametrize(
    "spoil, refusal",
    [
        (lambda m, s: ({**m, "exp_avg.no.such.weight": next(iter(m.values()))}, s), "names no weight"),
        (lambda m, s: ({**m, first(m, "exp_avg"): torch.zeros(3)}, s), "another shape"),
        (lambda m, s: ({k: v for k, v in m.items() if k != first(m, "exp_avg_sq")}, s), "one of its two moments"),
        (lambda m, s: ({**m, first(m, "exp_avg"): torch.full_like(m[first(m, "exp_avg")], float("nan"))}, s), "NaN"),
        (lambda m, s: ({**m, first(m, "exp_avg_sq"): -m[first(m, "exp_avg_sq")] - 1}, s), "negative"),
        (lambda m, s: (m, 0), "step count"),
    ],
    ids=["unknown-weight", "wrong-shape", "one-moment-only", "nan", "negative-second-moment", "no-steps"],
)
def test_moments_that_could_not_come_from_an_adamw_are_refused_and_nothing_is_loaded(spoil, refusal):
    worker, moments, steps = trained_moments()
    try:
        bad, bad_steps = spoil(moments, steps)
        with pytest.raises(ValueError, match=refusal):
            load_adam_moments(worker.optimizer, worker.module.named_parameters(), bad, bad_steps, worker.transfers)
        assert not worker.optimizer.state  # untouched: fresh, as before
        load_adam_moments(worker.optimizer, worker.module.named_parameters(), moments, steps, worker.transfers)
        assert len(worker.optimizer.state) == len(list(worker.module.parameters()))
    finally:
        worker.close()


def test_a_state_header_refuses_moments_out_of_place_or_shape_before_allocating():
    weight = torch.zeros(4, 3)
    state = StageState(
        STAGE,
        {"w": weight},
        outer={"phi.w": weight},
        moments={"exp_avg.w": weight, "exp_avg_sq.w": weight},
        optimizer_steps=3,
    )
    meta, _ = encode_state(state, StatePart.STAGE)
    assert meta["names"] == ["w", "outer.phi.w", "moments.exp_avg.w", "moments.exp_avg_sq.w"]
    check_header(meta, STAGE, StatePart.STAGE, 1 << 20, {"w": (4, 3)})

    def refused(match: str, **changes: object) -> None:
        with pytest.raises(ProtocolError, match=match):
            check_header({**meta, **changes}, STAGE, StatePart.STAGE, 1 << 20, {"w": (4, 3)})

    moved_first = [meta["names"][i] for i in (0, 2, 1, 3)]
    refused("after the weights come", names=moved_first)
    refused("after the weights come", names=[*meta["names"][:3], "moments.exp_avg_sq.v"])
    refused("after the weights come", names=[*meta["names"][:3], "moments.variance.w"])
    refused("after the weights come", shapes=[*meta["shapes"][:3], [3, 4]])
    refused("without a step count", optimizer_steps=0)
    refused("optimizer_steps must be", optimizer_steps=None)


def test_a_joiner_gets_the_moments_and_a_rebuild_or_an_export_only_the_weights():
    worker = StageWorker(CONFIG, STAGE)
    try:
        train(worker, 3, seed=4)
        provide = state_provider(worker, PeerRecord(peer_id="donor", stage=STAGE, state=PeerState.ONLINE))
        whole, weights_only = asyncio.run(provide(StatePart.STAGE)), asyncio.run(provide(StatePart.WEIGHTS))
        assert whole.optimizer_steps == 3 and set(whole.moments) == {
            f"{kind}.{name}" for kind in ("exp_avg", "exp_avg_sq") for name in whole.weights
        }
        assert weights_only.moments == {} and weights_only.optimizer_steps == 0
        assert weights_only.weights.keys() == whole.weights.keys() and weights_only.inner_step == whole.inner_step
    finally:
        worker.close()

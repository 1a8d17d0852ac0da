"""node/recovery/checkfree.py: CheckFree averaging, CheckFree+ order, rebuild planning and execution."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.config import RecoveryStrategy
from node.recovery.checkfree import (
    UNKNOWN_GRAD_NORM,
    RebuildAction,
    SourceFetch,
    UnrecoverableError,
    checkfree_average,
    checkfree_weights,
    execute_rebuild,
    known_grad_norm,
    pipeline_order,
    plan_rebuild,
    recovered_lr_scale,
    unrecoverable,
    zeroed_state,
)


def block_state(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {
        "layers.0.attn.weight": torch.randn(4, 4, generator=g).to(dtype),
        "layers.0.norm.weight": torch.randn(4, generator=g).to(dtype),
        "layers.0.steps": torch.tensor(seed, dtype=torch.long),
        "layers.0.mask": torch.tensor([True, seed % 2 == 0]),
    }


# ------------------------------------------------------------------ averaging


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    norm_prev=st.floats(0, 10, allow_nan=False),
    norm_next=st.floats(0, 10, allow_nan=False),
)
def test_average_matches_formula(seed, norm_prev, norm_next):
    prev, nxt = block_state(seed), block_state(seed + 1)
    snapshot = {k: v.clone() for k, v in prev.items()}
    out = checkfree_average(prev, nxt, norm_prev, norm_next)
    a, b = norm_next + 1e-4, norm_prev + 1e-4
    assert checkfree_weights(norm_prev, norm_next) == pytest.approx((a, b))
    for key in ("layers.0.attn.weight", "layers.0.norm.weight"):
        torch.testing.assert_close(out[key], (a * nxt[key] + b * prev[key]) / (a + b))
    # integer / bool buffers come from the next neighbour
    assert torch.equal(out["layers.0.steps"], nxt["layers.0.steps"])
    assert torch.equal(out["layers.0.mask"], nxt["layers.0.mask"])
    assert all(torch.equal(prev[k], snapshot[k]) for k in prev)
    assert all(out[k].data_ptr() != nxt[k].data_ptr() for k in out)


def test_larger_gradient_norm_gets_larger_weight():
    prev = {"w": torch.zeros(3)}
    nxt = {"w": torch.ones(3)}
    leaning_next = checkfree_average(prev, nxt, grad_norm_prev=0.1, grad_norm_next=0.9)["w"]
    leaning_prev = checkfree_average(prev, nxt, grad_norm_prev=0.9, grad_norm_next=0.1)["w"]
    assert float(leaning_next[0]) == pytest.approx((0.9 + 1e-4) / (1.0 + 2e-4))
    assert float(leaning_next[0]) > 0.5 > float(leaning_prev[0])
    # both norms zero: the epsilon makes it the plain mean
    assert float(checkfree_average(prev, nxt, 0.0, 0.0)["w"][0]) == pytest.approx(0.5)


def test_average_keeps_dtype_and_rejects_mismatches():
    prev, nxt = block_state(1, torch.bfloat16), block_state(2, torch.bfloat16)
    out = checkfree_average(prev, nxt, 0.3, 0.6)
    assert out["layers.0.attn.weight"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="keys only in"):
        checkfree_average({k: v for k, v in prev.items() if k != "layers.0.steps"}, nxt, 0.3, 0.6)
    with pytest.raises(ValueError, match="shape"):
        checkfree_average({**prev, "layers.0.norm.weight": torch.zeros(5)}, nxt, 0.3, 0.6)
    with pytest.raises(ValueError, match="finite"):
        checkfree_weights(float("nan"), 1.0)


# ------------------------------------------------------------------ CheckFree+ order

EXPECTED_ODD = {
    1: [[1]],
    2: [[2, 1]],
    3: [[2, 1, 3], [1, 3, 2]],
    4: [[2, 1, 4, 3]],
    5: [[2, 1, 3, 5, 4]],
    6: [[2, 1, 3, 4, 6, 5]],
}


@pytest.mark.parametrize("S", range(1, 7))
def test_pipeline_order(S):
    normal = list(range(1, S + 1))
    odd_orders = []
    for mb in range(8):
        for plus in (False, True):
            assert pipeline_order(S + 1, mb, plus, training=False) == normal  # evaluation: always normal
        assert pipeline_order(S + 1, mb, False) == normal
        order = pipeline_order(S + 1, mb, True)
        assert sorted(order) == normal  # a permutation of the block stages
        if mb % 2 == 0:
            assert order == normal
        else:
            odd_orders.append(order)
    assert sorted(map(tuple, set(map(tuple, odd_orders)))) == sorted(map(tuple, EXPECTED_ODD[S]))
    if S >= 2:
        # the property recovery relies on: stage 2 sometimes plays stage 1's role and stage S-1
        # sometimes plays stage S's role
        assert any(o[0] == 2 for o in odd_orders)
        assert any(o[-1] == S - 1 for o in odd_orders)
    if S == 3:
        assert pipeline_order(4, 1, True) == [2, 1, 3] and pipeline_order(4, 3, True) == [1, 3, 2]


def test_pipeline_order_rejects_bad_arguments():
    with pytest.raises(ValueError):
        pipeline_order(1, 0, True)
    with pytest.raises(ValueError):
        pipeline_order(4, -1, True)


# ------------------------------------------------------------------ planning

S5 = 6  # num_stages = 6: stage 0 + block stages 1..5


@pytest.mark.parametrize("plus", [False, True])
def test_plan_checkfree(plus):
    plans = {i: plan_rebuild(i, S5, "checkfree", plus) for i in range(S5)}
    for i in (2, 3, 4):
        p = plans[i]
        assert (p.action, p.sources, p.fetch, p.scale_lr, p.fresh_optimizer) == (
            "average",
            (i - 1, i + 1),
            "weights",
            True,
            True,
        )
    if plus:
        assert (plans[1].action, plans[1].sources) == ("copy", (2,))
        assert (plans[5].action, plans[5].sources) == ("copy", (4,))
        assert (plans[0].action, plans[0].sources, plans[0].fetch) == ("edge_copies", (1, 5), "edge_copy")
    else:
        for i in (0, 1, 5):
            assert not plans[i].recoverable and plans[i].reason
    # small swarms
    assert plan_rebuild(0, 2, "checkfree", True).sources == (1,)
    assert not plan_rebuild(1, 2, "checkfree", True).recoverable
    assert plan_rebuild(1, 3, "checkfree", True).sources == (2,)
    assert plan_rebuild(2, 3, "checkfree", True).sources == (1,)
    assert plan_rebuild(2, 4, "checkfree", True).action == "average"


def test_plan_copy_random_checkpoint():
    for plus in (False, True):
        for i in range(1, S5):
            p = plan_rebuild(i, S5, "copy", plus)
            assert (p.action, p.sources) == ("copy", (i + 1,) if i < 5 else (4,))
        assert plan_rebuild(0, S5, "copy", plus).recoverable is plus
        for i in range(S5):
            assert plan_rebuild(i, S5, "random", plus).action == "fresh"
            assert plan_rebuild(i, S5, "checkpoint", plus).action == "checkpoint"
            assert not plan_rebuild(i, S5, "random", plus).scale_lr
    assert not plan_rebuild(1, 2, "copy", True).recoverable
    with pytest.raises(ValueError):
        plan_rebuild(6, S5, "checkfree", True)
    with pytest.raises(ValueError):
        plan_rebuild(1, S5, "average", True)


def test_unrecoverable_cases():
    ok = lambda lost, strategy="checkfree", plus=True, n=S5: unrecoverable(set(lost), n, strategy, plus) is None  # noqa: E731
    assert ok([]) and ok([3]) and ok([2, 4]) and ok([1, 3, 5]) and ok([0, 3]) and ok([1]) and ok([5])
    assert not ok([3, 4])  # two adjacent middle stages
    assert not ok([1, 2]) and not ok([4, 5])  # an edge block stage and the stage it copies
    assert not ok([0, 1]) and not ok([0, 5])  # stage 0 and a holder of its copies
    assert not ok([0], plus=False) and not ok([1], plus=False) and not ok([5], plus=False)
    assert ok([2, 4], plus=False)
    assert not ok([1], n=2) and ok([0], n=2) and not ok([0, 1], n=2)
    assert ok([1, 3], n=4) and not ok([1, 2], n=4)  # S = 3: stages 1 and 3 both copy stage 2
    assert (
        unrecoverable({3, 4}, S5, "checkfree", True)
        == "stage 3: it is rebuilt from stage(s) [4], lost at the same time"
    )
    assert "copies are held by stage(s) [1]" in unrecoverable({0, 1}, S5, "checkfree", True)
    # copy: i copies i+1, so {i, i+1} fails but {i-1, i+1} works
    assert not ok([2, 3], "copy") and ok([2, 4], "copy") and not ok([0], "copy", plus=False)
    # random and checkpoint always rebuild, except random with nothing left at all
    assert ok([0, 1, 2], "random") and ok(range(S5), "checkpoint") and not ok(range(S5), "random")
    with pytest.raises(ValueError):
        unrecoverable({7}, S5, "checkfree", True)


# ------------------------------------------------------------------ execution


def edge_template():
    return {"embed_tokens.weight": torch.zeros(8, 4), "norm.weight": torch.ones(4), "lm_head.weight": torch.zeros(8, 4)}


def test_execute_checkfree_average_and_copy():
    states = {i: block_state(i) for i in range(1, 6)}
    fetched = {i: (states[i], 0.1 * i) for i in (2, 4)}
    out = execute_rebuild(plan_rebuild(3, S5, "checkfree", True), fetched, lambda: block_state(99), None)
    expected = checkfree_average(states[2], states[4], 0.2, 0.4)
    assert all(torch.equal(out[k], expected[k]) for k in expected)

    out = execute_rebuild(plan_rebuild(1, S5, "checkfree", True), {2: (states[2], 0.5)}, None, None)
    assert all(torch.equal(out[k], states[2][k]) and out[k].data_ptr() != states[2][k].data_ptr() for k in out)
    out = execute_rebuild(plan_rebuild(3, S5, "copy", False), {4: (states[4], 0.5)}, None, None)
    assert all(torch.equal(out[k], states[4][k]) for k in out)

    with pytest.raises(ValueError, match="needs stage 4"):
        execute_rebuild(plan_rebuild(3, S5, "checkfree", True), {2: fetched[2]}, None, None)
    with pytest.raises(UnrecoverableError):
        execute_rebuild(plan_rebuild(1, S5, "checkfree", False), {2: fetched[2]}, None, None)
    # a neighbour serving the wrong module or NaN weights is caught
    with pytest.raises(ValueError, match="missing"):
        execute_rebuild(
            plan_rebuild(1, S5, "copy", True), {2: ({"x": torch.zeros(1)}, 0.1)}, lambda: block_state(0), None
        )
    poisoned = {**states[4], "layers.0.norm.weight": torch.full((4,), float("nan"))}
    with pytest.raises(ValueError, match="NaN"):
        execute_rebuild(plan_rebuild(3, S5, "copy", True), {4: (poisoned, 0.1)}, None, None)


def test_execute_edge_copies():
    full = {k: torch.randn(v.shape) for k, v in edge_template().items()}
    from_stage1 = {"embed_tokens.weight": full["embed_tokens.weight"]}
    from_stage5 = {"norm.weight": full["norm.weight"], "lm_head.weight": full["lm_head.weight"]}
    plan = plan_rebuild(0, S5, "checkfree", True)
    out = execute_rebuild(plan, {1: (from_stage1, 0.0), 5: (from_stage5, 0.0)}, edge_template, None)
    assert all(torch.equal(out[k], full[k]) for k in full)
    with pytest.raises(ValueError, match="missing"):
        execute_rebuild(plan, {1: (from_stage1, 0.0), 5: ({}, 0.0)}, edge_template, None)
    # S = 1: the single block stage keeps the whole copy
    out = execute_rebuild(plan_rebuild(0, 2, "copy", True), {1: (full, 0.0)}, edge_template, None)
    assert all(torch.equal(out[k], full[k]) for k in full)


def test_execute_random_and_checkpoint():
    fresh = block_state(42)
    out = execute_rebuild(plan_rebuild(2, S5, "random", True), {}, lambda: fresh, None)
    assert all(torch.equal(out[k], fresh[k]) for k in fresh)
    with pytest.raises(ValueError, match="fresh_state"):
        execute_rebuild(plan_rebuild(2, S5, "random", True), {}, None, None)
    saved = block_state(7)
    out = execute_rebuild(plan_rebuild(0, S5, "checkpoint", False), {}, None, saved)
    assert all(torch.equal(out[k], saved[k]) and out[k].data_ptr() != saved[k].data_ptr() for k in saved)
    with pytest.raises(ValueError, match="checkpoint"):
        execute_rebuild(plan_rebuild(0, S5, "checkpoint", False), {}, None, None)


def test_recovered_lr_scale():
    assert recovered_lr_scale(1.1) == 1.1
    assert recovered_lr_scale(1.2, plan_rebuild(3, S5, "checkfree", True)) == 1.2
    assert recovered_lr_scale(1.2, plan_rebuild(3, S5, "random", True)) == 1.0
    with pytest.raises(ValueError):
        recovered_lr_scale(0.0)
    assert set(RecoveryStrategy) == {"checkfree", "copy", "random", "zero", "checkpoint"}


def test_plans_carry_enums_whose_values_are_the_plain_strings():
    plan = plan_rebuild(3, S5, "checkfree", True)  # a plain string strategy is accepted (TOML, tests)
    assert plan.strategy is RecoveryStrategy.CHECKFREE
    assert plan.action is RebuildAction.AVERAGE and plan.fetch is SourceFetch.WEIGHTS
    assert plan_rebuild(0, S5, RecoveryStrategy.COPY, True).fetch is SourceFetch.EDGE_COPY
    assert plan_rebuild(2, S5, RecoveryStrategy.RANDOM, True).fetch is SourceFetch.NONE
    # what debug dumps and events carry: plain strings
    assert type(plan.action.value) is str and plan.action.value == "average"
    with pytest.raises(ValueError, match="expected one of checkfree, copy, random, zero, checkpoint"):
        unrecoverable({1}, S5, "average", True)


# ------------------------------------------------------------------ the authors' conventions


def test_an_unknown_gradient_norm_counts_as_one_as_the_authors_start_it():
    assert UNKNOWN_GRAD_NORM == 1.0
    assert known_grad_norm(None) == 1.0
    assert known_grad_norm(0.25) == 0.25 and known_grad_norm(0.0) == 0.0
    # a neighbour that has not stepped weighs as much as one at the clip limit, not 1e-4
    prev, nxt = {"w": torch.zeros(3)}, {"w": torch.ones(3)}
    out = checkfree_average(prev, nxt, known_grad_norm(None), known_grad_norm(1.0))["w"]
    assert torch.allclose(out, torch.full((3,), 0.5))
    out = checkfree_average(prev, nxt, known_grad_norm(None), known_grad_norm(0.5))["w"]
    assert float(out[0]) == pytest.approx((0.5 + 1e-4) / (1.5 + 2e-4))


def test_plan_zero_zeroes_block_stages_and_reinitialises_stage_0():
    for plus in (False, True):
        for i in range(1, S5):
            plan = plan_rebuild(i, S5, "zero", plus)
            assert plan.action is RebuildAction.ZERO and plan.fetch is SourceFetch.NONE and plan.sources == ()
            assert not plan.scale_lr and recovered_lr_scale(1.1, plan) == 1.0
        # zeroed embedding and head would give zero logits and zero gradients everywhere
        assert plan_rebuild(0, S5, "zero", plus).action is RebuildAction.FRESH
    assert plan_rebuild(1, 2, "zero", True).recoverable  # S = 1: no neighbour needed
    ok = lambda lost: unrecoverable(set(lost), S5, RecoveryStrategy.ZERO, False) is None  # noqa: E731
    assert ok([1, 2]) and ok([0, 1, 5]) and not ok(range(S5))


def test_execute_zero_zeroes_every_float_entry_and_keeps_the_rest():
    template = block_state(3)
    snapshot = {k: v.clone() for k, v in template.items()}
    out = execute_rebuild(plan_rebuild(2, S5, "zero", True), {}, lambda: template, None)
    assert set(out) == set(template)
    assert all(not out[k].any() for k in ("layers.0.attn.weight", "layers.0.norm.weight"))
    assert out["layers.0.attn.weight"].dtype == torch.float32 and out["layers.0.attn.weight"].shape == (4, 4)
    assert torch.equal(out["layers.0.steps"], template["layers.0.steps"])
    assert torch.equal(out["layers.0.mask"], template["layers.0.mask"])
    assert all(torch.equal(template[k], snapshot[k]) for k in template)  # the template is untouched
    assert torch.equal(zeroed_state(template)["layers.0.norm.weight"], torch.zeros(4))
    with pytest.raises(ValueError, match="fresh_state"):
        execute_rebuild(plan_rebuild(2, S5, "zero", True), {}, None, None)

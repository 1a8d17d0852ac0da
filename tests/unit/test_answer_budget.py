"""The answer budget (node/p2p/answer_budget.py): whole-stage answers per identity and in total,
over a sliding window, with a clock the test moves."""

from __future__ import annotations

import pytest

from node.p2p.answer_budget import AnswerBudget, BudgetLimits
from tests.helpers.clock import FakeClock


def test_one_identity_gets_its_share_then_a_refusal_that_says_when_to_come_back():
    clock = FakeClock()
    budget = AnswerBudget(BudgetLimits(per_identity=3, total=10, window=60.0), clock)
    for _ in range(3):
        assert budget.take("a") is None
        clock.now += 5.0
    refusal = budget.take("a")
    assert refusal == "answer budget spent (3 per identity per 60 s); next in 45 s"
    assert budget.take("b") is None  # another identity is not held to a's share
    assert budget.given("a") == 3 and budget.given() == 4  # the refusal was not counted
    clock.now += 45.0  # a's first answer leaves the window
    assert budget.take("a") is None
    assert budget.take("a") is not None


def test_many_identities_meet_the_total():
    clock = FakeClock()
    budget = AnswerBudget(BudgetLimits(per_identity=2, total=5, window=10.0), clock)
    assert [budget.take(f"id{i}") for i in range(5)] == [None] * 5
    assert budget.take("id9") == "answer budget spent (5 for all requesters per 10 s); next in 10 s"
    clock.now += 10.0
    assert budget.take("id9") is None and budget.given() == 1


def test_memory_holds_only_the_window():
    clock = FakeClock()
    budget = AnswerBudget(BudgetLimits(per_identity=1, total=100, window=1.0), clock)
    for i in range(10_000):  # a stranger rotating identities
        budget.take(f"id{i}")
        clock.now += 0.5
    assert budget.given() <= 2 and len(budget._per_identity) <= 2


@pytest.mark.parametrize("limits", [BudgetLimits(per_identity=0), BudgetLimits(total=0), BudgetLimits(window=0.0)])
def test_a_budget_that_allows_nothing_is_a_configuration_error(limits):
    with pytest.raises(ValueError, match="answer budget limits"):
        AnswerBudget(limits)

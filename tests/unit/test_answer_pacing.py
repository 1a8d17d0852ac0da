"""Gossip answers whose round did not finish, paced in inner steps (node/averaging/answer_pacing.py)."""

from __future__ import annotations

import pytest

from node.averaging.answer_pacing import AnswerPace, UnfinishedAnswers


def test_one_identity_gets_two_unfinished_answers_within_the_window_others_are_not_held_back():
    answers = UnfinishedAnswers(AnswerPace(gap_steps=10, per_identity=2, total=4))
    for step in (100, 103):
        assert answers.refusal("loop", step) is None
        answers.note("loop", step)
    for step in (103, 109):
        assert answers.refusal("loop", step) == (
            "2 rounds with you did not finish since inner step 100; ask again from inner step 110"
        )
        assert answers.refusal("honest", step) is None
    assert answers.refusal("loop", 110) is None  # the first left the window: one more answer
    answers.note("loop", 110)
    assert answers.refusal("loop", 112).startswith("2 rounds with you did not finish since inner step 103")


def test_all_identities_together_get_at_most_total_unfinished_answers_within_the_window():
    answers = UnfinishedAnswers(AnswerPace(gap_steps=10, per_identity=2, total=3))
    for i, step in enumerate((50, 52, 54)):
        assert answers.refusal(f"sybil{i}", step) is None
        answers.note(f"sybil{i}", step)
    assert answers.refusal("sybil3", 55) == "3 rounds did not finish within 10 inner steps; ask another replica"
    assert answers.refusal("sybil3", 60) is None  # the first one left the window at step 60


def test_memory_holds_only_the_window():
    answers = UnfinishedAnswers(AnswerPace(gap_steps=5, total=1000))
    for step in range(1000):
        answers.note(f"identity{step}", step)
        answers.refusal("anyone", step)
    assert len(answers._per_identity) <= 5 and len(answers._recent) <= 5


@pytest.mark.parametrize(
    "pace", [AnswerPace(gap_steps=0), AnswerPace(gap_steps=5, per_identity=0), AnswerPace(gap_steps=5, total=0)]
)
def test_a_pace_that_would_refuse_everything_or_nothing_is_refused(pace):
    with pytest.raises(ValueError, match="answer pace"):
        UnfinishedAnswers(pace)

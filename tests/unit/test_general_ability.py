"""The forgetting check (icrl_core/general_ability.py): answer scoring, the paired comparison, and a measurement
on a random tiny model. The reply-length setting on the real SmolLM2: tests/integration/test_general_ability.py."""

from __future__ import annotations

import math

import pytest

from icrl_core.general_ability import QUESTIONS, is_correct, measure, paired_change


def test_an_accepted_answer_must_appear_as_a_whole_word():
    assert is_correct("The capital of France is Paris.", ("Paris",))
    assert is_correct("paris, of course", ("Paris",))
    assert is_correct("A spider has 8 legs.", ("8", "eight"))
    assert not is_correct("Parisian food is good.", ("Paris",))
    assert not is_correct("It has 18 legs.", ("8",))
    assert is_correct("We get vitamin D from sunlight.", ("vitamin D", "D"))


def test_the_questions_are_unique_and_each_has_an_answer():
    questions = [q for q, _ in QUESTIONS]
    assert len(questions) == len(set(questions)) >= 197
    assert all(accepted and all(a.strip() for a in accepted) for _, accepted in QUESTIONS)


def test_paired_change_against_hand_computed_values():
    # 10 questions: 3 became correct, 1 became wrong, 6 unchanged
    base = [False, False, False, True, True, True, False, True, True, False]
    trained = [True, True, True, False, True, True, False, True, True, False]
    paired = paired_change(base, trained)
    assert (paired.became_correct, paired.became_wrong, paired.n_questions) == (3, 1, 10)
    assert paired.change == pytest.approx(0.2)
    # d = [1, 1, 1, -1, 0 x 6]: sum (d - 0.2)^2 = 3 * 0.64 + 1.44 + 6 * 0.04 = 3.6; var = 3.6 / 9 = 0.4
    assert paired.standard_error == pytest.approx(math.sqrt(0.4 / 10))
    assert paired.ci95_low == pytest.approx(0.2 - 1.96 * math.sqrt(0.04))
    assert paired.ci95_high == pytest.approx(0.2 + 1.96 * math.sqrt(0.04))
    # McNemar exact: 4 flips, min 1: 2 * (C(4,0) + C(4,1)) / 16 = 10 / 16
    assert paired.mcnemar_p == pytest.approx(0.625)


def test_paired_change_edge_cases():
    same = paired_change([True, False, True], [True, False, True])
    assert (same.change, same.standard_error, same.became_correct, same.became_wrong, same.mcnemar_p) == (
        0.0, 0.0, 0, 0, 1.0)
    all_lost = paired_change([True] * 8, [False] * 8)
    assert all_lost.change == -1.0 and all_lost.mcnemar_p == pytest.approx(2 / 2 ** 8)
    with pytest.raises(ValueError):
        paired_change([True], [True, False])
    with pytest.raises(ValueError):
        paired_change([], [])


def test_measure_answers_greedily_and_deterministically(tiny):
    first = measure(tiny, QUESTIONS[:3], max_new_tokens=4)
    second = measure(tiny, QUESTIONS[:3], max_new_tokens=4)
    assert first.n_questions == 3 and len(first.answers) == 3
    assert [a["reply"] for a in first.answers] == [a["reply"] for a in second.answers]
    assert first.accuracy == sum(a["correct"] for a in first.answers) / 3
    assert all(a["answer_nll"] > 0 and math.isfinite(a["answer_nll"]) for a in first.answers)
    assert first.answer_nll == pytest.approx(sum(a["answer_nll"] for a in first.answers) / 3)

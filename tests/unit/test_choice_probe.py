"""The likelihood-scored multiple-choice forgetting probe (icrl_core/choice_probe.py): items, answers, tree
scoring on the tiny model. On the real SmolLM2: tests/integration/test_choice_probe.py."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from icrl_core.choice_probe import ChoiceItem, choice_scores, generate_items, measure_choices


def test_items_are_deterministic_balanced_and_well_formed():
    items = generate_items(seed=0)
    assert items == generate_items(seed=0)
    assert items != generate_items(seed=1)
    families = Counter(item.family for item in items)
    assert len(items) >= 1400 and len(families) >= 10
    assert max(families.values()) / len(items) < 0.2  # no family dominates the score
    for item in items:
        assert len(set(item.choices)) == len(item.choices) >= 2, item
        assert all(choice.strip() for choice in item.choices)
    questions = [(item.question, item.answer) for item in items]
    assert len(set(questions)) == len(questions)


def test_generated_answers_are_right():
    for item in generate_items(seed=3):
        if m := re.fullmatch(r"What is (\d+) ([-+]|times) (\d+)\?", item.question):
            a, op, b = int(m[1]), m[2], int(m[3])
            assert int(item.answer) == {"+": a + b, "-": a - b, "times": a * b}[op]
            assert all(int(d) != int(item.answer) and int(d) >= 0 for d in item.distractors)
        elif m := re.fullmatch(r"What number comes (after|before) (\d+)\?", item.question):
            assert int(item.answer) == int(m[2]) + (1 if m[1] == "after" else -1)
        elif m := re.fullmatch(r"Which number is (larger|smaller), (\d+) or (\d+)\?", item.question):
            pick = max if m[1] == "larger" else min
            assert int(item.answer) == pick(int(m[2]), int(m[3])) and len(item.distractors) == 1
        elif m := re.fullmatch(r'What is the first letter of the word "(.+)"\?', item.question):
            assert item.answer == m[1][0].upper()
    by_question = {item.question: item.answer for item in generate_items()}
    assert by_question["What day comes after Sunday?"] == "Monday"
    assert by_question["What month comes before January?"] == "December"
    assert by_question["What letter comes after G in the alphabet?"] == "H"
    assert by_question["What is the capital of Japan?"] == "Tokyo"
    assert by_question['What is the past tense of "go"?'] == "went"


@torch.no_grad()
def _one_by_one(policy, tokens, item: ChoiceItem, end_of_turn: bool = True) -> list[float]:
    """Reference: each choice scored in its own unpadded forward pass over the full vocabulary."""
    prompt = list(policy.tokenizer.apply_chat_template([{"role": "user", "content": item.question}],
                                                       add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
    out = []
    for choice in item.choices:
        answer = list(tokens.encode(choice)) + ([tokens.end_of_turn_id] if end_of_turn else [])
        ids = torch.tensor([prompt + answer])
        logits = policy.causal_lm(input_ids=ids).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
        out.append(float(logprobs.gather(-1, torch.tensor(answer).unsqueeze(-1)).sum()))
    return out


def test_tree_scores_over_a_shared_prefix_equal_one_by_one_scores(tiny, tokens):
    items = generate_items()[:7]  # mixed families, answers of different token lengths
    batched = choice_scores(tiny, tokens, items)
    for item, scores in zip(items, batched):
        assert scores == pytest.approx(_one_by_one(tiny, tokens, item), abs=1e-4)
    # without the end-of-turn token: how likely the reply starts with each choice (never lower)
    starts = choice_scores(tiny, tokens, items, end_of_turn=False)
    for item, scores, whole in zip(items, starts, batched):
        assert scores == pytest.approx(_one_by_one(tiny, tokens, item, end_of_turn=False), abs=1e-4)
        assert all(s >= w for s, w in zip(scores, whole))


def test_measure_counts_strict_wins_per_family(tiny, tokens):
    items = generate_items()[:12]
    report = measure_choices(tiny, tokens, items)
    scores = choice_scores(tiny, tokens, items)
    expected = [s[0] > max(s[1:]) for s in scores]
    assert report.correct == expected and report.n_items == 12
    assert report.accuracy == pytest.approx(sum(expected) / 12)
    assert set(report.by_family) == {item.family for item in items}

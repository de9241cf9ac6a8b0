"""The forgetting check (icrl_core/general_ability.py) on the real SmolLM2-135M: a longer reply setting extends
the shorter reply. Its parts: tests/unit/test_general_ability.py."""

from __future__ import annotations

from icrl_core.general_ability import QUESTIONS, measure


def test_a_longer_reply_setting_extends_the_shorter_reply(smollm2):
    # greedy decoding: the 12-token reply starts with the 3-token one, so a longer setting only lets late answers in
    # (a random tiny model answers with newlines only, hence the real model)
    question = [QUESTIONS[0]]
    short = measure(smollm2, question, max_new_tokens=3).answers[0]["reply"]
    long = measure(smollm2, question, max_new_tokens=12).answers[0]["reply"]
    assert len(smollm2.tokenizer.encode(short, add_special_tokens=False)) <= 3
    assert long.startswith(short) and len(long) > len(short)

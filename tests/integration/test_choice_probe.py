"""The multiple-choice forgetting probe (icrl_core/choice_probe.py) on the real SmolLM2-135M: it measures
something the model can lose. Its parts: tests/unit/test_choice_probe.py."""

from __future__ import annotations

from icrl_core.choice_probe import generate_items, measure_choices


def test_the_real_model_beats_chance_on_facts(smollm2):
    """SmolLM2-135M-Instruct knows capitals and weekday order: the probe measures something it can lose."""
    items = [i for i in generate_items() if i.family in ("capital", "day_order")][:40]
    report = measure_choices(smollm2, smollm2.tokens, items)
    assert report.accuracy > 0.5  # chance is 0.25

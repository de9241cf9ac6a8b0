"""The feedback-sensitivity probe's contexts (icrl_core/feedback_probe.py) and the label distribution it reads
(icrl_eval.label_distribution). On the real SmolLM2 and through `icrl probe-feedback`:
tests/integration/test_feedback_probe.py."""

from __future__ import annotations

import pytest

from icrl_core.errors import UserError
from icrl_core.feedback_probe import NAIVE_SHOW, Condition, conditions, effect_interval, past_attempts, probe_examples
from icrl_core.icrl_eval import Predictor, decode_rng, label_distribution, render_context
from icrl_core.kernels import PrefixCache
from icrl_core.task_data import keyword_map


def test_label_distribution_is_what_the_harness_samples_from(tiny):
    task = keyword_map(seed=0)
    predictor = Predictor(tiny, tiny.tokens, task.template, task.labels, PrefixCache(tiny), 1.0, expand="path")
    queries, pool = probe_examples(task, task.labels[0], 4, 0)
    records = past_attempts(pool, task.labels[0], Condition(3, 0), 0, 0)
    context, user_open = render_context(tiny.tokens, task.template, records, NAIVE_SHOW)
    for query in queries:
        p = label_distribution(predictor, context, user_open, query.text)
        assert p.shape == (len(task.labels),) and p.sum() == pytest.approx(1.0) and (p > 0).all()
        # every sampled label's probability, as the harness records it, is that label's entry
        for draw in range(5):
            (prediction,), _ = predictor.predict(context, user_open, [query.text], [decode_rng(7, draw, 0)])
            assert p[prediction.label] == pytest.approx(prediction.prob, rel=1e-4)
        greedy = label_distribution(predictor, context, user_open, query.text, temperature=0)
        assert sorted(greedy) == [0.0] * (len(task.labels) - 1) + [1.0]


def test_probe_contexts_differ_only_in_feedback():
    task = keyword_map(seed=0)
    target = task.labels[1]
    assert [c.name for c in conditions([4, 1, 0])] == ["n0", "n1_wrong", "n1_right", "n4_wrong", "n4_right"]
    queries, pool = probe_examples(task, target, 10, 3)
    assert len(queries) == 10 and all(q.label != target for q in queries + pool)
    wrong = past_attempts(pool, target, Condition(4, 0), 2, 3)
    right = past_attempts(pool, target, Condition(4, 1), 2, 3)
    assert [r.query for r in wrong] == [r.query for r in right]
    assert [r.query for r in wrong] != [r.query for r in past_attempts(pool, target, Condition(4, 0), 3, 3)]
    assert {r.prediction for r in wrong + right} == {target}
    assert {r.feedback for r in wrong} == {0} and {r.feedback for r in right} == {1}
    with pytest.raises(UserError, match="not a label"):
        probe_examples(task, "no-such-label", 10, 0)


def test_effect_interval_is_a_paired_bootstrap_over_queries():
    right, wrong = [0.9, 0.8, 0.7, 0.6], [0.5, 0.5, 0.5, 0.5]          # differences 0.4, 0.3, 0.2, 0.1
    low, high = effect_interval(right, wrong, seed=0)
    assert 0.1 <= low < 0.25 < high <= 0.4                             # around the mean 0.25, within the range
    assert effect_interval(right, wrong, seed=0) == (low, high)        # seeded
    # a shift shared by both conditions (the same query easier in both) leaves the paired interval unchanged
    assert effect_interval([r + 0.05 for r in right], [w + 0.05 for w in wrong], seed=0) == pytest.approx((low, high))
    assert effect_interval([0.3] * 5, [0.3] * 5, seed=1) == (0.0, 0.0)

"""The label-closure probe (icrl_core/closure_probe.py): its draws keep the probed label out of the contexts and the
queries out of their own contexts, and the probe reads the harness's label distribution for each condition."""

from __future__ import annotations

import pytest

from icrl_core.closure_probe import closure_draws, label_closure, rewarded
from icrl_core.errors import UserError
from icrl_core.icrl_eval import Predictor
from icrl_core.kernels import PrefixCache
from icrl_core.task_data import keyword_map


def test_draws_lack_the_label_and_never_hold_their_query():
    task = keyword_map(seed=0)
    label = task.labels[2]
    positives, negatives = closure_draws(task, label, n_queries=5, episodes=6, seed=1)
    assert len(positives) == len(negatives) == 5
    assert {d.query.label for d in positives} == {label}
    assert all(d.query.label != label for d in negatives)
    for d in positives + negatives:
        assert len(d.context) == 6 and all(e.label != label for e in d.context)
        assert all(e is not d.query for e in d.context)
        assert d.label_example.label == label and d.label_example not in [p.query for p in positives]
    assert closure_draws(task, label, 5, 6, 1) == (positives, negatives)          # seeded
    assert [r.feedback for r in rewarded(positives[0].context)] == [1] * 6
    assert [r.prediction for r in rewarded(positives[0].context)] == [e.label for e in positives[0].context]
    with pytest.raises(UserError, match="not a label"):
        closure_draws(task, "no-such-label", 5, 6, 1)
    with pytest.raises(UserError, match="too few"):
        closure_draws(task, label, 10_000, 6, 1)


def test_probe_reports_probabilities_per_label_and_their_means(tiny):
    task = keyword_map(seed=0)
    predictor = Predictor(tiny, tiny.tokens, task.template, task.labels, PrefixCache(tiny), 1.0, expand="path")
    calls = []
    result = label_closure(predictor, task, n_queries=2, episodes=3, seed=0, on_query=lambda: calls.append(1))
    assert len(calls) == len(task.labels) * 3 * 2
    assert set(result["labels"]) == set(task.labels)
    for key in ("absent_recall", "present_recall", "false_alarm"):
        values = [row[key] for row in result["labels"].values()]
        assert all(0 < v < 1 for v in values)
        assert result[key] == pytest.approx(sum(values) / len(values))

"""The feedback-sensitivity probe (icrl_core/feedback_probe.py, `icrl probe-feedback`) and the label distribution
it reads (icrl_eval.label_distribution)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from icrl_core.errors import UserError
from icrl_core.feedback_probe import (NAIVE_SHOW, Condition, conditions, feedback_sensitivity, past_attempts,
                                      probe_examples)
from icrl_core.icrl_eval import Predictor, decode_rng, label_distribution, render_context
from icrl_core.kernels import PrefixCache
from icrl_core.task_data import keyword_map, load_task
from tests.conftest import run_cli


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


def test_smollm2_copies_its_last_answer_whatever_the_feedback(smollm2, tasks_dir):
    """The measured finding behind naive in-context RL's collapse: after one past attempt answered `entity`,
    SmolLM2-135M gives `entity` almost all the probability, marked wrong or right."""
    task = load_task("trec_coarse", tasks_dir)
    predictor = Predictor(smollm2, smollm2.tokens, task.template, task.labels, PrefixCache(smollm2), 1.0)
    result = feedback_sensitivity(predictor, task, "entity", counts=[1], n_queries=8, seed=0)
    rows = result["conditions"]
    assert rows["n0"]["p_target"] < 0.5
    assert rows["n1_wrong"]["p_target"] > 0.9 and rows["n1_right"]["p_target"] > 0.9
    assert abs(result["feedback_effect"]["1"]) < 0.05


def test_cli_writes_the_probe_and_rejects_a_bad_target(tmp_path):
    labels = keyword_map(seed=0).labels
    out = run_cli("probe-feedback", "--model", "tiny", "--task", "keyword_map", "--target", labels[0],
                  "--queries", "3", "--attempts", "2", "--threads", "1", "--no-progress",
                  "--output", str(tmp_path / "probe.json"), cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "probe.json").read_text())
    assert set(result["conditions"]) == {"n0", "n2_wrong", "n2_right"} and result["queries"] == 3
    for row in result["conditions"].values():
        assert 0 <= row["p_target"] <= 1 and 0 <= row["p_gold"] <= 1
    assert result["feedback_effect"]["2"] == pytest.approx(
        result["conditions"]["n2_right"]["p_target"] - result["conditions"]["n2_wrong"]["p_target"])
    assert "feedback effect" in out.stdout

    import mlflow  # the probe is an MLflow run too (sqlite store in the working directory)

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = mlflow.search_runs(experiment_names=["icrl"], output_format="list")
    assert run.data.tags["icrl.stage"] == "probe_feedback" and run.data.params["probe.target"] == labels[0]
    assert run.data.metrics["feedback_effect_n2"] == pytest.approx(result["feedback_effect"]["2"])
    assert run.data.metrics["p_target_n0"] == pytest.approx(result["conditions"]["n0"]["p_target"])
    artifacts = [a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "probe_feedback")]
    assert artifacts == ["probe_feedback/probe.json"]
    bad = run_cli("probe-feedback", "--model", "tiny", "--task", "keyword_map", "--target", "nope",
                  "--no-progress", cwd=tmp_path)
    assert bad.returncode == 2 and "not a label" in bad.stderr

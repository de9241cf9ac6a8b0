"""The feedback-sensitivity probe on the real SmolLM2-135M, and `icrl probe-feedback` through the real console
script. The probe's parts: tests/unit/test_feedback_probe.py."""

from __future__ import annotations

import json

import pytest

from icrl_core.feedback_probe import feedback_sensitivity
from icrl_core.icrl_eval import Predictor
from icrl_core.kernels import PrefixCache
from icrl_core.task_data import keyword_map, load_task
from tests.conftest import run_cli


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
    low, high = result["feedback_effect_ci95"]["2"]  # paired bootstrap over the 3 queries' differences
    assert low <= result["feedback_effect"]["2"] <= high
    assert all(len(row["p_target_per_query"]) == len(row["p_gold_per_query"]) == 3
               for row in result["conditions"].values())
    assert result["gold_after_wrong"]["2"] == pytest.approx(  # does the gold label gain from "wrong"?
        result["conditions"]["n2_wrong"]["p_gold"] - result["conditions"]["n0"]["p_gold"])
    low_gold, high_gold = result["gold_after_wrong_ci95"]["2"]
    assert low_gold <= result["gold_after_wrong"]["2"] <= high_gold
    assert "feedback effect" in out.stdout and "95% interval" in out.stdout and "p(gold) after" in out.stdout

    import mlflow  # the probe is an MLflow run too (sqlite store in the working directory)

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = mlflow.search_runs(experiment_names=["icrl"], output_format="list")
    assert run.data.tags["icrl.stage"] == "probe_feedback" and run.data.params["probe.target"] == labels[0]
    assert run.data.metrics["feedback_effect_n2"] == pytest.approx(result["feedback_effect"]["2"])
    assert run.data.metrics["feedback_effect_n2_ci95_low"] == pytest.approx(low)
    assert run.data.metrics["p_target_n0"] == pytest.approx(result["conditions"]["n0"]["p_target"])
    assert run.data.metrics["gold_after_wrong_n2"] == pytest.approx(result["gold_after_wrong"]["2"])
    artifacts = [a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "probe_feedback")]
    assert artifacts == ["probe_feedback/probe.json"]
    bad = run_cli("probe-feedback", "--model", "tiny", "--task", "keyword_map", "--target", "nope",
                  "--no-progress", cwd=tmp_path)
    assert bad.returncode == 2 and "not a label" in bad.stderr

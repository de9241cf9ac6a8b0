"""`icrl probe-closure` through the real console script on the tiny model: the result file, the MLflow run, and a
user error for sizes the task cannot fill. The probe's parts: tests/unit/test_closure_probe.py."""

from __future__ import annotations

import json

import pytest

from icrl_core.task_data import keyword_map
from tests.conftest import run_cli

pytestmark = pytest.mark.integration


def test_cli_writes_the_probe_tracks_it_and_rejects_sizes_the_task_cannot_fill(tmp_path):
    labels = keyword_map(seed=0).labels
    out = run_cli("probe-closure", "--model", "tiny", "--task", "keyword_map", "--queries", "2", "--episodes", "3",
                  "--threads", "1", "--no-progress", "--output", str(tmp_path / "closure.json"), cwd=tmp_path,
                  env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "closure.json").read_text())
    assert set(result["labels"]) == set(labels) and result["queries"] == 2 and result["episodes"] == 3
    for key in ("absent_recall", "present_recall", "false_alarm"):
        values = [row[key] for row in result["labels"].values()]
        assert all(0 <= v <= 1 for v in values) and result[key] == pytest.approx(sum(values) / len(values))
    assert result["model"] == "tiny" and result["adapter"] is None
    assert "absent recall - false alarm" in out.stdout and "mean" in out.stdout

    import mlflow  # the probe is an MLflow run (sqlite store in the working directory)

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = mlflow.search_runs(experiment_names=["icrl"], output_format="list")
    assert run.data.tags["icrl.stage"] == "probe_closure" and run.data.params["probe.episodes"] == "3"
    assert run.data.metrics["absent_recall_margin"] == pytest.approx(result["absent_recall"] - result["false_alarm"])
    assert run.data.metrics[f"absent_recall/{labels[0]}"] == pytest.approx(result["labels"][labels[0]]["absent_recall"])
    artifacts = [a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "probe_closure")]
    assert artifacts == ["probe_closure/closure.json"]

    bad = run_cli("probe-closure", "--model", "tiny", "--task", "keyword_map", "--queries", "100000",
                  "--no-progress", cwd=tmp_path)
    assert bad.returncode == 2 and "too few training examples" in bad.stderr and "Traceback" not in bad.stderr

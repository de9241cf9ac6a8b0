"""experiments/icrl_stream_rl/label_coverage.py: test queries split by whether the step's context holds a rewarded
episode of their gold label, by hand and on a run folder laid out as the evaluate stage writes it."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.conftest import ROOT, write_toy_task

sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("label_coverage",
                                               ROOT / "experiments" / "icrl_stream_rl" / "label_coverage.py")
label_coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(label_coverage)


def test_coverage_row_by_hand():
    from collections import Counter

    gold = ["a", "a", "b", "c", "c"]
    said = ["a", "b", "b", "a", "c"]
    row = label_coverage.coverage_row(gold, said, Counter({"a": 2, "b": 0}))
    # only `a` is in the context: queries 0, 1 (1 right); absent b, c: queries 2, 3, 4 (2 right)
    assert (row["right_present"], row["present"], row["right_absent"], row["absent"]) == (1, 2, 2, 3)
    assert row["absent_share"] == pytest.approx(0.6) and row["accuracy"] == pytest.approx(0.6)
    assert row["per_label"] == {"a": [1, 2, 2], "b": [1, 1, 0], "c": [1, 2, 0]}
    assert label_coverage.coverage_row(["a"], ["a"], Counter())["accuracy_present"] is None


def test_a_run_folder_and_a_bad_one(tmp_path, capsys):
    tasks_dir = write_toy_task(tmp_path, 4)
    from icrl_core.task_data import load_task_from_dir

    gold = [e.label for e in load_task_from_dir("toy", tasks_dir).test_set(4, 0)]
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"icrl_eval": {"task": "toy", "test_k": 4, "test_seed": 0,
                                                               "seed": 7, "strategy": "explorative"},
                                                 "data": {"tasks_dir": str(tasks_dir)}}))
    # step 1's context: step 0, a rewarded `yes`
    steps = [{"step": 0, "gold": "yes", "reward": 1, "context": []}, {"step": 1, "gold": "no", "reward": 0,
                                                                        "context": [0]}]
    (run / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    (run / "tests.jsonl").write_text(json.dumps({"step": 1, "accuracy": 0.5, "predictions": ["yes"] * 4}) + "\n")
    out = tmp_path / "coverage.json"
    assert label_coverage.main([str(run), "--from-step", "0", "--output", str(out)]) == 0
    step = json.loads(out.read_text())["runs"][str(run)]["steps"]["1"]
    assert step["absent"] == gold.count("no") and step["right_present"] == gold.count("yes")
    assert label_coverage.main([str(tmp_path / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_record_keeps_the_shares_by_seed_and_the_pooled_counts(tmp_path):
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"gate_e": {"16": {}}}))
    cov = {"accuracy": 0.5, "absent_share": 0.25, "accuracy_absent": 0.0, "accuracy_present": 2 / 3,
           "right_absent": 0, "absent": 1, "right_present": 2, "present": 3, "per_label": {"a": [2, 3, 1]}}
    rows = {"run": {"seed": 7, "strategy": "explorative", "steps": {"999": cov}}}
    pooled = {"absent": {"right": 0, "queries": 1, "accuracy": 0.0}}
    label_coverage.record("bootstrap", rows, pooled, results)
    saved = json.loads(results.read_text())
    assert saved["gate_e"] == {"16": {}}  # the rest of results.json kept
    assert saved["label_coverage"]["bootstrap"] == {"runs": {"7": {"999": {
        "accuracy": 0.5, "absent_share": 0.25, "accuracy_absent": 0.0, "accuracy_present": 2 / 3}}}, "pooled": pooled}

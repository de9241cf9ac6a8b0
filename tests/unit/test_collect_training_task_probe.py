"""collect.py's --training-task-probe (addendum 47): the feedback probe on a training task beside a setting's
trec_coarse probe, and the bootstrap's, kept across a re-collect of the setting."""

from __future__ import annotations

import importlib.util
import json
import sys

from tests.conftest import ROOT

HERE = ROOT / "experiments" / "icrl_stream_rl"


def _collect():
    spec = importlib.util.spec_from_file_location("collect_settings", HERE / "collect.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _probe(path, wrong: float, right: float, task: str = "banking77") -> str:
    conditions = {c: {"p_target": p, "p_gold": 0.2} for c, p in
                  (("n0", 0.0), ("n1_wrong", wrong), ("n1_right", right), ("n4_wrong", wrong), ("n4_right", right))}
    path.write_text(json.dumps({"target": "card arrival", "task": task, "queries": 40, "seed": 0,
                                "dtype": "float32", "conditions": conditions}))
    return str(path)


def test_training_task_probe_is_recorded_per_setting_and_for_the_bootstrap(tmp_path, monkeypatch):
    collect = _collect()
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"gate1_margin": 0.2, "settings": {"29": {
        "run": "x", "iterations": 40, "probe": {}, "gate1_gap": -0.005, "gate1_passed": False}}}))
    monkeypatch.setattr(collect, "RESULTS", results)
    monkeypatch.setattr(sys, "argv", ["collect.py",
                                      "--training-task-probe", "bootstrap=" + _probe(tmp_path / "b.json", 0.418, 0.387),
                                      "--training-task-probe", "29=" + _probe(tmp_path / "s.json", 0.081, 0.076)])
    collect.main()
    written = json.loads(results.read_text())
    assert written["bootstrap_probe_training_task"]["gap"] == -0.031
    row = written["settings"]["29"]["probe_training_task"]
    assert row["task"] == "banking77" and row["p_target"]["n1_wrong"] == 0.081 and row["gap"] == -0.005
    assert written["settings"]["29"]["gate1_gap"] == -0.005  # the trec_coarse gate-1 numbers are left alone

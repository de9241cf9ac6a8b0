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


def test_a_setting_decided_by_its_probe_check_records_check_p_not_a_gate_1_verdict(tmp_path, monkeypatch, capsys):
    """Settings 29-31 were decided by check P (n=1 effect >= +0.10), not gate 1 (>= 0.2): a re-collect replaces a
    recorded gate-1 verdict with the check's, and keeps other hand-added keys."""
    collect = _collect()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps({"iterations": 40}))
    (run / "evals.json").write_text(json.dumps([{"val_reward": 0.3, "val_switch_after_wrong": 0.1},
                                                {"val_reward": 0.4, "val_switch_after_wrong": 0.5}]))
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"gate1_margin": 0.2, "settings": {"31": {"gate1_passed": False, "wall": 1}}}))
    monkeypatch.setattr(collect, "RESULTS", results)
    probe = _probe(tmp_path / "p.json", 0.80, 0.95, task="trec_coarse")
    monkeypatch.setattr(sys, "argv", ["collect.py", "--setting", f"31={run}:{probe}", "--setting", f"28={run}:{probe}"])
    collect.main()
    written = json.loads(results.read_text())["settings"]
    assert written["31"]["check_p"] == {"least_effect": 0.10, "passed": True} and "gate1_passed" not in written["31"]
    assert written["31"]["wall"] == 1 and written["31"]["gate1_gap"] == 0.15
    assert written["28"]["gate1_passed"] is False and "check_p" not in written["28"]  # gate 1's 0.2 for the others
    assert "setting 31: gap +0.150 -> check P (>= +0.10) passed" in capsys.readouterr().out

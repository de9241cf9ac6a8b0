"""Issue 29's context-distillation collector (experiments/icrl_stream_rl/collect_distill.py, addendum 27) and its
generated table: the students' probe, forgetting and training are shown before any evaluation part ran, and the
decision follows gate 2's rule once parts are in."""

from __future__ import annotations

import importlib.util
import json
import sys

from tests.conftest import ROOT

HERE = ROOT / "experiments" / "icrl_stream_rl"


def _module(monkeypatch, name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # collect_distill imports collect and collect_gate2 by name
    spec.loader.exec_module(module)
    return module


def _write(path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _probe(path, wrong: float, right: float) -> None:
    conditions = {c: {"p_target": p, "p_gold": 0.2} for c, p in
                  {"n0": 0.13, "n1_wrong": wrong, "n1_right": right, "n4_wrong": wrong, "n4_right": right}.items()}
    _write(path, {"target": "entity", "task": "trec_coarse", "queries": 40, "seed": 0, "dtype": "float32",
                  "conditions": conditions})


def _forgetting(path) -> None:
    model = lambda right: {"probe": {"correct": [True] * right + [False] * (10 - right), "accuracy": right / 10},
                           "greedy": {"accuracy": right / 10,
                                      "answers": [{"correct": i < right} for i in range(10)]}}
    _write(path, {"seconds": 60, "base": model(5), "trained": model(5)})


def _student_run(folder, rewards: tuple[float, float]) -> None:
    _write(folder / "history.json", [{"step": i, "rollout_seconds": 30.0, "update_seconds": 15.0} for i in (1, 2)])
    _write(folder / "evals.json", [{"step": s, "val_reward": r, "val_switch_after_wrong": 0.1}
                                   for s, r in zip((0, 2), rewards)])


def _part(folder, student: float) -> None:
    for name, final in (("trained-naive", student), ("start-naive", 0.21), ("base-naive", 0.2)):
        _write(folder / "runs" / name / "metrics.json", {"test_accuracy": {"0": 0.25, "999": final}})
        (folder / "runs" / name / "steps.jsonl").write_text("")


def test_students_then_parts_into_results_and_the_table(tmp_path, monkeypatch):
    collect = _module(monkeypatch, "collect", HERE / "collect.py")
    _module(monkeypatch, "collect_gate2", HERE / "collect_gate2.py")
    collect_distill = _module(monkeypatch, "collect_distill", HERE / "collect_distill.py")
    tables = _module(monkeypatch, "results_tables", ROOT / "scripts" / "results_tables.py")
    results = tmp_path / "results.json"
    _write(results, {"settings": {"1": {"gate1_gap": -0.024}, "2": {"gate1_gap": -0.048}}})
    monkeypatch.setattr(collect, "RESULTS", results)
    monkeypatch.setattr(tables, "_json", lambda relative: json.loads(results.read_text()))

    for arm, (wrong, right) in (("plain", (0.9, 0.88)), ("distill", (0.6, 0.65))):
        _probe(tmp_path / arm / "probe.json", wrong, right)
        _forgetting(tmp_path / arm / "forgetting.json")
        _student_run(tmp_path / arm / "run", (0.48, 0.6))
        monkeypatch.setattr(sys, "argv", ["collect_distill.py", "--probe", f"{arm}={tmp_path / arm / 'probe.json'}",
                                          "--forgetting", f"{arm}={tmp_path / arm / 'forgetting.json'}",
                                          "--run", f"{arm}={tmp_path / arm / 'run'}"])
        collect_distill.main()
    table = tables.stream_rl_distillation()
    assert "| plain (setting 1) | 0.900 / 0.880 | -0.020 (setting: -0.024) |" in table
    assert "| distill (setting 2) | 0.600 / 0.650 | +0.050 (setting: -0.048) |" in table
    assert "0.48 -> 0.60" in table and "| 2 min |" in table  # 2 iterations of 45 s
    assert "have not run yet" in table

    for arm, student in (("plain", 0.21), ("distill", 0.29)):
        _part(tmp_path / f"seed102-{arm}", student)
        monkeypatch.setattr(sys, "argv", ["collect_distill.py", "--part", f"102:{arm}={tmp_path / f'seed102-{arm}'}"])
        collect_distill.main()
    measured = json.loads(results.read_text())["context_distillation"]
    assert measured["decision"] == {"differences": {"102": 0.08}, "mean": 0.08, "verdict": "pending"}
    assert set(measured["students"]["plain"]) == {"probe", "forgetting", "training"}  # kept across collects
    table = tables.stream_rl_distillation()
    assert "| 102 | 0.250 / 0.210 | 0.250 / 0.290 | 0.250 / 0.210 | 0.250 / 0.200 | +0.080 |" in table
    assert "**pending**" in table

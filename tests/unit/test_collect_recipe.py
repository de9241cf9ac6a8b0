"""experiments/icrl_skill/collect_recipe.py: the recipe's end-to-end run and its final tests (addendum 39) go into
results.json under keys of their own, H32's record untouched; bad arguments are one message and exit 2."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.conftest import ROOT, write_toy_task

sys.path.insert(0, str(ROOT / "experiments" / "icrl_stream_rl"))
_spec = importlib.util.spec_from_file_location("collect_recipe", ROOT / "experiments" / "icrl_skill" / "collect_recipe.py")
collect_recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(collect_recipe)


def _evaluate_folder(folder, finals: dict[str, float], metrics: dict | None = None):
    """An evaluate stage output: runs/<model>-<strategy>/ with metrics.json and steps.jsonl, and its metrics.json."""
    for name, final in finals.items():
        run = folder / "runs" / name
        run.mkdir(parents=True)
        (run / "metrics.json").write_text(json.dumps({"test_accuracy": {"0": 0.2, "999": final},
                                                      "train_accuracy": 0.3, "regret": 700}))
        (run / "steps.jsonl").write_text(json.dumps({"gold": "a", "prediction": "a", "reward": 1}) + "\n")
    if metrics is not None:
        (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


@pytest.fixture
def results(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"experiment": "icrl_skill", "runs": ["H32's record"]}))
    monkeypatch.setattr(collect_recipe, "RESULTS", path)
    return path


def test_the_recipe_run_and_each_final_test_are_collected_beside_the_h32_record(tmp_path, results):
    recipe = _evaluate_folder(tmp_path / "evaluate", {"trained-explorative": 0.5, "start-explorative": 0.45,
                                                      "base-explorative": 0.2},
                              {"gain_over_start": 0.05, "eligible": True, "task": "trec_coarse", "seconds": 60.0,
                               "forgetting_probe_change": 0.004, "adapter_sha256": "ab" * 32})
    promote = tmp_path / "promote.json"
    promote.write_text(json.dumps({"alias": "champion", "eligible": True}))
    assert collect_recipe.main(["--recipe", str(recipe), "--promote", str(promote), "--commit", "7e9e9e1",
                                "--stage-minutes", "bootstrap=38", "--stage-minutes", "ppo=150.5"]) == 0
    final = _evaluate_folder(tmp_path / "final", {"trained-explorative": 0.1}, None)  # still running
    assert collect_recipe.main(["--final", f"nlu={final}"]) == 0
    out = json.loads(results.read_text())
    assert out["runs"] == ["H32's record"]  # kept
    entry = out["recipe_rl"]
    assert entry["runs"]["trained-explorative"]["test_accuracy"]["999"] == 0.5
    assert entry["gain_over_start"] == 0.05 and entry["forgetting_probe_change"] == 0.004
    assert entry["promote"]["alias"] == "champion" and entry["commit"] == "7e9e9e1"
    assert entry["stage_minutes"] == {"bootstrap": 38.0, "ppo": 150.5} and entry["wall_minutes"] == 188.5
    assert set(out["final_tests"]) == {"nlu"} and "gain_over_start" not in out["final_tests"]["nlu"]
    # once finished, a final test keeps the stage's gains and leaves out its promotion verdicts (no forgetting is
    # measured there and the gates are the development task's)
    finished = _evaluate_folder(tmp_path / "finished", {"trained-explorative": 0.1},
                                {"gain_over_start": -0.01, "eligible": False, "passes_forgetting": True,
                                 "passes_gain_over_start": False, "task": "nlu"})
    assert collect_recipe.main(["--final", f"nlu={finished}"]) == 0
    nlu = json.loads(results.read_text())["final_tests"]["nlu"]
    assert nlu["gain_over_start"] == -0.01 and nlu["task"] == "nlu"
    assert not [key for key in nlu if key == "eligible" or key.startswith("passes_")]


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to collect"),
    (["--final", "trec_coarse=."], "the final tests are trec_fine"),
    (["--final", "nlu"], "expected NAME=VALUE"),
    (["--recipe", "/nonexistent/evaluate"], "no such folder"),
    (["--final", "nlu=.", "--stage-minutes", "ppo=long"], "--stage-minutes"),
])
def test_bad_arguments_are_one_message_and_exit_2(results, capsys, argv, message):
    before = results.read_bytes()
    assert collect_recipe.main(argv) == 2
    assert message in capsys.readouterr().err
    assert results.read_bytes() == before


def test_the_report_tables_show_the_recipe_run_and_the_final_tests_once_collected(tmp_path, results, monkeypatch):
    spec = importlib.util.spec_from_file_location("results_tables", ROOT / "scripts" / "results_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    monkeypatch.setattr(tables, "_json", lambda relative: json.loads(results.read_text()))
    assert "not finished" in tables.skill_recipe_rl() and "No final test" in tables.skill_final_tests()

    recipe = _evaluate_folder(tmp_path / "evaluate", {"trained-explorative": 0.5, "start-explorative": 0.45,
                                                      "base-explorative": 0.2, "trained-naive": 0.21},
                              {"forgetting_probe_change": 0.004, "feedback_effect_n1_trained": -0.01,
                               "feedback_effect_n1_base": 0.0})
    final = _evaluate_folder(tmp_path / "final", {"trained-explorative": 0.3, "start-explorative": 0.25,
                                                  "base-explorative": 0.1, "trained-zero_shot": 0.2,
                                                  "start-zero_shot": 0.2, "base-zero_shot": 0.15})
    assert collect_recipe.main(["--recipe", str(recipe), "--stage-minutes", "ppo=150",
                                "--final", f"trec_fine={final}"]) == 0
    recipe_table = tables.skill_recipe_rl()
    assert "| explorative | 0.200 | 0.450 | 0.500 | +0.050 | 0.200 / 0.500 |" in recipe_table
    assert "| naive |  |  | 0.210 |  |" in recipe_table  # a run not collected is an empty cell
    assert "+0.4 points" in recipe_table and "wall time 150 minutes" in recipe_table
    final_tables = tables.skill_final_tests()
    assert ("| trec_fine | 0.100 | 0.250 | 0.300 | 0.150 | 0.200 | 0.200 | +0.050 | +0.150 | +0.200 |"
            " -0.050 / +0.050 / +0.100 |" in final_tables)
    assert "| trec_fine | RL-explorative | 0.200 / 0.300 | 0.300 | - |" in final_tables


def test_a_final_test_gets_the_paired_differences_between_models_and_each_runs_minutes(tmp_path, results):
    from icrl_core.task_data import load_task_from_dir

    tasks_dir = write_toy_task(tmp_path, 6)
    gold = [example.label for example in load_task_from_dir("toy", tasks_dir).test_set(4, 3)]
    flip = {"yes": "no", "no": "yes"}
    answers = {"trained": [gold[0], gold[1], flip[gold[2]], gold[3]],  # right on 0, 1, 3
               "start": [gold[0], flip[gold[1]], gold[2], flip[gold[3]]],  # right on 0, 2
               "base": [flip[g] for g in gold]}  # right on none
    final = tmp_path / "final"
    for model, predictions in answers.items():
        run = final / "runs" / f"{model}-explorative"
        run.mkdir(parents=True)
        evaluation = {"task": "toy", "seed": 100, "test_k": 4, "test_seed": 3, "strategy": "explorative"}
        (run / "config.json").write_text(json.dumps({"icrl_eval": evaluation, "data": {"tasks_dir": str(tasks_dir)}}))
        (run / "tests.jsonl").write_text(json.dumps({"step": 999, "predictions": predictions}) + "\n")
        accuracy = sum(p == g for p, g in zip(predictions, gold)) / 4
        (run / "metrics.json").write_text(json.dumps({"test_accuracy": {"999": accuracy}, "seconds": 600.0}))
        (run / "steps.jsonl").write_text(json.dumps({"gold": "a", "prediction": "a", "reward": 1}) + "\n")
    assert collect_recipe.main(["--final", f"trec_fine={final}"]) == 0
    entry = json.loads(results.read_text())["final_tests"]["trec_fine"]
    trained_start = entry["paired"]["explorative"]["trained-start"]
    # only RL right on queries 1 and 3, only the bootstrap on query 2: (2 - 1) / 4, sqrt(3 - 1/4) / 4
    assert (trained_start["only_first"], trained_start["only_second"], trained_start["step"]) == (2, 1, 999)
    assert trained_start["difference"] == pytest.approx(0.25)
    assert trained_start["standard_error"] == pytest.approx((3 - 1 / 4) ** 0.5 / 4)
    assert entry["paired"]["explorative"]["start-base"]["difference"] == pytest.approx(0.5)
    assert entry["paired"]["explorative"]["trained-base"]["difference"] == pytest.approx(0.75)
    assert entry["run_minutes"] == {"base-explorative": 10.0, "start-explorative": 10.0, "trained-explorative": 10.0}

    other = json.loads((final / "runs" / "base-explorative" / "config.json").read_text())
    other["icrl_eval"]["seed"] = 101  # not the same stream: not a paired measurement
    (final / "runs" / "base-explorative" / "config.json").write_text(json.dumps(other))
    before = results.read_bytes()
    assert collect_recipe.main(["--final", f"trec_fine={final}"]) == 2
    assert results.read_bytes() == before

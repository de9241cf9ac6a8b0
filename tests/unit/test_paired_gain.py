"""experiments/icrl_stream_rl/paired_gain.py: the paired RL-minus-bootstrap test difference of a gate's two runs and
its standard error, against hand-computed values and on run folders laid out as the evaluate stage writes them."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from tests.conftest import ROOT, write_toy_task

_spec = importlib.util.spec_from_file_location("paired_gain",
                                               ROOT / "experiments" / "icrl_stream_rl" / "paired_gain.py")
paired_gain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(paired_gain)


def test_paired_difference_by_hand():
    # b = 2 (queries 1 and 4 only the RL run got right), c = 1 (query 2), n = 5
    out = paired_gain.paired_difference([1, 1, 0, 0, 1], [1, 0, 1, 0, 0])
    assert (out["only_trained"], out["only_start"], out["n"]) == (2, 1, 5)
    assert out["difference"] == pytest.approx(0.2) and out["trained"] == 0.6 and out["start"] == 0.4
    assert out["standard_error"] == pytest.approx(math.sqrt(3 - 1 / 5) / 5)  # 0.3347
    same = paired_gain.paired_difference([1, 0, 1], [1, 0, 1])
    assert same["difference"] == 0 and same["standard_error"] == 0


def _run(folder, name, tasks_dir, seed, predictions_by_step):
    run = folder / "runs" / name
    run.mkdir(parents=True)
    evaluation = {"task": "toy", "seed": seed, "test_k": 4, "test_seed": 3, "strategy": "explorative"}
    (run / "config.json").write_text(json.dumps({"icrl_eval": evaluation, "data": {"tasks_dir": str(tasks_dir)}}))
    (run / "tests.jsonl").write_text("".join(json.dumps({"step": step, "predictions": predictions}) + "\n"
                                             for step, predictions in predictions_by_step.items()))


def test_a_gate_folder_pairs_the_two_runs_on_the_same_test_queries(tmp_path, capsys):
    tasks_dir = write_toy_task(tmp_path, 6)
    gold = [e.label for e in paired_gain.load_task_from_dir("toy", tasks_dir).test_set(4, 3)]
    flip = {"yes": "no", "no": "yes"}
    trained = [gold[0], gold[1], flip[gold[2]], gold[3]]  # right on 0, 1, 3
    start = [gold[0], flip[gold[1]], gold[2], flip[gold[3]]]  # right on 0, 2
    gate = tmp_path / "gate"
    _run(gate, "trained-explorative", tasks_dir, 7, {0: start, 999: trained})
    _run(gate, "start-explorative", tasks_dir, 7, {0: start, 999: start})
    output = tmp_path / "paired.json"
    assert paired_gain.main([str(gate), "--output", str(output)]) == 0
    row = json.loads(output.read_text())[str(gate)]
    assert row["seed"] == 7 and row["steps"]["0"]["difference"] == 0
    last = row["steps"]["999"]
    assert (last["only_trained"], last["only_start"], last["difference"]) == (2, 1, 0.25)
    assert "difference +0.250" in capsys.readouterr().out

    other = tmp_path / "other"  # runs at two different seeds are not a paired measurement: one message, exit 2
    _run(other, "trained-explorative", tasks_dir, 7, {999: trained})
    _run(other, "start-explorative", tasks_dir, 8, {999: start})
    assert paired_gain.main([str(other)]) == 2
    assert "not a paired measurement" in capsys.readouterr().err
    assert paired_gain.main([str(tmp_path / "missing")]) == 2
    assert paired_gain.main([]) == 2

    # two run folders named directly (the parked run store's layout) pair the same way
    runs = gate / "runs"
    assert paired_gain.main(["--pair", str(runs / "trained-explorative"), str(runs / "start-explorative"),
                             "--output", str(output)]) == 0
    assert json.loads(output.read_text()).popitem()[1]["steps"]["999"]["difference"] == 0.25

"""The demo's closing sentences say plainly whether the trained policy is a better in-context RL learner on the
unseen rule, with the forgetting check, and are written to metrics/demo.json."""

from __future__ import annotations

import json

import pytest

from tasks.demo import DEMO_METRICS, summary_lines, write_demo_summary
from tasks.settings import load_config


def _evaluation(base: float, trained: float, drop: float) -> dict:
    return {"base_final_test_accuracy": base, "trained_final_test_accuracy": trained, "gain": trained - base,
            "forgetting_base_accuracy": 0.6, "forgetting_trained_accuracy": 0.6 - drop, "forgetting_drop": drop,
            "eligible": drop <= 0.02 and trained > base}


def _write(root, evaluation: dict, promotion: dict | None) -> None:
    (root / "artifacts" / "evaluate").mkdir(parents=True)
    (root / "artifacts" / "evaluate" / "metrics.json").write_text(json.dumps(evaluation))
    if promotion is not None:
        (root / "metrics").mkdir()
        (root / "metrics" / "promote.json").write_text(json.dumps(promotion))


def test_a_gain_with_ability_kept_is_said_and_written(tmp_path):
    config = load_config(None, ["icrl_eval.task=keyword_map", "icrl_eval.task_seed=1", "icrl_eval.train_k=80",
                                "evaluate.forgetting_questions=40", "model.dtype=float32"], environ={})
    _write(tmp_path, _evaluation(0.25, 0.40, 0.0), {"version": "3", "alias": "champion", "eligible": True})
    lines = write_demo_summary(config, tmp_path)
    assert "base 0.250 -> trained 0.400 (+0.150)" in lines[0] and "after step 79" in lines[0]
    assert "task seed 1" in lines[0] and "float32" in lines[0]
    assert "base 0.600 -> trained 0.600 (+0.000;" in lines[1]
    assert lines[2].startswith("The trained policy learns the unseen rule") and "kept" in lines[2]
    assert "version 3 as 'champion'" in lines[3] and "passed" in lines[3]
    written = json.loads((tmp_path / DEMO_METRICS).read_text())
    assert written["printed"] == lines and written["headline"]["gain"] == pytest.approx(0.15)


def test_the_start_adapter_says_which_stage_carries_the_gain():
    headline = {"task": "keyword_map", "strategy": "explorative", "step": 79, "test_queries": 40, "seed": 100,
                "dtype": "float32", "base": 0.175, "trained": 0.525, "gain": 0.35, "start": 0.55,
                "start_adapter": "artifacts/bootstrap/adapter"}
    lines = summary_lines(headline, "icrl-policy")
    assert "(artifacts/bootstrap/adapter) scores 0.550: the RL stage did not add to it (-0.025)" in lines[1]
    lines = summary_lines({**headline, "start": 0.5}, "icrl-policy")
    assert "the RL stage added to it (+0.025)" in lines[1]


def test_no_gain_is_said_plainly():
    headline = {"task": "keyword_map", "strategy": "explorative", "step": 79, "test_queries": 40, "seed": 100,
                "dtype": "float32", "base": 0.3, "trained": 0.25, "gain": -0.05}
    lines = summary_lines(headline, "icrl-policy")
    assert "NOT a better in-context RL learner" in lines[-1]


def test_a_gain_with_ability_lost_says_so():
    headline = {"task": "keyword_map", "strategy": "explorative", "step": 79, "test_queries": 40, "seed": 100,
                "dtype": "float32", "base": 0.3, "trained": 0.5, "gain": 0.2, "general_questions": 40,
                "base_general": 0.6, "trained_general": 0.4, "general_drop": 0.2, "max_forgetting": 0.02}
    lines = summary_lines(headline, "icrl-policy")
    assert "lost general ability" in lines[-1]

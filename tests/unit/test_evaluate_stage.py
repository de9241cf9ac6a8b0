"""The evaluate stage's parts: per-strategy settings, the promotion gates (held-out gain, gain over the model's
own zero-shot, forgetting), the order runs start in, how many processes the jobs get, result keys by adapter bytes, and a bad feedback-probe label
refused before any run.
Evaluation runs (process pool, streams, resume, reuse): tests/integration/test_evaluate_stage.py."""

from __future__ import annotations

from pathlib import Path

from icrl_core.config import EvaluateConfig
from tasks.evaluate import _eval_config, gates, pool_waves, run_order
from tasks.settings import load_config


def _configs(folder: Path) -> list:
    base = ["model.spec=tiny", "tracking.enabled=false", "icrl_eval.task=keyword_map", "icrl_eval.train_k=8",
            "icrl_eval.test_every=4", "icrl_eval.test_k=6", "icrl_eval.temperature=1.0",
            f"icrl_eval.output_dir={folder}"]
    return [load_config(None, base + [f"icrl_eval.strategy={s}", f"icrl_eval.run_name={s}"], environ={})
            for s in ("explorative", "naive", "zero_shot")]


def test_a_strategy_may_explore_hotter_while_every_run_is_tested_alike():
    config = load_config(None, ["icrl_eval.temperature=1.0", "evaluate.temperatures={explorative: 2.0}"],
                         environ={})
    hot = _eval_config(config, "explorative", "trained", Path("adapter"))
    naive = _eval_config(config, "naive", "base", None)
    assert (hot.icrl_eval.temperature, hot.icrl_eval.test_temperature) == (2.0, 1.0)
    assert (naive.icrl_eval.temperature, naive.icrl_eval.test_temperature) == (1.0, None)  # tested at 1.0 too
    assert hot.model.init_adapter == Path("adapter") and naive.model.init_adapter is None
    fixed = load_config(None, ["icrl_eval.test_temperature=0", "evaluate.temperatures={explorative: 2.0}"],
                        environ={})
    assert _eval_config(fixed, "explorative", "base", None).icrl_eval.test_temperature == 0.0


def test_the_trained_adapters_runs_start_before_the_base_models():
    config = load_config(None, [], environ={})
    jobs = [(s, which, adapter) for s in ("explorative", "naive") for which, adapter in
            (("base", None), ("trained", Path("trained")), ("start", Path("start")))]
    configs = [_eval_config(config, *job) for job in jobs]
    assert [jobs[i][:2] for i in run_order(configs)] == [
        ("explorative", "trained"), ("explorative", "start"), ("naive", "trained"), ("naive", "start"),
        ("explorative", "base"), ("naive", "base")]


def test_runs_go_in_waves_of_workers_and_a_lone_run_gets_the_whole_machine():
    """(job indices, processes) per wave: a lone run's measurements run in turn after it; a third run on two
    workers waits for the first two and then has both cores, instead of one thread for its whole length."""
    assert pool_waves(["run", "ability", "ability"], 2) == [([0, 1, 2], 1)]
    assert pool_waves(["run"], 2) == [([0], 1)]
    assert pool_waves(["run", "run", "ability"], 2) == [([0, 1, 2], 2)]  # runs side by side, one thread each
    assert pool_waves(["ability", "ability"], 2) == [([0, 1], 2)]
    assert pool_waves(["run", "run", "run", "ability"], 2) == [([0, 1], 2), ([2, 3], 1)]
    assert pool_waves(["run", "run", "run", "run"], 2) == [([0, 1], 2), ([2, 3], 2)]
    assert pool_waves(["run", "run", "run"], 1) == [([0], 1), ([1], 1), ([2], 1)]
    assert pool_waves([], 2) == []


def test_promotion_gates():
    cfg = EvaluateConfig(min_gain=0.0, max_forgetting=0.02, min_gain_over_zero_shot=0.15)
    good = {"gain": 0.1, "forgetting_drop": 0.01, "trained_zero_shot_final_test_accuracy": 0.2,
            "gain_over_zero_shot": 0.15}
    assert gates(good, cfg) == {"passes_gain": True, "passes_forgetting": True, "passes_gain_over_zero_shot": True,
                                "eligible": True}
    assert not gates({**good, "gain": 0.0}, cfg)["eligible"]  # the gain must be positive
    assert not gates({**good, "forgetting_drop": 0.03}, cfg)["eligible"]
    assert not gates({**good, "gain_over_zero_shot": 0.1}, cfg)["eligible"]
    # without a zero-shot run (or without the requirement) only the gain and forgetting count
    no_zero_shot = {"gain": 0.1, "forgetting_drop": 0.0}
    assert gates(no_zero_shot, cfg) == {"passes_gain": True, "passes_forgetting": True, "eligible": True}
    # the multiple-choice probe, when measured, must stay within max_forgetting either way
    probed = gates({**no_zero_shot, "forgetting_probe_change": -0.015}, cfg)
    assert probed["passes_forgetting_probe"] and probed["eligible"]
    assert gates({**no_zero_shot, "forgetting_probe_change": 0.02}, cfg)["eligible"]
    assert not gates({**no_zero_shot, "forgetting_probe_change": -0.03}, cfg)["eligible"]
    assert not gates({**no_zero_shot, "forgetting_probe_change": 0.025}, cfg)["eligible"]  # a move, not a drop


def test_a_trained_adapter_is_known_by_its_bytes_not_its_path(in_tmp):
    import shutil

    from icrl_core.model import policy_from_config
    from tasks.evaluate import result_key
    from tasks.settings import with_overrides

    config = _configs(in_tmp / "runs")[0]
    policy = policy_from_config(config.model)
    policy.save_adapter(in_tmp / "a")
    shutil.copytree(in_tmp / "a", in_tmp / "b")
    key = {name: result_key(with_overrides(config, {"model.init_adapter": str(in_tmp / name)})) for name in "ab"}
    assert key["a"] == key["b"] != result_key(config)
    with open(in_tmp / "b" / "adapter_model.safetensors", "r+b") as handle:  # retrained in place: other bytes
        handle.seek(-1, 2)
        last = handle.read(1)
        handle.seek(-1, 2)
        handle.write(bytes([last[0] ^ 1]))
    assert result_key(with_overrides(config, {"model.init_adapter": str(in_tmp / "b")})) != key["a"]


def test_a_feedback_probe_label_the_task_lacks_fails_before_any_run(in_tmp):
    import pytest

    import tasks.evaluate as stage
    from icrl_core.errors import UserError
    from icrl_core.model import policy_from_config

    config = load_config(None, ["model.spec=tiny", "tracking.enabled=false", "icrl_eval.task=keyword_map",
                                f"evaluate.adapter={in_tmp / 'adapter'}", "evaluate.feedback_probe_target=entity"],
                         environ={})
    policy_from_config(config.model).save_adapter(in_tmp / "adapter")
    with pytest.raises(UserError, match="'entity' is not a label of task 'keyword_map'"):
        stage.run(config)
    assert not (in_tmp / ".icrl" / "evaluations").exists()  # no run started

"""The evaluate stage's evaluation runs (tiny model): runs in a process pool or as streams of one engine give
exactly what they give one after another, finished runs and forgetting measurements are reused, and an
interrupted run resumes from its log. The stage's parts: tests/unit/test_evaluate_stage.py."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.evaluate import run_evaluations
from tasks.settings import load_config, with_overrides
from tests.conftest import perturb_lora_b
from tests.unit.test_evaluate_stage import _configs


def _steps(run_dir: str) -> list[dict]:
    rows = [json.loads(line) for line in Path(run_dir, "steps.jsonl").read_text().splitlines()]
    return [{k: row[k] for k in ("step", "query", "prediction", "reward", "context")} for row in rows]


def _interrupted_at_step_3(config) -> None:
    """Run `config` in its work folder and interrupt it at its first test (step 3), as a SIGINT would mid-run (a
    SIGKILL loses at most the step in progress): its log stays in the work folder."""
    from tasks.evaluate import work_config
    from tasks.icrl_eval import evaluate

    def killed(record):
        if record["step"] == 3:
            raise KeyboardInterrupt

    try:
        evaluate(work_config(config), progress=False, on_test=killed)
    except KeyboardInterrupt:
        pass


def test_runs_in_a_process_pool_equal_runs_in_turn(tmp_path):
    in_turn = run_evaluations(_configs(tmp_path / "serial"), workers=1)
    pooled = run_evaluations(_configs(tmp_path / "pool"), workers=2)
    assert [r["strategy"] for r in pooled] == ["explorative", "naive", "zero_shot"]  # order of the configs
    for a, b in zip(in_turn, pooled):
        assert a["test_accuracy"] == b["test_accuracy"] and a["regret"] == b["regret"]
        assert _steps(a["run_dir"]) == _steps(b["run_dir"])


def test_runs_as_streams_of_one_engine_equal_runs_in_turn(tmp_path):
    """inference.streams: three runs through one engine from three threads; exact, and with their passes fused."""
    in_turn = run_evaluations(_configs(tmp_path / "serial"), workers=1)
    for mode, fuse in (("streams", "false"), ("fused", "true")):
        configs = [with_overrides(c, {"inference.streams": 3, "inference.fuse_streams": fuse})
                   for c in _configs(tmp_path / mode)]
        streamed = run_evaluations(configs, workers=1)
        assert [r["strategy"] for r in streamed] == ["explorative", "naive", "zero_shot"]
        for a, b in zip(in_turn, streamed):
            assert _steps(a["run_dir"]) == _steps(b["run_dir"])
            assert a["test_accuracy"] == b["test_accuracy"]


def test_finished_base_runs_are_reused_while_nothing_they_depend_on_changes(in_tmp):
    from tasks.evaluate import cached_result, result_key, store_result
    from tasks.icrl_eval import evaluate
    from tasks.settings import with_overrides

    config = _configs(in_tmp / "runs")[0]
    assert cached_result(config) is None
    first = evaluate(config, progress=False)
    store_result(config, Path(first["run_dir"]))
    # speed-only settings and the run folder do not matter; the seed, the model and the settings do
    assert result_key(with_overrides(config, {"icrl_eval.threads": 1, "icrl_eval.run_name": "x"})) == \
        result_key(config)
    for change in ({"seed": 1}, {"icrl_eval.seed": 7}, {"icrl_eval.p_keep": 0.5}, {"model.dtype": "bfloat16"}):
        assert result_key(with_overrides(config, change)) != result_key(config), change
    moved = with_overrides(config, {"icrl_eval.output_dir": str(in_tmp / "elsewhere")})
    reused = cached_result(moved)
    assert reused["cached"] and reused["test_accuracy"] == first["test_accuracy"]
    assert _steps(reused["run_dir"]) == _steps(first["run_dir"])
    assert Path(reused["run_dir"]).parent == in_tmp / "elsewhere"


def test_a_killed_stage_resumes_its_evaluation_runs_from_their_logs(in_tmp):
    """DVC deletes a stage's outs before it runs again, so runs are computed in work folders outside them: a run
    interrupted at its first test continues from its log and logs what an uninterrupted run logs."""
    from tasks.evaluate import evaluation_results

    configs = _configs(in_tmp / "runs")[:2]
    reference = run_evaluations(_configs(in_tmp / "reference")[:2], workers=1)

    _interrupted_at_step_3(configs[0])
    results, resumed, _ = evaluation_results(configs, workers=1, reuse=True)
    assert resumed == 1
    for done, expected in zip(results, reference):
        assert Path(done["run_dir"]).parent == in_tmp / "runs"  # delivered into the stage's own folder
        assert done["test_accuracy"] == expected["test_accuracy"]
        assert _steps(done["run_dir"]) == _steps(expected["run_dir"])
    assert json.loads(Path(results[0]["run_dir"], "run.json").read_text())["resumed_at_step"] == 3
    # finished runs are stored and their work folders removed; a second stage run reuses them all
    assert not any((in_tmp / ".icrl" / "evaluations" / "partial").iterdir())
    again, resumed, _ = evaluation_results(configs, workers=1, reuse=True)
    assert resumed == 0 and all(r["cached"] for r in again)


def test_forgetting_measurements_are_kept_and_reused(in_tmp, monkeypatch):
    import tasks.evaluate as stage

    config = load_config(None, ["model.spec=tiny", "evaluate.forgetting_questions=2",
                                "evaluate.forgetting_max_new_tokens=4", "evaluate.forgetting_probe_items=3"],
                         environ={})
    first = stage.general_ability(config, None)
    assert len(first["greedy"]["answers"]) == 2 and len(first["probe"]["correct"]) == 3
    monkeypatch.setattr(stage, "_policy", lambda *args: (_ for _ in ()).throw(AssertionError("measured again")))
    assert stage.general_ability(config, None) == first
    changed = load_config(None, ["model.spec=tiny", "evaluate.forgetting_questions=2",
                                 "evaluate.forgetting_max_new_tokens=5", "evaluate.forgetting_probe_items=3"],
                          environ={})
    keys, changed_keys = stage.ability_keys(config, None), stage.ability_keys(changed, None)
    assert set(keys) == {"greedy", "probe"}
    assert changed_keys["greedy"] != keys["greedy"] and changed_keys["probe"] == keys["probe"]
    fresh = load_config(None, ["model.spec=tiny", "evaluate.forgetting_questions=2",
                               "evaluate.forgetting_max_new_tokens=4", "evaluate.forgetting_probe_items=3",
                               "evaluate.reuse_runs=false"], environ={})
    try:
        stage.general_ability(fresh, None)
    except AssertionError as error:
        assert "measured again" in str(error)  # reuse_runs false measures again
    else:
        raise AssertionError("reuse_runs=false reused the stored measurement")


def test_seeds_share_the_forgetting_measures_and_not_the_feedback_probe(in_tmp, monkeypatch):
    """The greedy check and the choice probe do not depend on the evaluation seed: another seed's stage run reuses
    them and measures only its own feedback probe. Measurements kept together under one key (before per-measure
    keys) are read and split, not measured again."""
    import json

    import tasks.evaluate as stage
    from icrl_core.io import atomic_write_json

    settings = ["model.spec=tiny", "evaluate.forgetting_questions=2", "evaluate.forgetting_max_new_tokens=4",
                "evaluate.forgetting_probe_items=3", "evaluate.feedback_probe_target=brom",
                "evaluate.feedback_probe_queries=2", "evaluate.feedback_probe_attempts=[1]",
                "icrl_eval.task=keyword_map"]
    seed_100 = load_config(None, settings + ["icrl_eval.seed=100"], environ={})
    seed_101 = load_config(None, settings + ["icrl_eval.seed=101"], environ={})
    first = stage.general_ability(seed_100, None)
    keys_100, keys_101 = stage.ability_keys(seed_100, None), stage.ability_keys(seed_101, None)
    assert keys_100["greedy"] == keys_101["greedy"] and keys_100["probe"] == keys_101["probe"]
    assert keys_100["feedback"] != keys_101["feedback"]

    measured = []
    monkeypatch.setattr(stage, "forgetting", lambda *a, **k: measured.append("greedy"))
    monkeypatch.setattr(stage, "forgetting_probe", lambda *a, **k: measured.append("probe"))
    second = stage.general_ability(seed_101, None)
    assert measured == [] and second["greedy"] == first["greedy"] and second["probe"] == first["probe"]
    assert second["feedback"] is not None

    kept = in_tmp / ".icrl" / "evaluations" / "ability"
    for entry in kept.iterdir():
        entry.unlink()
    atomic_write_json(kept / f"{stage._combined_ability_key(seed_100, None)}.json", first)
    monkeypatch.setattr(stage, "_policy", lambda *args: (_ for _ in ()).throw(AssertionError("measured again")))
    assert stage.general_ability(seed_100, None) == first
    assert json.loads((kept / f"greedy-{keys_100['greedy']}.json").read_text()) == first["greedy"]


def test_runs_and_forgetting_measurements_share_one_pool(in_tmp):
    """Each model's forgetting measurements are pool jobs beside the runs: pooled, they equal what the stage
    measures in its own process, and they are kept for the next stage run."""
    import tasks.evaluate as stage

    stage_config = load_config(None, ["model.spec=tiny", "evaluate.forgetting_questions=2",
                                      "evaluate.forgetting_max_new_tokens=4", "evaluate.forgetting_probe_items=3"],
                               environ={})
    configs = _configs(in_tmp / "runs")[1:]  # naive, zero_shot
    results, resumed, abilities = stage.evaluation_results(configs, workers=2, reuse=True, config=stage_config,
                                                           ability_adapters=(None,))
    assert [r["strategy"] for r in results] == ["naive", "zero_shot"] and resumed == 0
    kept = in_tmp / ".icrl" / "evaluations" / "ability"
    assert sorted(kept.iterdir()) == sorted(kept / f"{measure}-{key}.json"
                                            for measure, key in stage.ability_keys(stage_config, None).items())
    fresh = load_config(None, ["model.spec=tiny", "evaluate.forgetting_questions=2",
                               "evaluate.forgetting_max_new_tokens=4", "evaluate.forgetting_probe_items=3",
                               "evaluate.reuse_runs=false"], environ={})
    assert abilities == [stage.general_ability(fresh, None)]  # measured here again: the same
    again, _, kept = stage.evaluation_results(configs, workers=2, reuse=True, config=stage_config,
                                              ability_adapters=(None,))
    assert all(r["cached"] for r in again) and kept == abilities


def test_a_run_resumes_after_its_adapter_moved(in_tmp):
    """The work folder is named by the adapter's bytes, so a run of a moved (same-bytes) adapter resumes."""
    import shutil

    from icrl_core.model import policy_from_config
    from tasks.evaluate import evaluation_results
    from tasks.settings import with_overrides

    config = _configs(in_tmp / "runs")[1]
    policy_from_config(config.model).save_adapter(in_tmp / "first")
    at_first = with_overrides(config, {"model.init_adapter": str(in_tmp / "first")})

    _interrupted_at_step_3(at_first)
    shutil.move(in_tmp / "first", in_tmp / "moved")
    moved = with_overrides(config, {"model.init_adapter": str(in_tmp / "moved")})
    (done,), resumed, _ = evaluation_results([moved], workers=1, reuse=True)
    assert resumed == 1
    assert json.loads(Path(done["run_dir"], "run.json").read_text())["resumed_at_step"] == 3


def test_a_run_that_cannot_resume_a_superseded_partial_run_says_so(in_tmp, caplog):
    """A partial run parked before the harness code changed has another result key: the run starts from step 0,
    and the stage names the partial run it could not resume instead of restarting silently."""
    import logging
    import shutil

    from tasks.evaluate import RESULT_CACHE, evaluation_results, result_key

    config = _configs(in_tmp / "runs")[1]

    _interrupted_at_step_3(config)
    stale = "0" * 24  # the key the run had under the code it was parked with
    shutil.move(RESULT_CACHE / "partial" / result_key(config), RESULT_CACHE / "partial" / stale)
    with caplog.at_level(logging.WARNING, logger="tasks.evaluate"):
        (done,), resumed, _ = evaluation_results([config], workers=1, reuse=True)
    assert resumed == 0 and json.loads(Path(done["run_dir"], "run.json").read_text())["resumed_at_step"] is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "starts from step 0" in warning and stale in warning and "3 steps logged" in warning
    assert (RESULT_CACHE / "partial" / stale).is_dir()  # left for its owner, not deleted


def test_the_adapter_training_started_from_is_evaluated_alike_and_gated(in_tmp):
    """evaluate.start_adapter: the start adapter (the bootstrap, when RL trains on top of it) runs with the same
    strategies and seeds as the trained one, gain_over_start is their difference, and min_gain_over_start gates
    promotion on it."""
    import tasks.evaluate as stage
    from icrl_core.config import EvaluateConfig, LoraAdapter
    from icrl_core.model import policy_from_config
    from tasks.evaluate import gates

    config = load_config(None, ["model.spec=tiny", "tracking.enabled=false", "icrl_eval.task=keyword_map",
                                "icrl_eval.train_k=6", "icrl_eval.test_every=3", "icrl_eval.test_k=4",
                                "evaluate.strategies=[explorative]", "evaluate.workers=1",
                                "evaluate.forgetting_questions=0", "evaluate.forgetting_probe_items=0",
                                f"evaluate.adapter={in_tmp / 'rl'}", f"evaluate.start_adapter={in_tmp / 'start'}",
                                "evaluate.min_gain_over_start=0.0", f"evaluate.output_dir={in_tmp / 'evaluate'}"],
                         environ={})
    for name, seed in (("start", 1), ("rl", 2)):
        policy = policy_from_config(config.model.model_copy(update={"adapter": LoraAdapter(rank=4)}), seed=seed)
        perturb_lora_b(policy, std=0.5, seed=seed)
        policy.save_adapter(in_tmp / name)
    metrics = stage.run(config)
    assert {"start_explorative_final_test_accuracy", "start_final_test_accuracy", "gain_over_start"} <= set(metrics)
    for which in ("start", "trained"):   # beside each accuracy: whether the run copied one answer whatever the reward
        run = json.loads((in_tmp / "evaluate" / "runs" / f"{which}-explorative" / "metrics.json").read_text())
        assert metrics[f"{which}_explorative_repeat_after_wrong"] == run["repeat_after_wrong"] is not None
    assert metrics["gain_over_start"] == metrics["trained_final_test_accuracy"] - metrics["start_final_test_accuracy"]
    assert metrics["passes_gain_over_start"] == (metrics["gain_over_start"] > 0.0)
    assert (in_tmp / "evaluate" / "runs" / "start-explorative" / "metrics.json").exists()
    cfg = EvaluateConfig(min_gain_over_start=0.05)
    assert not gates({"gain": 0.1, "gain_over_start": 0.05}, cfg)["eligible"]
    assert gates({"gain": 0.1, "gain_over_start": 0.06}, cfg)["eligible"]

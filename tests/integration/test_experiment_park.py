"""experiments/icrl_stream_rl/run.sh park / unpark (addendum 23): a run that cannot finish inside a session parks
each stage's latest checkpoint, an unfinished target's trained outputs and the evaluation work folders beside the
script, and the next session's training target restores them before it starts: the stage resumes from its
checkpoint, a trained stage is not trained again, an evaluation goes on from its log. The script runs for real in
a copy of the project layout; `icrl` is a stand-in that records its calls (what it runs is tested elsewhere), except `icrl redact`."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, TASKS_DIR

pytestmark = pytest.mark.integration

SCRIPT = Path("experiments/icrl_stream_rl/run.sh")
PARKED = Path("experiments/icrl_stream_rl/checkpoints")


@pytest.fixture
def project(tmp_path) -> Path:
    """The script in a copy of the project's layout, with `icrl` a stand-in that appends its arguments to a log."""
    (tmp_path / SCRIPT).parent.mkdir(parents=True)
    shutil.copy2(ROOT / SCRIPT, tmp_path / SCRIPT)
    # park merges the evaluation run store with this script, run by the project's python
    shutil.copy2(ROOT / SCRIPT.parent / "park_evaluations.py", tmp_path / SCRIPT.parent / "park_evaluations.py")
    # the probe checks' thresholds (collect.CHECK_P), read by the script
    shutil.copy2(ROOT / SCRIPT.parent / "collect.py", tmp_path / SCRIPT.parent / "collect.py")
    stub = tmp_path / ".venv" / "bin" / "icrl"
    stub.parent.mkdir(parents=True)
    # a wrapper, not a symlink: a symlinked interpreter outside its venv would lose the venv's packages (icrl_core,
    # which collect.py imports for the probe checks)
    python = stub.parent / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    real = Path(sys.executable).parent / "icrl"  # `icrl redact` (park's copy of the evaluation logs) and `icrl
    # check-text` (park's search of what it parked for the datasets' texts) run for real
    stub.write_text(f'#!/bin/sh\n[ "$1" = redact ] && exec {real} "$@"\n'
                    f'[ "$1" = check-text ] && exec {real} "$@" --tasks-dir {TASKS_DIR}\n'
                    'echo "$@" >> "$(dirname "$0")/calls.log"\n')
    stub.chmod(0o755)
    return tmp_path


def _calls(project: Path) -> list[str]:
    return (project / ".venv" / "bin" / "calls.log").read_text().splitlines()


def _run(project: Path, *targets: str, **env: str) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", str(project / SCRIPT), *targets], cwd=project, capture_output=True, text=True,
                            check=False, timeout=60, env={**os.environ, "PATH": os.environ.get("PATH", ""), **env})
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _checkpoint(folder: Path, marker: str, name: str = "state.safetensors") -> None:
    folder.mkdir(parents=True)
    (folder / name).write_text(marker)


def test_park_keeps_the_latest_checkpoint_and_a_training_target_restores_it(project):
    run = project / ".icrl" / "checkpoints" / "ppo-0123abcd"
    _checkpoint(run / "step-00000003", "3")
    _checkpoint(run / "step-00000004", "4")
    (run / ".step-00000005.123.tmp").mkdir()  # a checkpoint being written when the run was killed
    (project / ".icrl" / "checkpoints" / "dpo-4567ef01").mkdir()  # a stage with no checkpoint yet

    parked = _run(project, "park")
    assert sorted(p.name for p in (project / PARKED).iterdir()) == ["ppo-0123abcd"], parked.stdout
    assert [p.name for p in (project / PARKED / "ppo-0123abcd").iterdir()] == ["step-00000004"]
    assert (project / PARKED / "ppo-0123abcd" / "step-00000004" / "state.safetensors").read_text() == "4"

    # the next session: a fresh working tree holds only what was committed
    shutil.rmtree(project / ".icrl")
    resumed = _run(project, "s15")
    restored = project / ".icrl" / "checkpoints" / "ppo-0123abcd" / "step-00000004" / "state.safetensors"
    assert restored.read_text() == "4" and "restored the parked checkpoint" in resumed.stdout
    calls = _calls(project)
    assert calls[0].startswith("stage ppo ") and calls[1].startswith("stage evaluate ")
    # ... once: after the run went on (newer checkpoints, the parked step rotated away) a target leaves it alone
    _checkpoint(project / ".icrl" / "checkpoints" / "ppo-0123abcd" / "step-00000006", "6")
    shutil.rmtree(project / ".icrl" / "checkpoints" / "ppo-0123abcd" / "step-00000004")
    again = _run(project, "s15")
    assert "restored" not in again.stdout
    assert [p.name for p in (project / ".icrl" / "checkpoints" / "ppo-0123abcd").iterdir()] == ["step-00000006"]
    _run(project, "park")
    assert [p.name for p in (project / PARKED / "ppo-0123abcd").iterdir()] == ["step-00000006"]


def test_a_trained_target_is_parked_until_it_finishes_and_not_trained_again(project):
    trained = project / "artifacts" / "explorative_streams"
    _checkpoint(trained / "adapter", "weights", "adapter_model.safetensors")
    (trained / "history.json").write_text("[]")
    # a finished target (its last file written): not parked
    _checkpoint(project / "artifacts" / "dpo_one_stage" / "adapter", "s14", "adapter_model.safetensors")
    (project / "runs" / "s14").mkdir(parents=True)
    (project / "runs" / "s14" / "probe.json").write_text("{}")
    partial = project / ".icrl" / "evaluations" / "partial" / "k1" / "steps.jsonl"
    partial.parent.mkdir(parents=True)
    step = {"step": 0, "query": "How far is the moon ?", "gold": "numeric", "prediction": "entity", "reward": 0}
    partial.write_text(json.dumps(step) + "\n")
    (partial.parent / "tests.jsonl").write_text('{"step": 0, "accuracy": 0.5}\n')

    _run(project, "park")
    assert sorted(p.name for p in (project / PARKED / "artifacts").iterdir()) == ["explorative_streams"]
    parked_log = project / PARKED / "evaluations" / "partial" / "k1"
    # the query's text stays out of what is committed: its digest stands in (the run resumes from it)
    assert json.loads((parked_log / "steps.jsonl").read_text()) == {
        "step": 0, "query_sha256": hashlib.sha256(b"How far is the moon ?").hexdigest()[:16],
        **{k: v for k, v in step.items() if k not in ("step", "query")}}
    assert (parked_log / "tests.jsonl").read_text() == '{"step": 0, "accuracy": 0.5}\n'

    for folder in ("artifacts", ".icrl", "runs"):  # the next session's fresh working tree
        shutil.rmtree(project / folder)
    resumed = _run(project, "s15")
    assert (trained / "adapter" / "adapter_model.safetensors").read_text() == "weights"
    assert (trained / "history.json").exists() and "not trained again" in resumed.stdout
    assert "moon" not in partial.read_text() and "query_sha256" in partial.read_text()
    calls = _calls(project)
    assert [call.split()[:2] for call in calls] == [["stage", "evaluate"], ["probe-feedback", "--task"]]


def test_park_fails_when_what_it_parks_holds_a_dataset_text(project, tasks_dir):
    from icrl_core.icrl_eval import query_digest

    query = next(json.loads(line)["text"] for line in (tasks_dir / "trec_coarse" / "test.jsonl").open()
                 if len(json.loads(line)["text"].strip()) >= 30)
    trained = project / "artifacts" / "explorative_streams"
    _checkpoint(trained / "adapter", "weights", "adapter_model.safetensors")
    (trained / "history.json").write_text(json.dumps([{"iteration": 1, "sample": query}]))  # e.g. a logged rollout

    result = subprocess.run(["bash", str(project / SCRIPT), "park"], cwd=project, capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert query_digest(query) in " ".join(result.stdout.split()) and query not in result.stdout


def _kept(project: Path, name: str) -> Path:
    """A kept adapter, adapters/NAME: two files, their SHA256SUMS and a README that is not copied."""
    kept = project / "experiments" / "icrl_stream_rl" / "adapters" / name
    kept.mkdir(parents=True)
    sums = []
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        (kept / file).write_text(f"{name} {file}")
        sums.append(f"{hashlib.sha256(f'{name} {file}'.encode()).hexdigest()}  {file}")
    (kept / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    (kept / "README.md").write_text("not copied")
    return kept


def test_a_gate2_part_restores_the_kept_adapters_and_evaluates_one_seed_and_strategy(project):
    kept = _kept(project, "explorative_streams")
    _kept(project, "bootstrap_h32")  # the adapter the part compares with (evaluate.start_adapter)

    parked_log = project / PARKED / "evaluations" / "partial" / "k2" / "steps.jsonl"  # a part cut at a session's end
    parked_log.parent.mkdir(parents=True)
    parked_log.write_text('{"step": 0}\n')
    result = _run(project, "s15-gate2-101-explorative")
    assert (project / ".icrl" / "evaluations" / "partial" / "k2" / "steps.jsonl").exists()  # goes on from its log
    adapter = project / "artifacts" / "explorative_streams" / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert "restored the kept adapter" in result.stdout
    (call,) = _calls(project)
    assert call.startswith("stage evaluate ") and "icrl_eval.seed=101" in call
    assert "evaluate.strategies=[explorative]" in call
    assert "evaluate.output_dir=artifacts/gate2_s15/seed101-explorative" in call
    boot = project / "artifacts" / "bootstrap" / "adapter"
    assert (boot / "adapter_config.json").read_text() == "bootstrap_h32 adapter_config.json"

    _run(project, "park")  # the restored kept adapter is not parked again: the repository holds it
    assert not (project / PARKED / "artifacts").exists()
    assert (project / PARKED / "evaluations" / "partial" / "k2" / "steps.jsonl").exists()

    (kept / "adapter_config.json").write_text("changed")  # a kept adapter that does not verify is never used
    shutil.rmtree(adapter)
    failed = subprocess.run(["bash", str(project / SCRIPT), "s15-forgetting"], cwd=project, capture_output=True,
                            text=True, check=False, timeout=60)
    assert failed.returncode == 1 and "does not match its SHA256SUMS" in failed.stderr
    assert not adapter.exists()


def test_setting_16s_gate2_part_evaluates_its_own_adapter_into_its_own_folder(project):
    _kept(project, "burn_in_streams")
    _kept(project, "bootstrap_h32")
    _run(project, "s16-gate2-102-naive")
    (call,) = _calls(project)
    assert "icrl_eval.seed=102" in call and "evaluate.strategies=[naive]" in call
    assert "evaluate.adapter=artifacts/burn_in_streams/adapter" in call
    assert "evaluate.output_dir=artifacts/gate2_s16/seed102-naive" in call
    assert (project / "artifacts" / "burn_in_streams" / "adapter" / "adapter_model.safetensors").exists()


def test_setting_17_continues_setting_16s_kept_adapter_then_runs_its_gate_e(project):
    _kept(project, "burn_in_streams")
    _kept(project, "bootstrap_h32")
    _run(project, "s17")
    train, gate, probe = _calls(project)
    assert train.startswith("stage ppo ") and train.endswith("-c experiments/icrl_stream_rl/burn_in_streams.yaml "
                                                              "-c experiments/icrl_stream_rl/burn_in_streams_more.yaml")
    assert (project / "artifacts" / "burn_in_streams" / "adapter" / "adapter_model.safetensors").exists()  # its start
    assert gate.startswith("stage evaluate ") and gate.endswith("gate_explorative_s17.yaml")
    assert probe.startswith("probe-feedback ") and "artifacts/burn_in_streams_more/adapter" in probe
    _kept(project, "burn_in_streams_more")  # gate 2 evaluates the adapter kept in the repository
    _run(project, "s17-gate2-100-explorative")
    assert "evaluate.adapter=artifacts/burn_in_streams_more/adapter" in _calls(project)[-1]


def test_a_training_target_restores_its_kept_adapter_instead_of_training_unless_retrain(project):
    _kept(project, "bootstrap_h32")
    _kept(project, "burn_in_streams")
    _run(project, "s16")
    gate, probe = _calls(project)  # no `stage ppo`: the kept adapter is the trained one
    assert gate.startswith("stage evaluate ") and probe.startswith("probe-feedback ")
    restored = project / "artifacts" / "burn_in_streams" / "adapter" / "adapter_model.safetensors"
    assert restored.read_text() == "burn_in_streams adapter_model.safetensors"
    shutil.rmtree(project / "artifacts" / "burn_in_streams")
    _run(project, "s16", RETRAIN="1")
    assert _calls(project)[2].startswith("stage ppo ")  # trained again (the stand-in writes no adapter)


@pytest.mark.parametrize(("setting", "layers", "output", "gate2_part"), [
    ("19", "explorative_streams.yaml -c experiments/icrl_stream_rl/test_reward_streams.yaml", "test_reward_streams",
     "101-explorative"),  # setting 15's recipe with the test reward
    ("20", "burn_in_streams.yaml -c experiments/icrl_stream_rl/six_label_streams.yaml", "six_label_streams",
     "102-explorative"),  # setting 16's recipe on six named labels
])
def test_a_setting_trains_its_layers_then_runs_its_gate_e_and_gate_2_on_its_kept_adapter(project, setting, layers,
                                                                                         output, gate2_part):
    _kept(project, "bootstrap_h32")
    _run(project, f"s{setting}")
    train, gate, probe = _calls(project)
    assert train.startswith("stage ppo ") and train.endswith(f"-c experiments/icrl_stream_rl/{layers}")
    assert gate.startswith("stage evaluate ") and gate.endswith(f"gate_explorative_s{setting}.yaml")
    assert probe.startswith("probe-feedback ") and f"artifacts/{output}/adapter" in probe
    _kept(project, output)  # gate 2 evaluates the adapter kept in the repository
    _run(project, f"s{setting}-gate2-{gate2_part}")
    assert f"evaluate.output_dir=artifacts/gate2_s{setting}/seed{gate2_part}" in _calls(project)[-1]
    assert f"evaluate.adapter=artifacts/{output}/adapter" in _calls(project)[-1]


def _assert_two_seed_gate(setting: str, seed7: str, seed8: str) -> None:
    """run.sh's gate_two_seeds: the setting's gate E layer at seeds 7 and 8, into their own output folders."""
    for seed, call, suffix in ((7, seed7, ""), (8, seed8, "_seed8")):
        assert f"gate_explorative_s{setting}.yaml" in call and f"icrl_eval.seed={seed}" in call
        assert call.endswith(f"evaluate.output_dir=artifacts/gate_explorative_s{setting}{suffix}")


def test_setting_21_gates_on_two_development_seeds_and_evaluates_setting_16_beside_them(project):
    _kept(project, "bootstrap_h32")
    _kept(project, "burn_in_streams")
    _run(project, "s21")
    train, seed7, seed8, setting16, probe = _calls(project)
    assert train.startswith("stage ppo ") and train.endswith("-c experiments/icrl_stream_rl/burn_in_streams.yaml "
                                                              "-c experiments/icrl_stream_rl/many_label_streams.yaml")
    _assert_two_seed_gate("21", seed7, seed8)
    assert "gate_explorative_s21.yaml" not in setting16 and "icrl_eval.seed=8" in setting16  # its adapter: the layer's
    assert setting16.endswith("evaluate.output_dir=artifacts/gate_explorative_s16_seed8")
    assert probe.startswith("probe-feedback ") and "artifacts/many_label_streams/adapter" in probe
    _kept(project, "many_label_streams")
    _run(project, "s21-gate2-100-explorative")
    assert "evaluate.output_dir=artifacts/gate2_s21/seed100-explorative" in _calls(project)[-1]


def test_setting_22_trains_on_wide_groups_then_gates_on_both_development_seeds(project):
    _kept(project, "bootstrap_h32")
    _run(project, "s22")
    train, seed7, seed8, probe = _calls(project)
    assert train.startswith("stage ppo ") and train.endswith("-c experiments/icrl_stream_rl/many_label_streams.yaml "
                                                              "-c experiments/icrl_stream_rl/wide_group_streams.yaml")
    _assert_two_seed_gate("22", seed7, seed8)
    assert probe.startswith("probe-feedback ") and "artifacts/wide_group_streams/adapter" in probe
    _kept(project, "wide_group_streams")
    _run(project, "s22-gate2-101-explorative")
    assert "evaluate.output_dir=artifacts/gate2_s22/seed101-explorative" in _calls(project)[-1]


def test_a_gate2_target_of_a_setting_without_one_is_a_user_error(project):
    failed = subprocess.run(["bash", str(project / SCRIPT), "s14-gate2-100-naive"], cwd=project, capture_output=True,
                            text=True, check=False, timeout=60)
    assert failed.returncode == 2 and "setting 14 has no gate-2 or forgetting targets" in failed.stderr
    assert not (project / ".venv" / "bin" / "calls.log").exists()  # nothing ran


def test_the_work_folder_of_a_stored_run_is_neither_parked_nor_restored(project):
    store = project / ".icrl" / "evaluations"
    for key in ("done", "going"):
        (store / "partial" / key).mkdir(parents=True)
        (store / "partial" / key / "tests.jsonl").write_text('{"step": 0, "accuracy": 0.5}\n')
    (store / "done").mkdir()  # stored: its work folder is stale
    (store / "done" / "metrics.json").write_text("{}")
    _run(project, "park")
    assert sorted(p.name for p in (project / PARKED / "evaluations" / "partial").iterdir()) == ["going"]
    assert not (store / "partial" / "done").exists() and (store / "partial" / "going").exists()
    # a parked store committed earlier still holds the work folder of a run stored since: not restored
    shutil.copytree(store / "partial" / "going", project / PARKED / "evaluations" / "partial" / "done")
    _run(project, "s15")
    assert not (store / "partial" / "done").exists() and (store / "partial" / "going").exists()


def test_a_final_test_evaluates_the_kept_recipe_adapters_on_its_task_with_the_recipe_config(project):
    """Addendum 39: `final-TASK` runs the current recipe's evaluate stage (no h32 layer) with final_tests.yaml on
    the task, the recipe's two kept adapters restored; a task outside the four final tests is a user error."""
    _kept(project, "recipe_bootstrap")
    _kept(project, "recipe_rl")
    _run(project, "final-nlu_unsemantic")
    (call,) = _calls(project)
    assert call.startswith("stage evaluate -c params.yaml -c experiments/icrl_skill.yaml "
                           "-c experiments/icrl_stream_rl/final_tests.yaml")
    assert "h32_ppo.yaml" not in call
    assert call.endswith("icrl_eval.task=nlu_unsemantic --set evaluate.output_dir=artifacts/final_tests/nlu_unsemantic")
    for adapter in ("recipe_bootstrap", "recipe_rl"):
        assert (project / "artifacts" / adapter / "adapter" / "adapter_model.safetensors").exists()
    failed = subprocess.run(["bash", str(project / SCRIPT), "final-trec_coarse"], cwd=project, capture_output=True,
                            text=True, check=False, timeout=60)
    assert failed.returncode == 2 and "final-{trec_fine,trec_fine_unsemantic,nlu,nlu_unsemantic}" in failed.stderr
    assert len(_calls(project)) == 1  # nothing more ran



def test_setting_23_extrapolates_setting_16s_step_from_the_kept_adapters_then_runs_its_two_seed_gate(project):
    _kept(project, "burn_in_streams")
    _kept(project, "bootstrap_h32")
    _run(project, "s23")
    extrapolate, seed7, seed8, probe = _calls(project)
    assert extrapolate == ("model extrapolate artifacts/bootstrap/adapter artifacts/burn_in_streams/adapter "
                           "--scale 2 --output artifacts/extrapolated_streams/adapter")
    assert seed7.startswith("stage evaluate ") and seed7.endswith(
        "gate_explorative_s23.yaml --set icrl_eval.seed=7 --set evaluate.output_dir=artifacts/gate_explorative_s23")
    assert seed8.endswith("--set icrl_eval.seed=8 --set evaluate.output_dir=artifacts/gate_explorative_s23_seed8")
    assert probe.startswith("probe-feedback ") and "artifacts/extrapolated_streams/adapter" in probe
    # a gate-2 part builds the adapter the same way when it is not there (nothing of it is kept in the repository)
    _run(project, "s23-gate2-100-explorative")
    extrapolate_again, part = _calls(project)[4:]
    assert extrapolate_again == extrapolate
    assert "evaluate.adapter=artifacts/extrapolated_streams/adapter" in part
    assert "evaluate.output_dir=artifacts/gate2_s23/seed100-explorative" in part


def test_setting_24_averages_settings_16s_and_21s_kept_adapters_then_runs_its_two_seed_gate(project):
    _kept(project, "burn_in_streams")
    _kept(project, "many_label_streams")
    _run(project, "s24")
    average, seed7, seed8, probe = _calls(project)
    assert average == ("model extrapolate artifacts/many_label_streams/adapter artifacts/burn_in_streams/adapter "
                       "--scale 0.5 --output artifacts/souped_streams/adapter")
    assert seed7.endswith(
        "gate_explorative_s24.yaml --set icrl_eval.seed=7 --set evaluate.output_dir=artifacts/gate_explorative_s24")
    assert seed8.endswith("--set icrl_eval.seed=8 --set evaluate.output_dir=artifacts/gate_explorative_s24_seed8")
    assert probe.startswith("probe-feedback ") and "artifacts/souped_streams/adapter" in probe
    assert "runs/s24/probe.json" in probe


def test_setting_25_adds_settings_16s_and_21s_steps_to_the_bootstrap_then_runs_its_two_seed_gate(project):
    for kept in ("burn_in_streams", "many_label_streams", "bootstrap_h32"):
        _kept(project, kept)
    _run(project, "s25")
    combine, seed7, seed8, probe = _calls(project)
    assert combine == ("model combine artifacts/burn_in_streams/adapter artifacts/many_label_streams/adapter "
                       "artifacts/bootstrap/adapter --weight 1 --weight 1 --weight -1 "
                       "--output artifacts/summed_streams/adapter")
    assert seed7.endswith(
        "gate_explorative_s25.yaml --set icrl_eval.seed=7 --set evaluate.output_dir=artifacts/gate_explorative_s25")
    assert seed8.endswith("--set icrl_eval.seed=8 --set evaluate.output_dir=artifacts/gate_explorative_s25_seed8")
    assert "artifacts/summed_streams/adapter" in probe and "runs/s25/probe.json" in probe
    _run(project, "s25-gate2-101-explorative")
    assert _calls(project)[-1].endswith("evaluate.output_dir=artifacts/gate2_s25/seed101-explorative")


def _probes(project: Path, setting: str, effect: float) -> None:
    """A setting's two probe outputs, already written (so run.sh does not probe again), with this n=1 effect."""
    runs = project / "runs" / f"s{setting}"
    runs.mkdir(parents=True)
    for name in ("probe.json", "probe-banking77.json"):
        (runs / name).write_text(json.dumps({"feedback_effect": {"1": effect, "4": 0.0}}))


def test_a_naive_gated_setting_runs_gate_n_on_both_seeds_only_after_its_probe_check_passes(project):
    _kept(project, "bootstrap_h32")
    _probes(project, "31", 0.12)
    result = _run(project, "s31")
    train, seed7, seed8 = _calls(project)
    assert train.startswith("stage ppo ") and train.endswith("-c experiments/icrl_stream_rl/label_run_streams.yaml "
                                                              "-c experiments/icrl_stream_rl/label_run_streams_lr.yaml")
    for seed, call, suffix in ((7, seed7, ""), (8, seed8, "_seed8")):
        assert "gate_naive_s31.yaml" in call and f"icrl_eval.seed={seed}" in call
        assert call.endswith(f"evaluate.output_dir=artifacts/gate_naive_s31{suffix}")
    assert "check P31: n=1 feedback effect +0.120" in result.stdout


def test_a_naive_gated_setting_stops_at_a_failed_probe_check_and_setting_30_needs_l49s_adapter(project):
    _kept(project, "bootstrap_h32")
    _probes(project, "30", 0.036)
    missing = subprocess.run(["bash", str(project / SCRIPT), "s30"], cwd=project, capture_output=True, text=True,
                             check=False, timeout=60)
    assert missing.returncode == 2 and "run l49 first" in missing.stderr
    _kept(project, "feedback_learnability_lr")
    result = _run(project, "s30")
    (train,) = _calls(project)  # trained, then stopped at check P30: no gate run
    assert "-c experiments/icrl_stream_rl/carry_verdict_streams.yaml" in train
    assert "check P30: n=1 feedback effect +0.036" in result.stdout and "failed" in result.stdout


def test_setting_32_runs_gate_n_on_l49s_kept_adapter_without_training(project):
    _kept(project, "bootstrap_h32")
    missing = subprocess.run(["bash", str(project / SCRIPT), "s32"], cwd=project, capture_output=True, text=True,
                             check=False, timeout=60)
    assert missing.returncode == 2 and "run l49 first" in missing.stderr
    _kept(project, "feedback_learnability_lr")
    _run(project, "s32")
    seed7, seed8 = _calls(project)  # no ppo stage, no probe: L49's own probe is its check P
    for seed, call, suffix in ((7, seed7, ""), (8, seed8, "_seed8")):
        assert call.startswith("stage evaluate ") and "gate_naive_s32.yaml" in call
        assert call.endswith(f"--set icrl_eval.seed={seed} --set evaluate.output_dir=artifacts/gate_naive_s32{suffix}")
    _run(project, "s32-gate2-100-naive")
    assert "evaluate.adapter=artifacts/feedback_learnability_lr/adapter" in _calls(project)[-1]


def test_setting_33_runs_gate_n_on_l50s_adapter_only_after_check_l50_passed(project):
    _kept(project, "bootstrap_h32")
    adapter = project / "artifacts" / "class_verdict_learnability" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_model.safetensors").write_text("l50")
    check = project / "runs" / "l50" / "check.json"
    for verdict in (None, "failed"):
        if verdict:
            check.parent.mkdir(parents=True)
            check.write_text(json.dumps({"verdict": verdict}, indent=2))
        refused = subprocess.run(["bash", str(project / SCRIPT), "s33"], cwd=project, capture_output=True, text=True,
                                 check=False, timeout=60)
        assert refused.returncode == 2 and "only after check L50 passed" in refused.stderr
    check.write_text(json.dumps({"verdict": "passed"}, indent=2))
    _run(project, "s33")
    seed7, seed8 = _calls(project)
    assert "gate_naive_s33.yaml" in seed7 and seed7.endswith("evaluate.output_dir=artifacts/gate_naive_s33")
    assert seed8.endswith("--set icrl_eval.seed=8 --set evaluate.output_dir=artifacts/gate_naive_s33_seed8")


def _closure(project: Path, absent_recall: float, false_alarm: float) -> None:
    """Check C34's closure probe output, already written (so run.sh does not probe again)."""
    runs = project / "runs" / "s34"
    runs.mkdir(parents=True)
    row = {"absent_recall": absent_recall, "false_alarm": false_alarm, "present_recall": 0.1}
    (runs / "closure.json").write_text(json.dumps({
        "setting34": {"adapter": "artifacts/closure_streams/adapter", **row},
        "setting26": {"adapter": "experiments/icrl_stream_rl/adapters/discovery_streams", **row}}))


def test_setting_34_runs_gate_e_only_after_its_closure_check_passes(project):
    _kept(project, "bootstrap_h32")
    _closure(project, 0.070, 0.010)
    result = _run(project, "s34")
    train, seed7, seed8, probe = _calls(project)
    assert train.startswith("stage ppo ") and train.endswith(
        "-c experiments/icrl_stream_rl/burn_in_streams.yaml -c experiments/icrl_stream_rl/closure_streams.yaml")
    _assert_two_seed_gate("34", seed7, seed8)
    assert "artifacts/closure_streams/adapter" in probe and "runs/s34/probe.json" in probe
    assert "check C34: absent recall 0.070 - false alarm 0.010 = +0.060" in result.stdout
    check = json.loads((project / "runs" / "s34" / "check.json").read_text())
    assert check["passed"] is True and check["margin"] == pytest.approx(0.06)


def test_setting_34_stops_at_a_failed_closure_check(project):
    _kept(project, "bootstrap_h32")
    _closure(project, 0.040, 0.002)
    result = _run(project, "s34")
    (train,) = _calls(project)  # trained, then stopped at check C34: no gate run
    assert "closure_streams.yaml" in train and "failed, the setting stops here" in result.stdout
    assert json.loads((project / "runs" / "s34" / "check.json").read_text())["passed"] is False

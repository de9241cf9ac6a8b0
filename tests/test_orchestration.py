"""Orchestration with real services, on the tiny model so it runs in minutes:

- a real Prefect server on 127.0.0.1, `prefect deploy --all` to a process work pool, a worker, and a pipeline
  run triggered with parameters through the REST API (what the UI's "Run" button does), seen to complete with
  every stage task completed and logged; the run goes Prefect -> `dvc repro` -> `icrl stage` -> MLflow and
  ends with a registered model version carrying the `champion` alias;
- `dvc repro` again runs nothing; `dvc exp run -S ppo.kl_beta=...` reruns only ppo and what depends on it;
- a two-worker Ray Train PPO job survives a killed worker by resuming from its checkpoint;
- a Ray Tune sweep of 4 PPO trials logs 4 MLflow child runs under one parent.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tasks.stages import stage_names
from tests.conftest import ROOT, TASKS_DIR, own_ray_train_workers

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
STAGES = stage_names(ROOT)

# The demo pipeline shrunk to seconds per stage: same stages, same params.yaml layout, tiny model.
TINY_PIPELINE = {
    "model.spec": "tiny", "model.dtype": "float32", "ray.enabled": False,
    "data.num_episodes": 16, "data.episode_tokens": 512,
    "bootstrap.max_steps": 2, "bootstrap.eval_steps": 2, "bootstrap.save_steps": 2, "bootstrap.batch_size": 2,
    "reward_model.max_steps": 2, "reward_model.eval_steps": 2, "reward_model.save_steps": 2,
    "reward_model.batch_size": 2,
    "ppo.max_steps": 2, "ppo.rollout_episodes": 2, "ppo.batch_size": 2, "ppo.minibatch_size": 2, "ppo.epochs": 1,
    "ppo.eval_steps": 2, "ppo.eval_episodes": 2, "ppo.save_steps": 2, "ppo.max_new_tokens": 3,
    "adapt.num_requests": 1, "adapt.steps": 1,
    "icrl_eval.train_k": 6, "icrl_eval.test_every": 3, "icrl_eval.test_k": 4,
    "evaluate.forgetting_questions": 5,
    "evaluate.forgetting_probe_items": 6,
    "evaluate.feedback_probe_target": "brom",  # a label of keyword_map at seed 0
    "evaluate.feedback_probe_queries": 3,
    "evaluate.max_forgetting": 1.0,  # a random tiny model's answers are noise; the gates have their own unit test
    "evaluate.min_gain": -1.0,  # random tiny models gain nothing; the test is about the orchestration
    "evaluate.adapter_scale": 0.5,  # the evaluated and registered weights are halfway to the base model
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(args: list[str], cwd: Path, timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A git + DVC project like a fresh clone (sources, dvc.yaml, prefect.yaml) with tiny-model params."""
    folder = tmp_path_factory.mktemp("project")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("icrl_core", "tasks", "flows"):
        shutil.copytree(ROOT / name, folder / name, ignore=ignore)
    for name in ("dvc.yaml", "params.yaml", "prefect.yaml", ".gitignore"):
        shutil.copy2(ROOT / name, folder / name)
    _run(["git", "init", "-q", "-b", "main"], folder)
    _run(["git", "config", "user.email", "test@example.invalid"], folder)
    _run(["git", "config", "user.name", "test"], folder)
    _run([str(BIN / "dvc"), "init", "-q"], folder)
    from flows.pipeline import apply_overrides

    apply_overrides({**TINY_PIPELINE, "data.tasks_dir": str(TASKS_DIR)}, str(folder / "params.yaml"))
    _run(["git", "add", "-A"], folder)
    _run(["git", "commit", "-qm", "tiny project"], folder)
    return folder


def _api(client: httpx.Client, method: str, path: str, **kwargs):
    response = client.request(method, path, **kwargs)
    assert response.status_code < 400, f"{method} {path}: {response.status_code} {response.text[:500]}"
    return response.json()


def test_prefect_ui_style_trigger_runs_the_pipeline_through_dvc_into_mlflow(project, monkeypatch):
    from flows.services import Services

    monkeypatch.chdir(project)
    monkeypatch.setenv("PREFECT_HOME", str(project / ".icrl" / "prefect"))
    monkeypatch.setenv("PREFECT_WORKER_QUERY_SECONDS", "2")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    services = Services(prefect_port=_free_port())
    try:
        services.start_prefect()
        services.ensure_work_pool()
        deployed = services.deploy(project)
        assert "icrl-pipeline/pipeline" in deployed
        services.start_worker()
        with httpx.Client(base_url=services.prefect_api, timeout=30) as client:
            deployment = _api(client, "GET", "/deployments/name/icrl-pipeline/pipeline")
            # What the UI's "Custom run" form posts: the deployment's flow parameters.
            flow_run = _api(client, "POST", f"/deployments/{deployment['id']}/create_flow_run",
                            json={"parameters": {"overrides": {"ppo.kl_beta": 0.05}}})
            deadline = time.time() + 900
            state = flow_run["state"]["type"]
            while time.time() < deadline and state not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                time.sleep(3)
                state = _api(client, "GET", f"/flow_runs/{flow_run['id']}")["state"]["type"]
            task_runs = _api(client, "POST", "/task_runs/filter",
                             json={"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
            logs = _api(client, "POST", "/logs/filter",
                        json={"logs": {"flow_run_id": {"any_": [flow_run["id"]]}}, "limit": 200})
        worker_log = (project / ".icrl" / "logs" / "prefect-worker.log").read_text(errors="replace")
        assert state == "COMPLETED", f"flow run ended {state}; worker log:\n{worker_log[-6000:]}"
    finally:
        services.stop()

    states = {run["name"]: run["state"]["type"] for run in task_runs}
    assert states == {stage: "COMPLETED" for stage in STAGES}
    messages = "\n".join(entry["message"] for entry in logs)
    assert "Running stage 'ppo'" in messages and "icrl stage ppo" in messages
    # the parameter reached params.yaml (so DVC saw it) ...
    from tasks.settings import load_config

    assert load_config(project / "params.yaml", [], environ={}).ppo.kl_beta == 0.05
    # ... every stage wrote its metrics, and the final policy was registered and promoted
    for stage in STAGES:
        assert (project / "metrics" / f"{stage}.json").exists(), stage
    evaluated = json.loads((project / "metrics" / "evaluate.json").read_text())
    # the forgetting check is a paired comparison on the same 5 questions
    flips = evaluated["forgetting_became_correct"] - evaluated["forgetting_became_wrong"]
    assert flips / 5 == pytest.approx(-evaluated["forgetting_drop"])
    assert evaluated["forgetting_change_ci95_low"] <= -evaluated["forgetting_drop"] <= evaluated[
        "forgetting_change_ci95_high"]
    # ... and so is the multiple-choice probe, on 6 items
    assert evaluated["forgetting_probe_items"] == 6 and evaluated["passes_forgetting_probe"]
    probe_flips = evaluated["forgetting_probe_became_correct"] - evaluated["forgetting_probe_became_wrong"]
    assert probe_flips / 6 == pytest.approx(evaluated["forgetting_probe_trained_accuracy"]
                                            - evaluated["forgetting_probe_base_accuracy"])
    # ... and the feedback probe asked both models: p(target) after attempts marked wrong vs right
    report = json.loads((project / "artifacts" / "evaluate" / "report.json").read_text())
    for which, adapter in (("base", None), ("trained", "artifacts/evaluate/adapter")):
        probe = report["feedback_probe"][which]
        assert probe["target"] == "brom" and probe["queries"] == 3 and probe["adapter"] == adapter
        conditions = probe["conditions"]
        assert set(conditions) == {"n0", "n1_wrong", "n1_right", "n4_wrong", "n4_right"}
        assert evaluated[f"feedback_effect_n4_{which}"] == pytest.approx(
            conditions["n4_right"]["p_target"] - conditions["n4_wrong"]["p_target"])
        assert 0 < evaluated[f"feedback_p_target_n0_{which}"] < 1
    promoted = json.loads((project / "metrics" / "promote.json").read_text())
    assert promoted["alias"] == "champion", promoted
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    version = client.get_model_version_by_alias("icrl-policy", "champion")
    assert int(version.version) == int(promoted["version"])
    # what was evaluated and registered is the trained adapter interpolated toward the base (adapter_scale 0.5)
    import torch
    from safetensors.torch import load_file

    assert evaluated["adapter"] == "artifacts/evaluate/adapter" and evaluated["adapter_scale"] == 0.5
    assert client.get_run(version.run_id).data.tags["icrl.eval.adapter"] == "artifacts/evaluate/adapter"
    trained = load_file(project / "artifacts" / "ppo" / "adapter" / "adapter_model.safetensors")
    interpolated = load_file(project / "artifacts" / "evaluate" / "adapter" / "adapter_model.safetensors")
    assert set(interpolated) == set(trained) and any("lora_B" in name for name in trained)
    for name, tensor in trained.items():
        assert torch.allclose(interpolated[name], tensor * (0.5 if "lora_B" in name else 1.0)), name
    runs = client.search_runs([client.get_experiment_by_name("icrl").experiment_id])
    stage_runs = {r.data.tags.get("icrl.stage") for r in runs if "mlflow.parentRunId" in r.data.tags}
    assert {"bootstrap", "reward_model", "ppo"} <= stage_runs


def test_dvc_repro_again_runs_nothing(project):
    from tasks.stages import pipeline_stages

    started = time.perf_counter()
    # the stages the pipeline ran (policy_optimization: ppo; the dpo stage is the other branch)
    result = _run([str(BIN / "dvc"), "repro", *pipeline_stages("ppo", project)], project)
    seconds = time.perf_counter() - started
    output = result.stdout + result.stderr
    assert "Running stage" not in output, output
    assert "up to date" in output
    print(f"no-op dvc repro: {seconds:.1f}s")


def test_dvc_plots_render_the_learning_curves_offline(project):
    result = _run([str(BIN / "dvc"), "plots", "show", "--json"], project)
    plots = json.loads(result.stdout[result.stdout.index("{"):])
    assert not plots.get("errors"), plots.get("errors")
    for title in ("Supervised bootstrap loss and KL", "Reward model loss", "PPO mean reward, KL and entropy",
                  "PPO validation accuracy"):
        [vega] = plots["data"][title]
        assert vega["content"]["data"]["values"], title
    images = [name for name in plots["data"] if name.endswith(".png")]
    assert len(images) == 4


def test_dvc_exp_run_reruns_only_the_stages_that_depend_on_the_parameter(project):
    result = _run([str(BIN / "dvc"), "exp", "run", "-S", "ppo.kl_beta=0.02"], project)
    output = result.stdout + result.stderr
    ran = {stage for stage in STAGES if f"Running stage '{stage}'" in output}
    assert ran == {"ppo", "adapt", "evaluate", "promote"}, output[-3000:]


# ---------------------------------------------------------------------------------------------------------------
# Ray Train and Ray Tune on the PPO stage

TINY_PPO = [
    "model.spec=tiny", "data.output_dir=data", "ppo.rollout_episodes=4", "ppo.batch_size=4",
    "ppo.minibatch_size=2", "ppo.epochs=1", "ppo.eval_steps=100", "ppo.eval_episodes=2", "ppo.max_new_tokens=3",
    "ppo.learning_rate=1e-3",
]


@pytest.fixture(scope="module")
def ray_folder(tmp_path_factory):
    import ray

    from tests.ppo_helpers import write_keyword_dataset

    import tempfile

    # Ray puts AF_UNIX sockets under the working folder (.icrl/ray): keep the path short (107 bytes max).
    folder = Path(tempfile.mkdtemp(prefix="icrl-ray-", dir="/tmp"))
    write_keyword_dataset(folder / "data", train=16, val=2)
    old = os.getcwd()
    os.chdir(folder)
    yield folder
    ray.shutdown()
    os.chdir(old)
    shutil.rmtree(folder, ignore_errors=True)


def test_two_worker_ray_train_ppo_recovers_from_a_killed_worker(ray_folder, monkeypatch):
    from icrl_core.checkpoint import latest_checkpoint
    from tasks.settings import load_config
    from tasks.ppo import run
    from tasks.runtime import checkpoint_dir_for

    config = load_config(None, TINY_PPO + ["tracking.enabled=false", "ray.enabled=true", "ray.num_workers=2",
                                           "ray.max_failures=2", "ppo.max_steps=6", "ppo.save_steps=1"],
                         environ={})
    killed: list[int] = []

    def kill_one_worker_after_a_checkpoint():
        folder = checkpoint_dir_for(config, "ppo")
        deadline = time.time() + 600
        while time.time() < deadline and not killed:
            latest = latest_checkpoint(folder)
            if latest is not None and latest.name >= "step-00000002":
                for proc in own_ray_train_workers():
                    proc.kill()
                    killed.append(proc.info["pid"])
                    return
            time.sleep(0.1)

    watcher = threading.Thread(target=kill_one_worker_after_a_checkpoint)
    watcher.start()
    metrics = run(config)
    watcher.join()
    assert killed, "no Ray Train worker was found to kill"
    history = json.loads((ray_folder / "artifacts" / "ppo" / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3, 4, 5, 6]
    assert metrics["iterations"] == 6 and metrics["world_size"] == 2


def test_tune_sweep_of_four_ppo_trials_logs_four_mlflow_child_runs(ray_folder):
    import mlflow

    from tasks.settings import load_config
    from tasks.sweep import run_sweep

    store = f"sqlite:///{ray_folder / 'sweep-mlflow.db'}"
    config = load_config(None, TINY_PPO + [f"tracking.tracking_uri={store}", "tracking.experiment=sweep-test",
                                           "sweep.stage=ppo", "sweep.num_samples=4", "sweep.max_concurrent=2",
                                           "sweep.max_steps=2", "sweep.grace_period=1"], environ={})
    summary = run_sweep(config)
    assert len(summary["trials"]) == 4 and all(t["error"] is None for t in summary["trials"])
    assert set(summary["best_params"]) == {"ppo.learning_rate", "ppo.kl_beta"}
    assert (ray_folder / "artifacts" / "sweep" / "best.json").exists()
    client = mlflow.MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("sweep-test")
    children = client.search_runs([experiment.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{summary['parent_run_id']}'")
    assert len(children) == 4
    for child in children:
        assert {"ppo.learning_rate", "ppo.kl_beta"} <= set(child.data.params)
        assert "mean_reward" in child.data.metrics

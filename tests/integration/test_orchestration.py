"""Orchestration with real services, on the tiny model so it runs in minutes:

- a real Prefect server on 127.0.0.1, `prefect deploy --all` to a process work pool, a worker, and a pipeline
  run triggered through the REST API (what the UI's "Run" button does), seen to complete with every stage task
  completed and logged; the run goes Prefect -> `dvc repro` -> `icrl stage` -> MLflow and ends with a registered
  model version whose alias the real promotion gates decided; the promotion deployment takes no metric. Only ppo
  runs as a Ray Train job (`ray.stages`), the other training stages in-process: each Ray Train job costs ~35 s
  of start-up and teardown here, and Ray Train's mechanics are tested in test_ray_train.py and test_ray_ppo.py;
- `dvc repro` again runs nothing; a bootstrap rerun that gives the same weights reruns nothing downstream;
  after an evaluation parameter changes, DVC plans to rerun only evaluate and promote (`dvc repro --dry`: the
  stage graph is what is tested; running a changed-parameter experiment and restoring the workspace is
  tests/integration/test_experiments.py, whose stage takes no 40 s);
- the Ray Train job attaches to one Ray head by address, as on a cluster (`ray.address`, the code shipped in
  the job's runtime_env), instead of starting a local Ray.

Ray Train and Ray Tune on the PPO stage with their own local Ray: tests/integration/test_ray_ppo.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flows.services import free_port, prefect_rest
from tasks.stages import pipeline_stages, stage_names
from tests.conftest import ROOT, TASKS_DIR

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
STAGES = stage_names(ROOT)
# what a pipeline run executes (policy_optimization: ppo; the dpo stage is the other branch)
PIPELINE = pipeline_stages("ppo", ROOT)

# The demo pipeline shrunk to seconds per stage: same stages, same params.yaml layout, tiny model.
TINY_PIPELINE = {
    "model.spec": "tiny", "model.dtype": "float32", "ray.enabled": True, "ray.stages": ["ppo"],
    "ray.num_workers": 1,
    "data.num_episodes": 16, "data.episode_tokens": 512,
    "bootstrap.max_steps": 2, "bootstrap.eval_steps": 2, "bootstrap.save_steps": 2, "bootstrap.batch_size": 2,
    "reward_model.max_steps": 2, "reward_model.eval_steps": 2, "reward_model.save_steps": 2,
    "reward_model.batch_size": 2,
    "ppo.max_steps": 2, "ppo.rollout_episodes": 2, "ppo.batch_size": 2, "ppo.minibatch_size": 2, "ppo.epochs": 1,
    "ppo.eval_steps": 2, "ppo.eval_episodes": 2, "ppo.save_steps": 2, "ppo.max_new_tokens": 3,
    "ppo.stream": {"steps": 4, "group_size": 2, "groups": 1, "eval_groups": 1},
    "adapt.num_requests": 1, "adapt.steps": 1,
    "icrl_eval.train_k": 6, "icrl_eval.test_every": 3, "icrl_eval.test_k": 4,
    "evaluate.forgetting_questions": 5,
    "evaluate.workers": 1,  # the runs one after another here: a pool of two spawned interpreters costs ~10 s of
                            # imports for seconds of work (the pool: tests/integration/test_evaluate_stage.py)
    "evaluate.forgetting_probe_items": 6,
    "evaluate.feedback_probe_target": "brom",  # a label of keyword_map at seed 0
    "evaluate.feedback_probe_queries": 3,
    "evaluate.adapter_scale": 0.5,  # the evaluated and registered weights are halfway to the base model
}


def _run(args: list[str], cwd: Path, timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    result = subprocess.run(args, cwd=cwd, check=False, capture_output=True, text=True, timeout=timeout, env=full_env)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return result


@pytest.fixture(scope="module")
def ray_head(request) -> str:
    """A Ray head (`ray start --head`, 2 CPUs, 127.0.0.1) for this module's pipeline runs, stopped with the module:
    the training stages attach by address, as to a cluster, instead of each starting and stopping a local Ray."""
    import signal
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="icrl-h-", dir="/tmp"))  # short: Ray's AF_UNIX socket paths
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_worker_niceness": "0"}
    log = open(folder / "head.log", "w+")  # noqa: SIM115 - read back while the head runs
    head = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", f"--port={port}",
                             "--node-ip-address=127.0.0.1", "--num-cpus=2", "--include-dashboard=false",
                             f"--dashboard-port={free_port()}", f"--temp-dir={folder / 'ray'}",
                             "--disable-usage-stats"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def stop():
        # `ray start --block` took over 20 s to stop on SIGTERM (a 20 s teardown in the suite); the session and its
        # folder go with it, so its process group gets 3 s, then SIGKILL (stragglers included)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(head.pid, sig)  # the head and every process it started (its own session)
            except ProcessLookupError:
                break
            try:
                head.wait(timeout=3)
            except subprocess.TimeoutExpired:
                pass
        head.wait(timeout=30)
        log.close()
        shutil.rmtree(folder, ignore_errors=True)

    request.addfinalizer(stop)
    deadline = time.time() + 180
    while "Ray runtime started" not in (folder / "head.log").read_text(errors="replace"):
        assert head.poll() is None and time.time() < deadline, (folder / "head.log").read_text(errors="replace")
        time.sleep(0.5)
    return f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def project(request, ray_head) -> Path:
    """A git + DVC project like a fresh clone (sources, dvc.yaml, prefect.yaml) with tiny-model params, in a short
    folder: the training stages start Ray, which puts AF_UNIX sockets under .icrl/ray (107 bytes max)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="icrl-p-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
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

    apply_overrides({**TINY_PIPELINE, "data.tasks_dir": str(TASKS_DIR), "ray.address": ray_head},
                    str(folder / "params.yaml"))
    _run(["git", "add", "-A"], folder)
    _run(["git", "commit", "-qm", "tiny project"], folder)
    return folder


def _wait(client: httpx.Client, flow_run_id: str, deadline: float) -> dict:
    while True:
        run = prefect_rest(client, "GET", f"/flow_runs/{flow_run_id}")
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") or time.time() > deadline:
            return run
        time.sleep(3)


def _logs(client: httpx.Client, flow_run_id: str) -> str:
    messages, offset = [], 0
    while True:
        page = prefect_rest(client, "POST", "/logs/filter", json={"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                                                  "limit": 200, "offset": offset})
        messages += [entry["message"] for entry in page]
        if len(page) < 200:
            return "\n".join(messages)
        offset += 200


def test_prefect_ui_style_trigger_runs_the_pipeline_through_dvc_into_mlflow(project, monkeypatch):
    from flows.services import Services

    monkeypatch.chdir(project)
    monkeypatch.setenv("PREFECT_HOME", str(project / ".icrl" / "prefect"))
    monkeypatch.setenv("PREFECT_WORKER_QUERY_SECONDS", "2")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    params_before = (project / "params.yaml").read_bytes()
    services = Services(prefect_port=free_port())
    try:
        services.start_prefect()
        services.ensure_work_pool()
        deployed = services.deploy(project)
        assert "icrl-pipeline/pipeline" in deployed
        services.start_worker()
        with httpx.Client(base_url=services.prefect_api, timeout=30) as client:
            deployment = prefect_rest(client, "GET", "/deployments/name/icrl-pipeline/pipeline")
            # What the UI's "Run" button posts. One run in the workspace (a run with overrides is a DVC experiment
            # that restores the workspace afterwards: tests/integration/test_experiments.py; two runs at once take
            # too long for the suite).
            created = [prefect_rest(client, "POST", f"/deployments/{deployment['id']}/create_flow_run",
                                    json={"parameters": {}})]
            deadline = time.time() + 840
            runs = [_wait(client, run["id"], deadline) for run in created]
            task_runs = [prefect_rest(client, "POST", "/task_runs/filter",
                                      json={"flow_runs": {"id": {"any_": [run["id"]]}}})
                         for run in runs]
            logs = "\n".join(_logs(client, run["id"]) for run in runs)
            # the promotion deployment takes an evaluation, not a metric: no caller can skip the gates. Prefect's
            # server accepts the request (it does not forbid extra parameters); the flow refuses it when it starts
            promotion = prefect_rest(client, "GET", "/deployments/name/icrl-promotion/promotion")
            refused = prefect_rest(client, "POST", f"/deployments/{promotion['id']}/create_flow_run",
                                   json={"parameters": {"adapter_dir": "artifacts/ppo/adapter", "metric": 1.0}})
            refused = _wait(client, refused["id"], time.time() + 180)
        worker_log = (project / ".icrl" / "logs" / "prefect-worker.log").read_text(errors="replace")
        for run in runs:
            assert run["state"]["type"] == "COMPLETED", (f"{run['name']} ended {run['state']['type']}; logs:\n"
                                                         f"{logs[-8000:]}\nworker log:\n{worker_log[-3000:]}")
    finally:
        services.stop()

    assert refused["state"]["type"] in ("FAILED", "CRASHED"), refused["state"]
    for tasks in task_runs:
        assert {run["name"]: run["state"]["type"] for run in tasks} == {stage: "COMPLETED" for stage in PIPELINE}
    assert "Running stage 'ppo'" in logs and "icrl stage ppo" in logs
    # ppo ran as a Ray Train job on the head (ray.address) without starting a local Ray of its own; the training
    # stages outside ray.stages ran in-process
    jobs = {path.name.split("-")[0] for path in (project / ".icrl" / "ray_results").iterdir()}
    assert jobs == {"ppo"}, jobs
    assert not (project / ".icrl" / "ray").exists()
    # the run left params.yaml as it was
    assert (project / "params.yaml").read_bytes() == params_before
    # ... every stage wrote its headline metrics, the full records are in the outputs
    for stage in PIPELINE:
        assert (project / "metrics" / f"{stage}.json").exists(), stage
    evaluated = json.loads((project / "artifacts" / "evaluate" / "metrics.json").read_text())
    headline = json.loads((project / "metrics" / "evaluate.json").read_text())
    assert headline == {k: evaluated[k] for k in headline} and len(headline) < 10
    # the forgetting check is a paired comparison on the same 5 questions
    flips = evaluated["forgetting_became_correct"] - evaluated["forgetting_became_wrong"]
    assert flips / 5 == pytest.approx(-evaluated["forgetting_drop"])
    assert evaluated["forgetting_change_ci95_low"] <= -evaluated["forgetting_drop"] <= evaluated[
        "forgetting_change_ci95_high"]
    # ... and so is the multiple-choice probe, on 6 items
    assert evaluated["forgetting_probe_items"] == 6 and "passes_forgetting_probe" in evaluated
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
        assert evaluated[f"gold_after_wrong_n4_{which}"] == pytest.approx(
            conditions["n4_wrong"]["p_gold"] - conditions["n0"]["p_gold"])
    # the real gates decided the alias: a version that fails them is never the champion
    from tasks.evaluate import gates
    from tasks.settings import load_config

    promoted = json.loads((project / "metrics" / "promote.json").read_text())
    decided = gates(evaluated, load_config(project / "params.yaml", [], environ={}).evaluate)
    assert promoted["eligible"] == decided["eligible"] == evaluated["eligible"]
    if not decided["eligible"]:
        assert promoted["alias"] == "challenger", promoted
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    version = client.get_model_version_by_alias("icrl-policy", promoted["alias"])
    assert int(version.version) == int(promoted["version"])
    # ... and the refused promotion registered nothing
    assert len(client.search_model_versions("name='icrl-policy'")) == int(promoted["version"])
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
    started = time.perf_counter()
    result = _run([str(BIN / "dvc"), "repro", *PIPELINE], project)
    seconds = time.perf_counter() - started
    output = result.stdout + result.stderr
    assert "Running stage" not in output, output
    assert "up to date" in output
    print(f"no-op dvc repro: {seconds:.1f}s")


def test_icrl_pipeline_in_a_terminal_reports_to_a_temporary_server_it_stops(project):
    """`icrl pipeline` without PREFECT_API_URL: the flow reports to a temporary Prefect server of its own (in its own
    session, see tests/integration/test_signals.py for Ctrl-C) and stops it; every stage is up to date here."""
    env = {key: value for key, value in os.environ.items() if key != "PREFECT_API_URL"}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PREFECT_HOME"] = str(project / ".icrl" / "prefect")
    result = subprocess.run([str(BIN / "icrl"), "pipeline"], cwd=project, env=env, check=False, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert set(json.loads(result.stdout[result.stdout.index("{"):])) >= {"ppo", "evaluate"}
    server_log = project / ".icrl" / "logs" / "prefect-temporary-server.log"
    assert server_log.exists()
    port = int((result.stdout + result.stderr).split("View at http://127.0.0.1:")[1].split("/")[0])
    with socket.socket() as sock:  # nothing listens there any more
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))


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


def test_a_bootstrap_rerun_with_the_same_weights_reruns_nothing_downstream(project):
    """Downstream stages depend on the weights subfolder, not on the out folder whose metrics and timings change."""
    import yaml

    def bootstrap_lock() -> dict:
        lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
        return {out["path"]: out["md5"] for out in lock["bootstrap"]["outs"]}

    before = (project / "artifacts" / "bootstrap" / "adapter" / "adapter_model.safetensors").read_bytes()
    old = bootstrap_lock()
    _run([str(BIN / "dvc"), "repro", "--force", "--single-item", "bootstrap"], project)
    assert (project / "artifacts" / "bootstrap" / "adapter" / "adapter_model.safetensors").read_bytes() == before
    assert bootstrap_lock()["artifacts/bootstrap"] != old["artifacts/bootstrap"]  # metrics.json's timings moved
    rerun = _run([str(BIN / "dvc"), "repro", *PIPELINE], project)
    output = rerun.stdout + rerun.stderr
    assert "Running stage" not in output, output


def test_an_evaluation_parameter_reruns_only_evaluate_and_promote(project):
    # `dvc exp run --dry` cannot plan (DVC 3 runs it in a temporary copy without the cached outputs), so the
    # parameter is set in the workspace, `dvc repro --dry` plans, and the workspace is restored. The ppo branch's
    # stages as targets: dvc.yaml also holds the dpo branch, which this pipeline never ran.
    from flows.pipeline import apply_overrides

    apply_overrides({"evaluate.forgetting_questions": 4}, str(project / "params.yaml"))
    try:
        result = _run([str(BIN / "dvc"), "repro", "--dry", *PIPELINE], project)
    finally:
        _run(["git", "checkout", "--", "params.yaml"], project)
    output = result.stdout + result.stderr
    ran = {stage for stage in STAGES if f"Running stage '{stage}'" in output}
    assert ran == {"evaluate", "promote"}, output[-3000:]
    assert "up to date" in _run([str(BIN / "dvc"), "status", *PIPELINE], project).stdout

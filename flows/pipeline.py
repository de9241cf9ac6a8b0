"""Prefect flows of the pipeline. They orchestrate only: each stage task runs `dvc repro --single-item STAGE`,
whose command (dvc.yaml) is `icrl stage STAGE`, which runs the stage module in tasks/ (training stages as Ray
Train jobs). So Prefect calls DVC, DVC calls the stage: DVC owns the data lineage and the cache (a run from the
Prefect UI and a `dvc repro` in a terminal share outputs and dvc.lock), Prefect owns scheduling, retries,
parameters from the UI, states and logs.

Runs do not collide: a pipeline run holds the project's workspace lock (`.icrl/workspace.lock`) from start to end,
so a second run (from the UI, a deployment, or a terminal) waits for the first; the deployment also has a Prefect
concurrency limit of 1 (prefect.yaml), so the server queues triggered runs. A run with overrides is a DVC
experiment: params.yaml holds the overrides only while it runs, `dvc exp save` records it (`dvc exp show` lists it
with its params and metrics), then params.yaml, dvc.lock and the metrics return to what they were and DVC checks
the outputs back out (`dvc exp apply NAME` brings the experiment's results into the workspace).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task

PARAMS_FILE = "params.yaml"
WORKSPACE_LOCK = Path(".icrl") / "workspace.lock"


def _tool_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a stage subprocess: the venv's bin first on PATH (dvc and icrl live there)."""
    from tasks.env import DEFAULTS

    env = {**DEFAULTS, **os.environ, **(extra or {})}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _dvc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "dvc"), *args], check=False, capture_output=True,
                          text=True, env=_tool_env(env))


def dvc_stage_cache_key(context, parameters: dict[str, Any]) -> str | None:
    """Cache a stage task only when DVC says the stage is up to date; the key is the stage's dvc.lock entry
    (hashes of its deps, params and outs), so a cached result is exactly the one DVC has."""
    stage = parameters["stage"]
    status = _dvc("status", "--json", stage, env=parameters.get("env"))
    if status.returncode != 0 or json.loads(status.stdout or "{}"):
        return None
    try:
        import yaml

        lock = yaml.safe_load(Path("dvc.lock").read_text())["stages"][stage]
    except (FileNotFoundError, KeyError, TypeError):
        return None
    return f"dvc-{stage}-" + hashlib.sha256(json.dumps(lock, sort_keys=True).encode()).hexdigest()[:32]


@task(name="stage", task_run_name="{stage}", cache_key_fn=dvc_stage_cache_key, persist_result=True)
def dvc_stage(stage: str, env: dict[str, str] | None = None) -> dict:
    """`dvc repro --single-item STAGE`, streaming its output into the Prefect logs; returns the stage's
    metrics (metrics/STAGE.json)."""
    logger = get_run_logger()
    command = [str(Path(sys.executable).parent / "dvc"), "repro", "--single-item", stage]
    logger.info("running %s", " ".join(command[-3:]))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_tool_env(env), bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            logger.info(line)
    code = proc.wait()
    if code != 0:
        raise RuntimeError(f"dvc repro {stage} failed with exit code {code} (see the log above)")
    metrics_file = Path("metrics") / f"{stage}.json"
    return json.loads(metrics_file.read_text()) if metrics_file.exists() else {}


def apply_overrides(overrides: dict[str, Any], params_file: str = PARAMS_FILE) -> None:
    """Write dotted-key overrides into params.yaml (comments kept), after validating the result, as
    `dvc exp run --set-param` does: DVC then sees the new values and reruns exactly what depends on them."""
    from ruamel.yaml import YAML

    from tasks.settings import load_config

    load_config(params_file, [f"{k}={json.dumps(v)}" for k, v in overrides.items()], environ={})  # fail fast
    yaml = YAML()
    path = Path(params_file)
    data = yaml.load(path.read_text()) if path.exists() else {}
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            if part not in node or not isinstance(node[part], dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    from io import StringIO

    from icrl_core.io import atomic_write_text

    buffer = StringIO()
    yaml.dump(data, buffer)
    atomic_write_text(path, buffer.getvalue())


@contextlib.contextmanager
def workspace_lock(logger: logging.Logger | logging.LoggerAdapter | None = None) -> Iterator[None]:
    """One run at a time in this project folder: pipeline runs and promotions share params.yaml, dvc.lock, the
    outputs and DVC's own lock. The lock is an OS file lock: a killed run releases it."""
    from icrl_core.io import exclusive_lock

    def waiting() -> None:
        (logger or logging.getLogger(__name__)).info("another run holds %s: waiting for it to end", WORKSPACE_LOCK)

    with exclusive_lock(WORKSPACE_LOCK, on_wait=waiting):
        yield


def experiment_files() -> list[Path]:
    """What a run changes besides the cached outputs: params.yaml, dvc.lock and the stages' metrics files."""
    from tasks.stages import load_stages

    return [Path(PARAMS_FILE), Path("dvc.lock"), *(Path(m) for stage in load_stages().values() for m in stage.metrics)]


def _experiment_exists(name: str) -> bool:
    refs = subprocess.run(["git", "for-each-ref", "--format=%(refname)", "refs/exps"], check=False,
                          capture_output=True, text=True)
    return any(ref.rsplit("/", 1)[-1] == name for ref in refs.stdout.split())


EXPERIMENT_RESTORE = Path(".icrl") / "experiment-restore"


def _keep_for_restore(saved: dict[Path, bytes | None]) -> None:
    """Write the bytes a run with overrides must put back into EXPERIMENT_RESTORE before params.yaml changes, so
    a run killed before its `finally` (kill -9, power loss) is undone by the next one. The manifest is written
    last: a restore folder without it was never in use."""
    from icrl_core.io import atomic_write_bytes, atomic_write_json

    shutil.rmtree(EXPERIMENT_RESTORE, ignore_errors=True)
    manifest = {}
    for index, (path, data) in enumerate(saved.items()):
        manifest[str(path)] = None if data is None else f"{index}.bin"
        if data is not None:
            atomic_write_bytes(EXPERIMENT_RESTORE / f"{index}.bin", data)
    atomic_write_json(EXPERIMENT_RESTORE / "manifest.json", manifest)


def _restore(saved: dict[Path, bytes | None]) -> None:
    from icrl_core.io import atomic_write_bytes

    for path, data in saved.items():
        if data is None:
            path.unlink(missing_ok=True)
        elif not path.exists() or path.read_bytes() != data:
            atomic_write_bytes(path, data)


def recover_interrupted_experiment(logger: logging.Logger | logging.LoggerAdapter | None = None) -> bool:
    """Put back params.yaml, dvc.lock and the metrics a killed run with overrides left changed (its
    EXPERIMENT_RESTORE manifest is still there). Call it holding the workspace lock. True if there was one."""
    manifest_path = EXPERIMENT_RESTORE / "manifest.json"
    if not manifest_path.exists():
        shutil.rmtree(EXPERIMENT_RESTORE, ignore_errors=True)  # a run killed while writing it changed nothing yet
        return False
    from icrl_core.io import sha256_file

    logger = logger or logging.getLogger(__name__)
    manifest = json.loads(manifest_path.read_text())
    saved = {Path(path): None if name is None else (EXPERIMENT_RESTORE / name).read_bytes()
             for path, name in manifest.items()}
    applied = EXPERIMENT_RESTORE / "applied.sha256"  # params.yaml as the killed run wrote it
    params = Path(PARAMS_FILE)
    if applied.exists() and params.exists() and sha256_file(params) != applied.read_text().strip():
        # edited by hand since the run was killed: the edit wins, the run's old bytes are kept beside it
        kept = params.with_name(f"{params.name}.before-interrupted-run")
        from icrl_core.io import atomic_write_bytes

        if saved[params] is not None:
            atomic_write_bytes(kept, saved[params])
        del saved[params]
        logger.warning("params.yaml changed since a run with overrides was stopped: left as it is; its bytes from "
                       "before that run are in %s", kept)
    _restore(saved)
    shutil.rmtree(EXPERIMENT_RESTORE)
    logger.warning(
        "a run with overrides was stopped before it could restore the workspace: %s have their bytes from before "
        "it again (its finished stages stay in DVC's run cache, its training checkpoints in .icrl/checkpoints)",
        ", ".join(str(path) for path in saved))
    return True


@contextlib.contextmanager
def dvc_experiment(overrides: dict[str, Any], name: str,
                   logger: logging.Logger | logging.LoggerAdapter | None = None) -> Iterator[None]:
    """Run the block as DVC experiment `name` with `overrides` (what `dvc exp run -S` does, stage by stage):
    params.yaml gets the overrides; when the block succeeds, `dvc exp save` records the workspace (params, dvc.lock,
    metrics); then, success or not, params.yaml, dvc.lock and the metrics files get their old bytes back and
    `dvc checkout` restores the outputs that dvc.lock names from the DVC cache. The old bytes are kept on disk
    too (EXPERIMENT_RESTORE) until then, so a run killed before its `finally` is undone by the next run."""
    from icrl_core.errors import UserError

    logger = logger or logging.getLogger(__name__)
    head = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], check=False, capture_output=True, text=True)
    if head.returncode != 0:
        raise UserError("a run with overrides is a DVC experiment, which needs a git repository with a commit "
                        "(git init && git add -A && git commit)")
    if _experiment_exists(name):
        raise UserError(f"a DVC experiment named '{name}' exists already (`dvc exp show`): choose another name")
    recover_interrupted_experiment(logger)
    saved = {path: path.read_bytes() if path.exists() else None for path in experiment_files()}
    _keep_for_restore(saved)
    try:
        apply_overrides(overrides)
    except BaseException:  # an invalid value: params.yaml was not written, nothing to undo later
        _restore(saved)
        shutil.rmtree(EXPERIMENT_RESTORE, ignore_errors=True)
        raise
    from icrl_core.io import atomic_write_text, sha256_file

    atomic_write_text(EXPERIMENT_RESTORE / "applied.sha256", sha256_file(PARAMS_FILE) + "\n")
    logger.info("experiment %s: params.yaml holds %s while it runs", name, overrides)
    try:
        yield
        included = [arg for path in saved if path.suffix == ".json" and path.exists()
                    for arg in ("--include-untracked", str(path))]  # metrics/ is git-ignored: include it
        done = _dvc("exp", "save", "--name", name, *included)
        if done.returncode != 0:
            raise RuntimeError(f"dvc exp save failed:\n{done.stdout}\n{done.stderr}")
        logger.info("experiment %s saved: `dvc exp show` lists it, `dvc exp apply %s` brings its results back",
                    name, name)
    finally:
        _restore(saved)
        shutil.rmtree(EXPERIMENT_RESTORE, ignore_errors=True)
        restored = _dvc("checkout")
        if restored.returncode != 0:
            logger.warning("dvc checkout could not restore every output (%s): the next `dvc repro` takes them from "
                           "DVC's run cache or recomputes them", (restored.stderr or restored.stdout).strip()[-500:])


def _experiment_name() -> str:
    from prefect.runtime import flow_run

    return f"{flow_run.name or 'pipeline'}-{time.strftime('%Y%m%d-%H%M%S')}"


@flow(name="icrl-pipeline", log_prints=True)
def pipeline_flow(overrides: dict[str, Any] | None = None, stages: list[str] | None = None,
                  experiment: str | None = None) -> dict:
    """The training pipeline: build_dataset -> tokenize -> bootstrap -> reward_model -> ppo (or dpo) -> adapt ->
    evaluate -> promote (the stages of dvc.yaml), each stage through DVC (unchanged stages are skipped), one run
    at a time per project folder.

    overrides: dotted config keys, e.g. {"ppo.kl_beta": 0.02}: the run is a DVC experiment with these params
    (listed by `dvc exp show`); params.yaml is unchanged afterwards.
    stages: run only these stages (in pipeline order); default all but those of the policy optimization not
    chosen (policy_optimization: ppo skips dpo; dpo skips reward_model, ppo and adapt).
    experiment: the experiment's name when there are overrides (default: the flow run's name and the time)."""
    logger = get_run_logger()
    with workspace_lock(logger):
        if not overrides:  # (dvc_experiment recovers on its own)
            recover_interrupted_experiment(logger)
            return _run_stages(stages)
        with dvc_experiment(overrides, experiment or _experiment_name(), logger):
            return _run_stages(stages)


def _run_stages(stages: list[str] | None) -> dict:
    from tasks.settings import load_config
    from tasks.stages import pipeline_stages, stage_names
    from tasks.tracking import PARENT_RUN_ENV, pipeline_run

    config = load_config(PARAMS_FILE if Path(PARAMS_FILE).exists() else None, [])
    pipeline = stage_names()  # dvc.yaml's stages, in order
    # default: every stage of the chosen policy optimization (config policy_optimization: ppo or dpo), the
    # critic's only with critic_in_pipeline
    selected = (pipeline_stages(config.policy_optimization, critic=config.critic_in_pipeline) if stages is None
                else [s for s in pipeline if s in stages])
    unknown = sorted(set(stages or []) - set(pipeline))
    if unknown:
        raise ValueError(f"unknown stages {unknown}; stages are {pipeline}")
    stage_task = dvc_stage.with_options(retries=config.prefect.task_retries,
                                        retry_delay_seconds=config.prefect.retry_delay_seconds)
    results: dict[str, dict] = {}
    with pipeline_run(config) as parent:
        env = {PARENT_RUN_ENV: parent.run_id} if parent.run_id else {}
        for stage in selected:
            results[stage] = stage_task(stage, env)
        parent.log_metrics({f"{stage}.{k}": v for stage, m in results.items() for k, v in m.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return results

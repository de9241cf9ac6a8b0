"""Prefect flows of the pipeline. They orchestrate only: each stage task runs `dvc repro --single-item STAGE`,
whose command (dvc.yaml) is `icrl stage STAGE`, which runs the stage module in tasks/ (training stages as Ray
Train jobs). So Prefect calls DVC, DVC calls the stage: DVC owns the data lineage and the cache (a run from the
Prefect UI and a `dvc repro` in a terminal share outputs and dvc.lock), Prefect owns scheduling, retries,
parameters from the UI, states and logs.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task

PARAMS_FILE = "params.yaml"


def _tool_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a stage subprocess: the venv's bin first on PATH (dvc and icrl live there)."""
    from tasks.env import DEFAULTS

    env = {**DEFAULTS, **os.environ, **(extra or {})}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _dvc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "dvc"), *args], capture_output=True, text=True,
                          env=_tool_env(env))


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


@flow(name="icrl-pipeline", log_prints=True)
def pipeline_flow(overrides: dict[str, Any] | None = None, stages: list[str] | None = None) -> dict:
    """The training pipeline: build_dataset -> tokenize -> bootstrap -> reward_model -> ppo -> adapt ->
    evaluate -> promote, each stage through DVC (unchanged stages are skipped).

    overrides: dotted config keys written into params.yaml first, e.g. {"ppo.kl_beta": 0.02}.
    stages: run only these stages (in pipeline order); default all."""
    from tasks.settings import load_config
    from tasks.stages import stage_names
    from tasks.tracking import PARENT_RUN_ENV, pipeline_run

    logger = get_run_logger()
    if overrides:
        apply_overrides(overrides)
        logger.info("params.yaml updated with %s", overrides)
    config = load_config(PARAMS_FILE if Path(PARAMS_FILE).exists() else None, [])
    pipeline = stage_names()  # dvc.yaml's stages, in order
    selected = [s for s in pipeline if stages is None or s in stages]
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

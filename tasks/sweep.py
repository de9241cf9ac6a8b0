"""Ray Tune sweeps over a training stage.

The search space comes from `sweep.search_space` (dotted config key -> distribution, one schema with
params.yaml). Each trial runs the stage's `train_worker` in a Tune function trainable with a runtime that
reports every step to Tune (so ASHA can stop weak trials early) and to its own MLflow child run under one sweep
run. Trials run `sweep.max_concurrent` at a time (2 on this 2-core machine). The best config is printed and
written to `<artifacts_dir>/sweep/best.json`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from icrl_core.checkpoint import TrainingState
from icrl_core.io import atomic_write_json
from tasks.settings import Choice, LogUniform, PipelineConfig, Uniform, with_overrides

log = logging.getLogger(__name__)

STAGE_MODULES = {"ppo": "tasks.ppo", "bootstrap": "tasks.bootstrap", "reward_model": "tasks.reward_model"}


def tune_space(space: Mapping[str, Any]) -> dict[str, Any]:
    """Config distributions -> Ray Tune sample domains."""
    from ray import tune

    out = {}
    for key, domain in space.items():
        if isinstance(domain, LogUniform):
            out[key] = tune.loguniform(domain.low, domain.high)
        elif isinstance(domain, Uniform):
            out[key] = tune.uniform(domain.low, domain.high)
        elif isinstance(domain, Choice):
            out[key] = tune.choice(domain.values)
        else:  # pragma: no cover - the schema only allows the three kinds
            raise TypeError(domain)
    return out


class TuneRuntime:
    """Runtime of one trial: every step is reported to Tune (ASHA decides from it) and MLflow."""

    rank = 0
    world_size = 1

    def __init__(self, checkpoint_dir: Path, tracker, metric: str):
        self.checkpoint_dir = checkpoint_dir
        self.tracker = tracker
        self.metric = metric

    def report(self, metrics: Mapping[str, float], step: int) -> None:
        from ray import tune

        self.tracker.log_metrics(metrics, step=step)
        if self.metric not in metrics:
            return  # e.g. PPO's step-0 validation: Tune (and ASHA) only see results carrying the sweep metric
        tune.report({**{k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}, "step": step})

    def save_checkpoint(self, state: TrainingState) -> None:
        return None  # trials are short and restartable; ASHA stops them anyway

    def load_latest_checkpoint(self) -> TrainingState | None:
        return None


def _trial(trial_params: dict, setup: dict) -> None:
    """A Tune function trainable (runs in a Ray worker)."""
    from ray import tune

    os.chdir(setup["cwd"])  # Tune starts trials in their own folder; stage paths are project-relative
    from tasks.tracking import Tracker
    from tasks.tracking import setup as mlflow_setup

    base = PipelineConfig.model_validate(setup["config"])
    trial_id = tune.get_context().get_trial_id()
    stage = setup["stage"]
    overrides = {**trial_params, f"{stage}.max_steps": setup["max_steps"],
                 f"{stage}.output_dir": str(Path(setup["root"]) / trial_id / stage)}
    config = with_overrides(base, overrides)
    tracker = Tracker()
    if config.tracking.enabled:
        mlflow = mlflow_setup(config.tracking)
        run = mlflow.MlflowClient().create_run(
            mlflow.get_experiment_by_name(config.tracking.experiment).experiment_id, run_name=f"trial-{trial_id}",
            tags={"mlflow.parentRunId": setup["parent_run_id"], "icrl.stage": f"sweep-{stage}"})
        tracker = Tracker(setup["tracking_uri"], run.info.run_id)
        tracker.log_params({k: v for k, v in trial_params.items()})
    import sys

    if setup["module_root"] not in sys.path:
        sys.path.insert(0, setup["module_root"])
    worker = importlib.import_module(setup["module"]).train_worker
    final = worker(config, TuneRuntime(Path(setup["root"]) / trial_id / "checkpoints", tracker,
                                          base.sweep.metric))
    tracker.log_metrics({k: v for k, v in final.items() if isinstance(v, (int, float))})
    if tracker.enabled:
        import mlflow

        mlflow.MlflowClient().set_terminated(tracker.run_id)


def run_sweep(config: PipelineConfig, module: str | None = None) -> dict[str, Any]:
    """Run the sweep; return {best_params, best_metric, trials}. `module` (default: the stage's module in
    tasks/) provides `train_worker`."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from tasks.ray_train import RAY_DIR, ensure_ray
    from tasks.tracking import pipeline_run, tracking_uri

    sweep = config.sweep
    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
    ensure_ray(config.ray)
    root = (Path(config.artifacts_dir) / "sweep").resolve()
    with pipeline_run(config, name=f"sweep-{sweep.stage}") as parent:
        module = module or STAGE_MODULES[sweep.stage]
        module_file = Path(importlib.import_module(module).__file__).resolve()
        setup = {"config": config.model_dump(mode="json"), "cwd": str(Path.cwd()), "stage": sweep.stage,
                 "module": module, "module_root": str(module_file.parents[module.count(".")]),
                 "max_steps": sweep.max_steps, "root": str(root), "parent_run_id": parent.run_id,
                 "tracking_uri": tracking_uri(config.tracking)}
        cpus = max(1, config.ray.num_cpus // sweep.max_concurrent)
        trainable = tune.with_resources(tune.with_parameters(_trial, setup=setup), {"cpu": cpus})
        scheduler = ASHAScheduler(time_attr="step", max_t=sweep.max_steps, grace_period=sweep.grace_period,
                                  reduction_factor=2)
        tuner = tune.Tuner(
            trainable,
            param_space=tune_space(sweep.search_space),
            tune_config=tune.TuneConfig(metric=sweep.metric, mode=sweep.mode, num_samples=sweep.num_samples,
                                        max_concurrent_trials=sweep.max_concurrent, scheduler=scheduler),
            run_config=tune.RunConfig(name=f"sweep-{sweep.stage}-{uuid.uuid4().hex[:6]}",
                                      storage_path=str((RAY_DIR / "ray_results").resolve())),
        )
        results = tuner.fit()
        errors = [str(r.error) for r in results if r.error is not None]
        if len(errors) == len(results):
            raise RuntimeError("every trial failed:\n" + "\n".join(errors[:3]))
        best = results.get_best_result(metric=sweep.metric, mode=sweep.mode, scope="last")
        trials = [{"params": r.config, "metric": (r.metrics or {}).get(sweep.metric),
                   "steps": (r.metrics or {}).get("step"), "error": str(r.error) if r.error else None}
                  for r in results]
        summary = {"stage": sweep.stage, "metric": sweep.metric, "mode": sweep.mode,
                   "best_params": best.config, "best_metric": best.metrics.get(sweep.metric),
                   "trials": trials, "parent_run_id": parent.run_id}
        parent.log_metrics({f"best_{sweep.metric}": summary["best_metric"] or 0.0})
        atomic_write_json(root / "best.json", summary)
        parent.log_artifact(root / "best.json")
    log.info("best %s = %s with %s", sweep.metric, summary["best_metric"], json.dumps(best.config))
    return summary

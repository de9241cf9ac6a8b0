"""Prefect flow around a Ray Tune sweep (the sweep itself is tasks/sweep.py)."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE


@task(name="ray-tune-sweep", cache_policy=NO_CACHE)
def sweep_task(overrides: dict[str, Any]) -> dict:
    from tasks.settings import load_config, with_overrides
    from tasks.sweep import run_sweep

    config = with_overrides(load_config("params.yaml", []), overrides)
    return run_sweep(config)


@flow(name="icrl-sweep")
def sweep_flow(overrides: dict[str, Any] | None = None) -> dict:
    """Ray Tune sweep over sweep.search_space (ASHA early stopping, sweep.max_concurrent trials at once, one
    MLflow child run per trial). overrides: dotted config keys for this sweep only (params.yaml unchanged)."""
    summary = sweep_task(overrides or {})
    get_run_logger().info("best %s = %s with %s", summary["metric"], summary["best_metric"], summary["best_params"])
    return summary

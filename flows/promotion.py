"""Prefect flow of the model registry: register an adapter and promote it (tasks/registry.py)."""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE


@task(name="register-and-promote", cache_policy=NO_CACHE)
def promote_task(adapter_dir: str, metric: float, metric_name: str) -> dict:
    from pathlib import Path

    from tasks.settings import load_config
    from tasks.registry import run_promotion

    return run_promotion(load_config("params.yaml", []), Path(adapter_dir), metric, metric_name, output=None)


@flow(name="icrl-promotion")
def promotion_flow(adapter_dir: str = "artifacts/ppo/adapter", metric: float = 0.0,
                   metric_name: str = "icrl_test_accuracy") -> dict:
    """Register adapter_dir as a new version of tracking.registered_model; alias it `champion` if `metric`
    beats the current champion's, else `challenger`."""
    result = promote_task(adapter_dir, metric, metric_name)
    get_run_logger().info("version %s -> %s", result["version"], result["alias"])
    return result

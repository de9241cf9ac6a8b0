"""Prefect flow of the model registry: register the adapter an evaluation measured and promote it through the
promotion gates (tasks/registry.py: run_promotion, the same path as the promote stage and `icrl promote`)."""

from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE


@task(name="register-and-promote", cache_policy=NO_CACHE)
def promote_task(evaluation: str) -> dict:
    from tasks.promote import run
    from tasks.settings import load_config

    # output=None: metrics/promote.json belongs to the DVC promote stage
    return run(load_config("params.yaml", []), evaluation, output=None)


@flow(name="icrl-promotion")
def promotion_flow(evaluation: str = "artifacts/evaluate/metrics.json") -> dict:
    """Register the adapter that `evaluation` (the evaluate stage's metrics file) measured as a new version of
    tracking.registered_model; alias it `champion` only if it passes the promotion gates and its evaluate.metric
    beats the current champion's, else `challenger`. There is no metric parameter: the metric and the gates come
    from the evaluation, and the adapter must still hold the bytes that were evaluated."""
    from flows.pipeline import workspace_lock

    with workspace_lock(get_run_logger()):  # not while a pipeline run rewrites the evaluation or the adapter
        result = promote_task(evaluation)
    get_run_logger().info("version %s -> %s", result["version"], result["alias"])
    return result

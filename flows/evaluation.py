"""Prefect flow of in-context RL evaluation: several strategies (and optionally an adapter) on one task, each
a task running the evaluation harness (tasks/icrl_eval.py), then one comparison plot."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE


@task(name="icrl-eval", task_run_name="{strategy}", cache_policy=NO_CACHE)
def eval_task(strategy: str, overrides: dict[str, Any]) -> dict:
    from tasks.icrl_eval import evaluate, run_dir_for
    from tasks.settings import load_config, with_overrides

    config = with_overrides(load_config("params.yaml", []), {**overrides, "icrl_eval.strategy": strategy})
    # A retried or re-triggered run continues its run folder instead of failing on it.
    return evaluate(config, resume=run_dir_for(config.icrl_eval).exists(), progress=False)


@flow(name="icrl-evaluation")
def evaluation_flow(strategies: list[str] | None = None, overrides: dict[str, Any] | None = None) -> dict:
    """In-context RL evaluation (Monea et al. 2024 protocol) of the configured model on icrl_eval.task with
    each strategy (default: zero_shot, naive, explorative). overrides: dotted config keys, e.g.
    {"icrl_eval.task": "trec_coarse", "model.init_adapter": "artifacts/ppo/adapter"}."""
    logger = get_run_logger()
    results = {}
    for strategy in strategies or ["zero_shot", "naive", "explorative"]:
        results[strategy] = eval_task(strategy, overrides or {})
        logger.info("%s: %s", strategy, {k: v for k, v in results[strategy].items() if "accuracy" in k})
    return results

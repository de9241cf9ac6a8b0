"""`icrl code-eval`: pass@1 and pass@k (the unbiased estimator of Chen et al., 2021) of the base model or a trained
adapter on code tasks (default: the held-out test split, whose templates training never sees), per difficulty
level and overall, written as JSON. Settings: the `code.eval` config section (docs/CODE_RL.md); the prompts,
sandbox and reward are code mode's (icrl_core/code_rl.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tasks.settings import PipelineConfig


def run_code_eval(config: PipelineConfig, adapter: Path | None = None, threads: int = 0,
                  echo: Callable[[str], None] = lambda line: None) -> dict:
    """Sample `code.eval.samples` completions of every chosen task (greedy when the temperature is 0), run them
    against the task's tests in the sandbox, and write `code.eval.output`: pass@k for each k of `code.eval.k`,
    mean test pass fraction and mean reward per level and overall, every task's counts and outcomes. The model
    is model.spec with `adapter` (None: the base model; model.init_adapter is not applied). Returns the
    result."""
    import torch

    from icrl_core.adapter_format import require_adapter
    from icrl_core.code_rl import CodeTaskSet, evaluate_tasks, pass_at_k_summary, per_level_sample
    from icrl_core.io import atomic_write_json
    from icrl_core.model import policy_from_config
    from icrl_core.rollout import Sampling

    cfg = config.code.eval
    if adapter is not None:
        require_adapter(adapter, "--adapter")
    if threads:
        torch.set_num_threads(threads)
    task_set = CodeTaskSet.from_config(config.code)
    tasks = per_level_sample(task_set.test if cfg.split == "test" else task_set.train, cfg.tasks_per_level,
                             config.seed)
    policy = policy_from_config(config.model.model_copy(update={"init_adapter": adapter}), seed=config.seed)
    sampling = Sampling(greedy=True) if cfg.temperature == 0 else Sampling(temperature=cfg.temperature)
    generator = torch.Generator().manual_seed(config.seed)
    max_tokens = min(config.data.episode_tokens, policy.context_window)
    per_chunk = max(1, cfg.batch_size // cfg.samples)  # tasks whose completions are generated together
    started = time.perf_counter()
    rows: list[dict] = []
    for start in range(0, len(tasks), per_chunk):
        rows += evaluate_tasks(policy, tasks[start:start + per_chunk], task_set.shot, config.code, cfg.samples,
                               sampling, cfg.max_new_tokens, max_tokens, generator, cfg.batch_size)
        done = min(start + per_chunk, len(tasks))
        echo(f"{done}/{len(tasks)} tasks, {sum(r['c'] for r in rows)} of {done * cfg.samples} completions pass "
             f"({time.perf_counter() - started:.0f} s)")
    table = pass_at_k_summary(rows, cfg.ks)
    result = {
        "model": config.model.spec, "dtype": config.model.dtype, "adapter": None if adapter is None else str(adapter),
        "split": cfg.split, "seed": config.seed, "task_seed": config.code.task_seed, "variants": config.code.variants,
        "samples": cfg.samples, "temperature": cfg.temperature, "decoding": "greedy" if cfg.temperature == 0
        else "sampled", "max_new_tokens": cfg.max_new_tokens, "k": cfg.ks, "tasks": len(tasks),
        "isolation": rows[0]["isolation"] if rows else None, "seconds": round(time.perf_counter() - started, 1),
        "overall": table.pop("overall"), "levels": table, "per_task": rows,
    }
    atomic_write_json(cfg.output, result)
    return result

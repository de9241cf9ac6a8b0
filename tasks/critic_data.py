"""Stage `critic_data`: trajectories for the in-context critic (docs/CRITIC.md). critic.data.samples_per_prompt
answers to each of critic.data.prompts train prompts and critic.data.val_prompts held-out prompts, sampled from
the reference policy (`model`, with model.init_adapter when set) at critic.data.temperature. The prompts
(critic.data.source): `episodes`, the first query of the first built episodes of each split (data.output_dir),
rewarded by exact match with the gold answer; `code`, code tasks (train split / held-out test split, a seeded
sample over the levels) prompted as code RL prompts them, each program run in the sandbox and rewarded by the
composed code reward (`code.reward`).

The jobs (prompt, sample) of each split are cut into batches of critic.data.batch_size, each batch drawing from its
own generator seeded by (seed, split, batch index) (icrl_core/critic.py `batch_generator`). With
critic.data.workers = 0 the stage's process generates every batch; with N >= 1, N Ray tasks (1 CPU and 1 torch
thread each, on a local Ray or ray.address; tasks/ray_train.ensure_ray) each load the reference policy once and
generate every N-th batch. Rows are put back in (split, batch index) order: the file is the same either way.

Outputs (atomic): critic.data.output_dir/trajectories.parquet (one row per trajectory: prompt_id, split, sample,
prompt_ids, trajectory_ids, reward, length, finished, answer, gold), metrics.json; metrics/critic_data.json;
MLflow metrics. Sampling is seeded by `seed`: a rerun writes the same file (code: up to the time-efficiency bonus,
which measures the tests' run time).
"""

from __future__ import annotations

import time
from pathlib import Path

from tasks.settings import PipelineConfig

STAGE = "critic_data"
HEADLINE = ("trajectories", "train_success_rate", "val_success_rate")


def trajectories_path(config: PipelineConfig) -> Path:
    return config.critic.data.trajectories_path


def split_prompts(config: PipelineConfig) -> dict[str, list]:
    """The prompts of each split: built episodes (source episodes) or code tasks (source code)."""
    from icrl_core.errors import UserError

    cfg = config.critic.data
    wanted = {"train": cfg.prompts, "val": cfg.val_prompts}
    if cfg.source == "code":
        from icrl_core.code_rl import CodeTaskSet, eval_sample

        task_set = CodeTaskSet.from_config(config.code)
        pools = {"train": task_set.train, "val": task_set.test}  # held out: templates code RL never trains on
        return {split: eval_sample(pools[split], count, config.seed) for split, count in wanted.items()}
    from icrl_core.episodes import read_episodes

    folder = Path(config.data.output_dir)
    prompts = {split: read_episodes(folder / f"{split}.jsonl")[:count] if count else []
               for split, count in wanted.items()}
    if not prompts["train"]:
        raise UserError(f"{folder / 'train.jsonl'} has no episodes: run `icrl stage build_dataset` first")
    return prompts


def all_batches(config: PipelineConfig, prompts: dict[str, list]) -> list:
    """Every generation batch, train then val (icrl_core/critic.py `generation_batches`)."""
    from icrl_core.critic import SPLITS, generation_batches

    cfg = config.critic.data
    return [batch for split in SPLITS
            for batch in generation_batches(prompts[split], cfg.samples_per_prompt, cfg.batch_size, split)]


def sample_batches(config: PipelineConfig, policy, batches) -> list[tuple[tuple[int, int], list[dict]]]:
    """Each batch's rows, keyed by its place in the file (`GenerationBatch.order`)."""
    from icrl_core.critic import sample_episode_batch
    from icrl_core.critic_code import sample_code_batch
    from icrl_core.rollout import Sampling

    cfg = config.critic.data
    sampling = Sampling(temperature=cfg.temperature)
    max_tokens = min(config.data.episode_tokens + cfg.max_new_tokens, policy.context_window)
    if cfg.source == "code":
        from icrl_core.code_rl import CodeTaskSet

        shot = CodeTaskSet.from_config(config.code).shot
        return [(batch.order, sample_code_batch(policy, batch, shot, config.code, sampling, cfg.max_new_tokens,
                                                max_tokens, config.seed)) for batch in batches]
    return [(batch.order, sample_episode_batch(policy, batch, sampling, cfg.max_new_tokens, max_tokens,
                                               config.seed)) for batch in batches]


def generate_share(config: dict, cwd: str, batches) -> list[tuple[tuple[int, int], list[dict]]]:
    """One Ray task: load the reference policy once, generate its share of the batches. It runs in the driver's
    project folder when that path exists on its node (relative paths, e.g. model.init_adapter, read as on the
    driver), renders with the driver's task templates, on one torch thread (its one CPU)."""
    import os

    import torch

    from icrl_core.model import policy_from_config
    from icrl_core.task_data import register_task_templates

    torch.set_num_threads(1)
    if Path(cwd).is_dir():
        os.chdir(cwd)
    settings = PipelineConfig.model_validate(config)
    register_task_templates(settings.data)  # as the driver did (tasks/cli_stages.run_stage)
    policy = policy_from_config(settings.model, seed=settings.seed)
    return sample_batches(settings, policy, batches)


def generate_on_ray(config: PipelineConfig, batches) -> list[tuple[tuple[int, int], list[dict]]]:
    """critic.data.workers Ray tasks, task w generating batches w, w + N, w + 2N, ... (round robin, so each gets
    train and val batches alike)."""
    import ray
    from ray.exceptions import RayTaskError

    from tasks.ray_train import ensure_ray

    ensure_ray(config.ray)
    workers = config.critic.data.workers
    task = ray.remote(generate_share).options(num_cpus=1)
    settings = config.model_dump(mode="json")
    calls = [task.remote(settings, str(Path.cwd()), batches[w::workers]) for w in range(workers) if batches[w::workers]]
    try:
        shares = ray.get(calls)
    except RayTaskError as error:  # the task's own exception (e.g. a UserError: exit 2 with its message)
        raise error.as_instanceof_cause() from None
    return [keyed for share in shares for keyed in share]


def generate(config: PipelineConfig) -> tuple[dict, list[dict]]:
    """Sample and reward the trajectories; return (metrics, rows in file order)."""
    from icrl_core.model import policy_from_config

    cfg = config.critic.data
    started = time.perf_counter()
    prompts = split_prompts(config)
    batches = all_batches(config, prompts)
    if cfg.workers:
        keyed = generate_on_ray(config, batches)
    else:
        keyed = sample_batches(config, policy_from_config(config.model, seed=config.seed), batches)
    rows = [row for _, part in sorted(keyed, key=lambda item: item[0]) for row in part]
    metrics: dict = {"trajectories": len(rows), "seconds": round(time.perf_counter() - started, 2),
                     "workers": cfg.workers}
    for split, part_prompts in prompts.items():
        metrics[f"{split}_prompts"] = len(part_prompts)
        metrics.update(split_metrics(split, [r for r in rows if r["split"] == split]))
    return metrics, rows


def split_metrics(split: str, rows: list[dict]) -> dict:
    """Success rate (exact match; code: every test passed), mean reward, mean length, share cut at
    max_new_tokens, and the prompts with mixed outcomes: some but not all of their samples succeed (only there
    does reading the earlier attempts tell the critic anything beyond the prompt)."""
    import numpy as np

    if not rows:
        return {}
    by_prompt: dict[str, list[bool]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_id"], []).append(r["success"])
    return {f"{split}_success_rate": float(np.mean([r["success"] for r in rows])),
            f"{split}_mean_reward": float(np.mean([r["reward"] for r in rows])),
            f"{split}_max_reward": float(max(r["reward"] for r in rows)),
            f"{split}_mean_length": float(np.mean([r["length"] for r in rows])),
            f"{split}_unfinished": float(np.mean([not r["finished"] for r in rows])),
            f"{split}_mixed_prompts": int(sum(0 < np.mean(v) < 1 for v in by_prompt.values()))}


def run(config: PipelineConfig) -> dict:
    from icrl_core.critic import trajectory_table_bytes
    from icrl_core.io import atomic_write_bytes, atomic_write_json
    from tasks.cli_common import console
    from tasks.runtime import write_stage_metrics
    from tasks.tracking import stage_run

    with stage_run(config, STAGE) as tracker:
        metrics, rows = generate(config)
        path = trajectories_path(config)
        atomic_write_bytes(path, trajectory_table_bytes(rows))
        atomic_write_json(path.parent / "metrics.json", metrics)
        tracker.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    write_stage_metrics(STAGE, metrics, headline=HEADLINE)
    console(stderr=True).print(f"critic data: {metrics['trajectories']} trajectories, train success "
                               f"{metrics.get('train_success_rate', float('nan')):.3f} -> {path}")
    return metrics

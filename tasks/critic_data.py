"""Stage `critic_data`: trajectories for the in-context critic (docs/CRITIC.md). critic.data.samples_per_prompt
answers to the first query of the first critic.data.prompts train episodes and critic.data.val_prompts val
episodes of the built dataset (data.output_dir), sampled from the reference policy (`model`, with
model.init_adapter when set) at critic.data.temperature and rewarded by exact match with the gold answer.

Outputs (atomic): critic.data.output_dir/trajectories.parquet (one row per trajectory: prompt_id, split, sample,
prompt_ids, trajectory_ids, reward, length, finished, answer, gold), metrics.json; metrics/critic_data.json;
MLflow metrics. Sampling is seeded by `seed`: a rerun writes the same file.
"""

from __future__ import annotations

import time
from pathlib import Path

from tasks.settings import PipelineConfig

STAGE = "critic_data"
HEADLINE = ("trajectories", "train_success_rate", "val_success_rate")


def trajectories_path(config: PipelineConfig) -> Path:
    return Path(config.critic.data.output_dir) / "trajectories.parquet"


def generate(config: PipelineConfig) -> tuple[dict, list[dict]]:
    """Sample and reward the trajectories; return (metrics, rows)."""
    import numpy as np
    import torch

    from icrl_core.critic import sample_trajectories
    from icrl_core.episodes import read_episodes
    from icrl_core.errors import UserError
    from icrl_core.model import policy_from_config
    from icrl_core.rollout import Sampling

    cfg = config.critic.data
    started = time.perf_counter()
    folder = Path(config.data.output_dir)
    wanted = {"train": cfg.prompts, "val": cfg.val_prompts}
    episodes = {split: read_episodes(folder / f"{split}.jsonl")[:count] if count else []
                for split, count in wanted.items()}
    if not episodes["train"]:
        raise UserError(f"{folder / 'train.jsonl'} has no episodes: run `icrl stage build_dataset` first")
    policy = policy_from_config(config.model, seed=config.seed)
    sampling = Sampling(temperature=cfg.temperature)
    max_tokens = min(config.data.episode_tokens + cfg.max_new_tokens, policy.context_window)
    generator = torch.Generator().manual_seed(config.seed)
    rows: list[dict] = []
    for split in ("train", "val"):
        rows += sample_trajectories(policy, episodes[split], cfg.samples_per_prompt, sampling, cfg.max_new_tokens,
                                    max_tokens, generator, cfg.batch_size, split)
    metrics: dict = {"trajectories": len(rows), "seconds": round(time.perf_counter() - started, 2)}
    for split in ("train", "val"):
        part = [r for r in rows if r["split"] == split]
        metrics[f"{split}_prompts"] = len(episodes[split])
        if part:
            metrics[f"{split}_success_rate"] = float(np.mean([r["reward"] for r in part]))
            metrics[f"{split}_mean_length"] = float(np.mean([r["length"] for r in part]))
            metrics[f"{split}_unfinished"] = float(np.mean([not r["finished"] for r in part]))
            # prompts where some but not all samples succeed: the ones where telling attempts apart matters
            by_prompt: dict[str, list[float]] = {}
            for r in part:
                by_prompt.setdefault(r["prompt_id"], []).append(r["reward"])
            metrics[f"{split}_mixed_prompts"] = int(sum(0 < np.mean(v) < 1 for v in by_prompt.values()))
    return metrics, rows


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

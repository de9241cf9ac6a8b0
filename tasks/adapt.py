"""Stage `adapt`: test-time adaptation (icrl_core/adapt.py) on `adapt.num_requests` request episodes.

Inputs: the requests (adapt.requests_file, default data.output_dir/val.jsonl) and the adapter they are answered
with (adapt.adapter, default ppo.output_dir/adapter, else model.init_adapter, else a fresh LoRA). Outputs: adapt.
output_dir/report.json (per request: answers and reward before/after, synthetic reward, losses), metrics/adapt.
json, MLflow. The adapter on disk is only read; its sha256 is checked before and after. Finished requests are
checkpointed every adapt.save_steps requests, so a killed run resumes with the next request (each request uses
its own seeded RNG, so results are the same as an uninterrupted run).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from icrl_core.errors import UserError
from tasks.settings import PipelineConfig

STAGE = "adapt"
HEADLINE = ("mean_reward_before", "mean_reward_after")  # metrics/adapt.json; the rest: output_dir/report.json


def start_adapter(config: PipelineConfig) -> Path | None:
    """The adapter the requests are answered with (see AdaptConfig.adapter)."""
    from icrl_core.adapter_format import is_adapter_folder, require_adapter

    if config.adapt.adapter is not None:
        return require_adapter(config.adapt.adapter, "adapt.adapter")
    ppo_adapter = Path(config.ppo.output_dir) / "adapter"
    if is_adapter_folder(ppo_adapter):
        return ppo_adapter
    return config.model.init_adapter


def start_digest(folder: Path | None) -> str | None:
    """The start adapter's digest (None: a fresh LoRA), to check that adaptation never writes to it."""
    from icrl_core.io import sha256_folder

    return sha256_folder(folder) if folder is not None else None


def load_requests(config: PipelineConfig, path: Path | None = None):
    from icrl_core.episodes import read_episodes

    path = Path(path or config.adapt.requests_file or Path(config.data.output_dir) / "val.jsonl")
    if not path.exists():
        raise UserError(f"{path}: no request episodes; run `icrl stage build_dataset` or set adapt.requests_file")
    return read_episodes(path)


def load_adapt_policy(config: PipelineConfig, adapter: Path | None):
    from icrl_core.model import policy_from_config

    if config.model.adapter.kind == "none":
        raise UserError("test-time adaptation trains a temporary adapter: set model.adapter.kind to lora or "
                        "last_blocks")
    return policy_from_config(config.model, seed=config.seed, init_adapter=adapter)


def request_generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + 7_919 * (index + 1))


def adapt_scorer(config: PipelineConfig):
    from tasks.ppo import load_scorer

    return load_scorer(config, config.adapt.reward, config.adapt.reward_model_path or config.ppo.reward_model_path)


def summarize(results: list[dict]) -> dict:
    n = max(len(results), 1)
    return {
        "num_requests": len(results),
        "mean_reward_before": sum(r["reward_before"] for r in results) / n,
        "mean_reward_after": sum(r["reward_after"] for r in results) / n,
        "mean_score_before": sum(r["score_before"] for r in results) / n,
        "mean_score_after": sum(r["score_after"] for r in results) / n,
        "mean_synthetic_reward": sum(r["synthetic_reward"] for r in results) / n,
        "improved": sum(r["reward_after"] > r["reward_before"] for r in results),
        "worsened": sum(r["reward_after"] < r["reward_before"] for r in results),
    }


def train_worker(config: PipelineConfig, runtime) -> dict:
    from tqdm.auto import tqdm

    from icrl_core.adapt import adapt_and_answer
    from icrl_core.checkpoint import TrainingState
    from icrl_core.distributed import shard
    from tasks.ppo import max_episode_tokens

    cfg = config.adapt
    requests = load_requests(config)[:cfg.num_requests]
    adapter = start_adapter(config)
    digest = start_digest(adapter)
    policy = load_adapt_policy(config, adapter)
    scorer = adapt_scorer(config)
    indices = shard(list(range(len(requests))))
    results: list[dict] = []
    state = runtime.load_latest_checkpoint()
    if state is not None:
        results = list(state.extra["results"])
    bar = tqdm(total=len(indices), initial=len(results), desc=STAGE, unit="request", disable=runtime.rank != 0)
    for position in range(len(results), len(indices)):
        index = indices[position]
        result = adapt_and_answer(policy, requests[index], cfg, max_episode_tokens(config, policy),
                                  request_generator(config.seed, index), scorer).as_dict()
        results.append(result)
        runtime.report({"reward_before": result["reward_before"], "reward_after": result["reward_after"],
                        "synthetic_reward": result["synthetic_reward"]}, position + 1)
        bar.update(1)
        bar.set_postfix(before=f"{result['reward_before']:.2f}", after=f"{result['reward_after']:.2f}",
                        refresh=False)
        if (position + 1) % cfg.save_steps == 0 and position + 1 < len(indices):
            runtime.save_checkpoint(TrainingState(position + 1, {"requests_done": torch.tensor([position + 1])},
                                                  optimizer={}, extra={"results": results}))
    bar.close()
    if start_digest(adapter) != digest:
        raise RuntimeError(f"{adapter}: the base adapter changed during adaptation")
    from icrl_core.distributed import mean_metrics

    metrics = mean_metrics(summarize(results))
    metrics["base_adapter"] = str(adapter) if adapter is not None else "fresh"
    metrics["base_adapter_unchanged"] = True
    if runtime.rank == 0:
        from icrl_core.io import atomic_write_json

        atomic_write_json(Path(cfg.output_dir) / "report.json", {"summary": metrics, "requests": results})
    return metrics


def run(config: PipelineConfig) -> dict:
    from tasks.runtime import launch, write_stage_metrics
    from tasks.tracking import stage_run

    started = time.perf_counter()
    with stage_run(config, STAGE) as tracker:
        metrics = launch(config, STAGE, train_worker, tracker)
        metrics["seconds"] = round(time.perf_counter() - started, 2)
        tracker.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        tracker.log_artifact(Path(config.adapt.output_dir) / "report.json")
    write_stage_metrics(STAGE, metrics, headline=HEADLINE)
    return metrics

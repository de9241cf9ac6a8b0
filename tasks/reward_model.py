"""Stage `reward_model`: a scalar head on the base or bootstrapped model trained with the Bradley-Terry loss on
(prompt + preferred) vs (prompt + rejected) from the tokenized episodes (icrl_core/supervised.py). Output:
reward_model.output_dir/model/ (adapter.safetensors + reward_head.safetensors + reward_model.json; load it with
`icrl_core.reward_model.load_reward_model`, e.g. as ppo.reward_model_path), metrics.json, history.json, curves.png;
metrics/reward_model.json; MLflow. Resumes after a kill like the bootstrap.
"""

from __future__ import annotations

from pathlib import Path

from icrl_core.errors import UserError
from tasks.settings import PipelineConfig

STAGE = "reward_model"
HEADLINE = ("val_pairwise_accuracy",)  # metrics/reward_model.json; the rest: output_dir/metrics.json


def model_dir(config: PipelineConfig) -> Path:
    """Where the trained reward model goes (the path to give ppo.reward_model_path)."""
    return Path(config.reward_model.output_dir) / "model"


def start_adapter(config: PipelineConfig) -> Path | None:
    """The adapter the reward model starts from: the bootstrap output, or model.init_adapter for base='base'."""
    if config.reward_model.base == "base":
        return config.model.init_adapter
    adapter = Path(config.bootstrap.output_dir) / "adapter"
    from icrl_core.adapter_format import is_adapter_folder

    if not is_adapter_folder(adapter):
        raise UserError(f"reward_model.base=bootstrap but {adapter} does not exist: run `icrl stage bootstrap` "
                        "first, or set reward_model.base=base")
    return adapter


def train_worker(config: PipelineConfig, runtime) -> dict:
    import torch

    from icrl_core.reward_model import new_reward_model, save_reward_model
    from icrl_core.supervised import episode_pairs, finite, train_reward_model
    from icrl_core.tokenized import read_tokenized
    from tasks.runtime import ProgressRuntime
    from tasks.training import write_history

    cfg = config.reward_model
    rows = read_tokenized(config.tokenize.output_dir)
    train = episode_pairs([r for r in rows if r.split == "train"])
    val = episode_pairs([r for r in rows if r.split == "val"])
    reward_model = new_reward_model(config.model, start_adapter(config), seed=config.seed)
    with ProgressRuntime(runtime, cfg.max_steps, STAGE, ("loss", "accuracy", "val_pairwise_accuracy")) as progress:
        metrics, history = train_reward_model(reward_model, train, val, cfg, config.seed, progress)
    if runtime.rank == 0:
        # the reward scale from the last evaluation's forward passes (no second scoring of the same pairs)
        stats = ({"mean": metrics["val_reward_mean"], "std": metrics["val_reward_std"], "pairs": int(metrics["val_pairs"])}
                 if "val_reward_mean" in metrics else {})
        save_reward_model(model_dir(config), reward_model, {
            "base": cfg.base, "start_adapter": str(start_adapter(config) or ""), "reward_stats": stats,
            "metrics": finite(metrics), "torch": torch.__version__,
        })
        write_history(Path(cfg.output_dir), history, {
            "Bradley-Terry loss": ["loss", "val_loss"], "pairwise accuracy": ["accuracy", "val_pairwise_accuracy"],
            "reward margin": ["margin", "val_margin"]}, f"reward model ({config.model.spec}, from {cfg.base})")
    return finite(metrics)


def run(config: PipelineConfig) -> dict:
    from tasks.training import run_training_stage

    start_adapter(config)  # fail early, before any run is opened, when the bootstrap output is missing
    return run_training_stage(config, STAGE, train_worker, config.reward_model.output_dir,
                              {"model": "reward_model", "curves.png": None}, HEADLINE)

"""Stage `bootstrap`: supervised training on the answer tokens of the tokenized episodes with a KL(policy ||
base) penalty (icrl_core/supervised.py).

Outputs (rank 0, atomic): bootstrap.output_dir/adapter/ (policy.save_adapter), metrics.json, history.json (every
step's metrics, for `dvc plots`), curves.png; metrics/bootstrap.json; MLflow params, step metrics, the adapter and
the curves. Resumes from the last checkpoint after a kill (the runtime finds it); a corrupt checkpoint is refused
(CheckpointError, exit code 2).
"""

from __future__ import annotations

from pathlib import Path

from tasks.settings import PipelineConfig

STAGE = "bootstrap"
HEADLINE = ("val_answer_accuracy", "val_kl")  # metrics/bootstrap.json; the rest: output_dir/metrics.json


def train_worker(config: PipelineConfig, runtime) -> dict:
    from icrl_core.model import policy_from_config
    from icrl_core.supervised import finite, train_bootstrap
    from icrl_core.tokenized import read_tokenized

    cfg = config.bootstrap
    rows = read_tokenized(config.tokenize.output_dir)
    train = [r for r in rows if r.split == "train"]
    val = [r for r in rows if r.split == "val"]
    from tasks.runtime import ProgressRuntime
    from tasks.training import replay_chats, write_history

    policy = policy_from_config(config.model, seed=config.seed)
    with ProgressRuntime(runtime, cfg.max_steps, STAGE, ("loss", "kl", "val_answer_accuracy")) as progress:
        replay = replay_chats(config, policy, runtime.rank)
        metrics, history = train_bootstrap(policy, train, val, cfg, config.seed, progress, replay=replay)
    if runtime.rank == 0:
        out = Path(cfg.output_dir)
        policy.save_adapter(out / "adapter")
        panels = {"loss": ["loss", "ce", "val_loss", "val_ce"],
                  "KL(policy || base)": ["kl", "val_kl", "replay_kl", "val_replay_kl"],
                  "validation answer accuracy": ["val_answer_accuracy"]}
        write_history(out, history, panels, f"bootstrap ({config.model.spec})")
    return finite(metrics)


def run(config: PipelineConfig) -> dict:
    from tasks.training import run_training_stage

    return run_training_stage(config, STAGE, train_worker, config.bootstrap.output_dir,
                              {"adapter": "adapter", "curves.png": None}, HEADLINE)

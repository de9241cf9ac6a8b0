"""Stage `bootstrap`: supervised training on the answer tokens of the tokenized episodes with a KL(policy ||
base) penalty (icrl_core/supervised.py).

Outputs (rank 0, atomic): bootstrap.output_dir/adapter/ (policy.save_adapter), metrics.json, history.json (every
step's metrics, for `dvc plots`), curves.png; metrics/bootstrap.json; MLflow params, step metrics, the adapter and
the curves. Resumes from the last checkpoint after a kill (the runtime finds it); a corrupt checkpoint is refused
(CheckpointError, exit code 2).
"""

from __future__ import annotations

import io
import time
from pathlib import Path

from tasks.settings import PipelineConfig

STAGE = "bootstrap"
HEADLINE = ("val_answer_accuracy", "val_kl")  # metrics/bootstrap.json; the rest: output_dir/metrics.json


def write_history(folder: Path, history: list[dict], panels: dict[str, list[str]], title: str) -> None:
    """history.json (one record per step, for `dvc plots`) and curves.png (one panel per group of keys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from icrl_core.io import atomic_write_bytes, atomic_write_json
    from icrl_core.supervised import finite

    from tasks.runtime import plot_records

    atomic_write_json(folder / "history.json", plot_records([finite(h) for h in history]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, (name, keys) in zip(axes[0], panels.items()):
        for key in keys:
            points = [(h["step"], h[key]) for h in history if h.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o" if key.startswith("val_") else None, markersize=3, label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(folder / "curves.png", buffer.getvalue())


def replay_chats(config: PipelineConfig, policy, rank: int) -> tuple[list, list] | None:
    """The replay chats (train, validation) when bootstrap.replay.beta > 0: read from output_dir/replay.jsonl if
    it was generated with the same settings, else sampled from the base model (every rank samples the same
    ones: deterministic in the seed) and written there by rank 0."""
    import hashlib
    import json

    from icrl_core.replay import read_replay, replay_prompts, sample_replies, write_replay
    from icrl_core.task_data import load_task

    replay = config.bootstrap.replay
    if replay.beta <= 0:
        return None
    key = hashlib.sha256(json.dumps({"spec": config.model.spec, "seed": config.seed,
                                     "tasks_dir": str(config.data.tasks_dir),
                                     **replay.model_dump(mode="json", exclude={"beta", "per_step"})},
                                    sort_keys=True).encode()).hexdigest()[:16]
    path = Path(config.bootstrap.output_dir) / "replay.jsonl"
    chats = read_replay(path, key)
    if chats is None:
        from tqdm import tqdm

        texts = [ex.text for name in replay.tasks
                 for ex in load_task(name, config.data.tasks_dir, seed=config.seed).train]
        prompts = replay_prompts(texts, replay.prompts, config.seed)
        chats = sample_replies(policy, prompts, replay.max_new_tokens, replay.temperature, config.seed,
                               progress=lambda b: tqdm(b, desc="replay: sampling base replies", unit="batch"))
        if rank == 0:
            write_replay(path, chats, key)
    val = chats[::10]
    train = [c for i, c in enumerate(chats) if i % 10]
    return train, val


def train_worker(config: PipelineConfig, runtime) -> dict:
    from icrl_core.model import policy_from_config
    from icrl_core.supervised import finite, train_bootstrap
    from icrl_core.tokenized import read_tokenized

    cfg = config.bootstrap
    rows = read_tokenized(config.tokenize.output_dir)
    train = [r for r in rows if r.split == "train"]
    val = [r for r in rows if r.split == "val"]
    from tasks.runtime import ProgressRuntime

    policy = policy_from_config(config.model, seed=config.seed)
    progress = ProgressRuntime(runtime, cfg.max_steps, STAGE, ("loss", "kl", "val_answer_accuracy"))
    try:
        replay = replay_chats(config, policy, runtime.rank)
        metrics, history = train_bootstrap(policy, train, val, cfg, config.seed, progress, replay=replay)
    finally:
        progress.close()
    if runtime.rank == 0:
        out = Path(cfg.output_dir)
        policy.save_adapter(out / "adapter")
        panels = {"loss": ["loss", "ce", "val_loss", "val_ce"],
                  "KL(policy || base)": ["kl", "val_kl", "replay_kl", "val_replay_kl"],
                  "validation answer accuracy": ["val_answer_accuracy"]}
        write_history(out, history, panels, f"bootstrap ({config.model.spec})")
    return finite(metrics)


def run(config: PipelineConfig) -> dict:
    from icrl_core.io import atomic_write_json
    from tasks.runtime import launch, write_stage_metrics
    from tasks.tracking import stage_run

    started = time.perf_counter()
    with stage_run(config, STAGE) as tracker:
        metrics = launch(config, STAGE, train_worker, tracker)
        metrics["seconds"] = round(time.perf_counter() - started, 2)
        tracker.log_metrics({"stage_seconds": metrics["seconds"]})
        out = Path(config.bootstrap.output_dir)
        atomic_write_json(out / "metrics.json", metrics)
        tracker.log_artifact(out / "adapter", "adapter")
        tracker.log_artifact(out / "curves.png")
    write_stage_metrics(STAGE, metrics, headline=HEADLINE)
    return metrics

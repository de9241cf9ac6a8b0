"""The stage side of the shared training loop (icrl_core/training_loop.py) for bootstrap, reward_model and ppo:
the run (MLflow run, launch in-process or on Ray, stage seconds, metrics.json, artifacts, metrics/STAGE.json),
the learning-curve files of `dvc plots`, and the general-chat replay chats of bootstrap and dpo (`replay_chats`).

    run_training_stage(config, STAGE, train_worker, output_dir, artifacts, headline)

runs `train_worker(config, runtime)` (tasks/runtime.launch), which builds the stage's Trainer and runs the loop
inside `with ProgressRuntime(runtime, ...) as progress` (tasks/runtime.py), and writes its outputs on rank 0.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from tasks.settings import PipelineConfig


def run_training_stage(config: PipelineConfig, stage: str, train_worker, output_dir: Path | str,
                       artifacts: Mapping[str, str | None], headline: Iterable[str],
                       log_summary: bool = False) -> dict:
    """Run `train_worker` for `stage` in an MLflow run; then write output_dir/metrics.json (the final metrics and
    the stage's wall seconds), log `stage_seconds` (and, with `log_summary`, every numeric final metric), log
    each of `artifacts` (a name under output_dir -> its MLflow artifact folder, None: the root) and write the
    headline metrics to metrics/STAGE.json. Returns the final metrics."""
    from icrl_core.io import atomic_write_json
    from tasks.runtime import launch, write_stage_metrics
    from tasks.tracking import stage_run

    started = time.perf_counter()
    out = Path(output_dir)
    with stage_run(config, stage) as tracker:
        metrics = launch(config, stage, train_worker, tracker)
        metrics["seconds"] = round(time.perf_counter() - started, 2)
        atomic_write_json(out / "metrics.json", metrics)
        logged = {"stage_seconds": metrics["seconds"]}
        if log_summary:
            logged.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        tracker.log_metrics(logged)
        for name, artifact_path in artifacts.items():
            tracker.log_artifact(out / name, artifact_path)
    write_stage_metrics(stage, metrics, headline=headline)
    return metrics


def plot_records(records: list[dict]) -> list[dict]:
    """Records with one set of keys (missing values null): `dvc plots` ignores a list whose records differ,
    and validation metrics exist only on evaluation steps."""
    keys = sorted({key for record in records for key in record})
    return [{key: record.get(key) for key in keys} for record in records]


def write_history(folder: Path, history: list[dict], panels: dict[str, list[str]], title: str) -> None:
    """history.json (one record per step, for `dvc plots`) and curves.png (one panel per group of keys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from icrl_core.io import atomic_write_bytes, atomic_write_json
    from icrl_core.supervised import finite

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


# Sampled replay replies, kept outside the stage's DVC out (DVC deletes it before the stage runs, and sampling takes
# minutes): one file per `replay_key`, so a rerun after a crash, or with other training settings, reuses them.
REPLAY_CACHE = Path(".icrl") / "replay"
_REPLAY_SOURCES = ("icrl_core/replay.py", "icrl_core/chat.py", "icrl_core/model.py", "icrl_core/task_data.py")


def replay_key(config: PipelineConfig, replay=None) -> str:
    """What the replay chats of `replay` (default bootstrap.replay; the dpo stage passes dpo.replay) depend on:
    the base model (its spec and the dtype resolved on this machine; the replies are sampled with the adapters
    disabled), the seed, the data folder, the replay settings that shape the chats (not beta or per_step, which
    only weigh them) and the code that samples them. Not the stage: both stages share chats of equal settings."""
    from icrl_core.model import resolve_dtype
    from tasks.runtime import content_key

    replay = config.bootstrap.replay if replay is None else replay
    return content_key({"spec": config.model.spec, "dtype": resolve_dtype(config.model.dtype), "seed": config.seed,
                        "tasks_dir": str(Path(config.data.tasks_dir).resolve()),
                        **replay.model_dump(mode="json", exclude={"beta", "per_step"})}, _REPLAY_SOURCES)


def replay_chats(config: PipelineConfig, policy, rank: int, replay=None) -> tuple[list, list] | None:
    """The replay chats (train, validation) of `replay` (default bootstrap.replay) when its beta > 0: read from the cache
    (.icrl/replay/<replay_key>.jsonl) when they were sampled before, else sampled from the base model (every rank
    samples the same ones: deterministic in the seed) and written there atomically by rank 0."""
    from icrl_core.replay import read_replay, replay_prompts, sample_replies, write_replay
    from icrl_core.task_data import load_task

    replay = config.bootstrap.replay if replay is None else replay
    if replay.beta <= 0:
        return None
    key = replay_key(config, replay)
    path = REPLAY_CACHE / f"{key}.jsonl"
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

"""How a training stage runs: in this process, or as a Ray Train job (see tasks/ray_train.py).

A stage module provides `train_worker(config, runtime) -> dict` (the loop, run on every worker) and calls
`launch(config, stage, train_worker)`. The loop talks to its runtime only:

    runtime.report(metrics, step)            metrics of one step (MLflow from rank 0; Ray report under Ray)
    runtime.save_checkpoint(state)           atomic checkpoint (local stage folder; Ray checkpoint under Ray)
    runtime.load_latest_checkpoint()         the newest verified checkpoint, or None

so the same loop runs under both, and a killed stage resumes from its last checkpoint either way.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Self

from icrl_core.checkpoint import TrainingState, latest_checkpoint, read_checkpoint, save_rotating
from icrl_core.io import atomic_write_json
from tasks.settings import PipelineConfig

log = logging.getLogger(__name__)


class Runtime(Protocol):
    rank: int
    world_size: int
    checkpoint_dir: Path

    def report(self, metrics: Mapping[str, float], step: int) -> None: ...

    def save_checkpoint(self, state: TrainingState) -> None: ...

    def load_latest_checkpoint(self) -> TrainingState | None: ...


@dataclass
class LocalRuntime:
    """One process; checkpoints in `checkpoint_dir`; metrics to a Tracker (MLflow) and an in-memory history."""

    checkpoint_dir: Path
    tracker: object | None = None
    rank: int = 0
    world_size: int = 1
    keep_checkpoints: int = 2
    history: list[dict] = field(default_factory=list)

    def report(self, metrics: Mapping[str, float], step: int) -> None:
        self.history.append({"step": step, **metrics})
        if self.tracker is not None and self.rank == 0:
            self.tracker.log_metrics(metrics, step=step)

    def save_checkpoint(self, state: TrainingState) -> None:
        if self.rank == 0:
            save_rotating(self.checkpoint_dir, state, keep=self.keep_checkpoints)

    def load_latest_checkpoint(self) -> TrainingState | None:
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return None
        log.info("resuming from %s", path)
        return read_checkpoint(path)


TrainWorker = Callable[[PipelineConfig, Runtime], dict]


CHECKPOINT_ROOT = Path(".icrl") / "checkpoints"


def stage_param_keys(stage: str) -> list[str]:
    """Dotted config keys that change `stage`'s result: the params dvc.yaml gives it and its upstream stages
    (tasks/stages.py), sorted."""
    from tasks.stages import load_stages, upstream_closure

    stages = load_stages()
    return sorted({key for name in upstream_closure(stage) for key in stages[name].params})


def config_fingerprint(config: PipelineConfig, stage: str) -> str:
    """Hash of the config values `stage`'s result depends on (stage_param_keys), so a checkpoint is resumed only
    by a run whose result it belongs to, and survives edits elsewhere (evaluation, tracking, a new field of an
    unrelated section)."""
    import hashlib
    import json
    from functools import reduce

    # Only values that differ from the defaults: a field added later with a default that keeps the old behaviour
    # (e.g. bootstrap.replay) leaves existing checkpoints resumable.
    tree = config.model_dump(mode="json", exclude_defaults=True)
    picked = {key: reduce(lambda node, part: (node or {}).get(part), key.split("."), tree)
              for key in stage_param_keys(stage)}
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()


def checkpoint_dir_for(config: PipelineConfig, stage: str) -> Path:
    """`.icrl/checkpoints/<stage>-<config fingerprint>`: outside the stage's output folder (DVC deletes outputs
    before re-running a stage, checkpoints must survive a kill) and keyed by the values the stage depends on (a
    changed parameter never resumes an old run). Removed when the stage completes (`clear_checkpoints`)."""
    return CHECKPOINT_ROOT / f"{stage}-{config_fingerprint(config, stage)[:16]}"


def content_key(payload: dict, sources: tuple[str, ...]) -> str:
    """A short sha256 of `payload` and of the source files (relative to the project) that compute a cached
    result: the key of the caches kept outside the stages' DVC outs (evaluation runs, replay replies)."""
    import hashlib
    import json

    from icrl_core.io import sha256_file

    root = Path(__file__).resolve().parents[1]
    payload = {**payload, "code": {name: sha256_file(root / name) for name in sources}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def clear_checkpoints(config: PipelineConfig, stage: str) -> None:
    import shutil

    shutil.rmtree(checkpoint_dir_for(config, stage), ignore_errors=True)


def launch(config: PipelineConfig, stage: str, train_worker: TrainWorker, tracker=None) -> dict:
    """Run `train_worker` for `stage`: as a Ray Train job when `ray.enabled` (and `stage` is one of `ray.stages`,
    if given), else in this process."""
    if config.ray.enabled and (config.ray.stages is None or stage in config.ray.stages):
        from tasks.ray_train import run_ray_training

        result = run_ray_training(config, stage, train_worker, checkpoint_dir_for(config, stage), tracker)
    else:
        result = train_worker(config, LocalRuntime(checkpoint_dir_for(config, stage), tracker))
    clear_checkpoints(config, stage)
    return result


def write_stage_metrics(stage: str, metrics: Mapping[str, object], root: Path | str = "metrics",
                        headline: Iterable[str] | None = None) -> Path:
    """metrics/<stage>.json, written atomically: DVC's metrics file of the stage. With `headline`, only those keys
    (the ones present): `dvc metrics show` puts every stage's keys side by side in one table, so a stage declares
    its few headline numbers there and keeps the full record in its own outputs."""
    path = Path(root) / f"{stage}.json"
    atomic_write_json(path, dict(metrics) if headline is None else {k: metrics[k] for k in headline if k in metrics})
    return path


class ProgressRuntime:
    """Wraps a runtime with a progress bar (rank 0 only) that advances on every `report`."""

    def __init__(self, runtime, total: int, desc: str, keys: tuple[str, ...] = ("loss",)):
        from tqdm.auto import tqdm

        self._runtime = runtime
        self._keys = keys
        self._bar = tqdm(total=total, desc=desc, unit="step", disable=runtime.rank != 0)

    def __getattr__(self, name):  # rank, world_size, checkpoint_dir, ...
        return getattr(self._runtime, name)

    def report(self, metrics: Mapping[str, float], step: int) -> None:
        self._runtime.report(metrics, step)
        self._bar.update(step - self._bar.n)
        self._bar.set_postfix({k: f"{metrics[k]:.4g}" for k in self._keys if k in metrics}, refresh=False)

    def save_checkpoint(self, state) -> None:
        self._runtime.save_checkpoint(state)

    def load_latest_checkpoint(self):
        state = self._runtime.load_latest_checkpoint()
        if state is not None:
            self._bar.update(state.step)
            self._bar.write(f"resuming from checkpoint at step {state.step}", file=sys.stderr)
        return state

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

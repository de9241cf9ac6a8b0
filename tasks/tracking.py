"""MLflow tracking for stages: one run per stage, nested under a pipeline run when there is one.

Default store: `sqlite:///mlflow.db` in the working directory, artifacts under `./mlartifacts`. A tracking
server is used when `tracking.tracking_uri` (or MLFLOW_TRACKING_URI) says so. Params are the full resolved
config, flattened to dotted keys; URIs with credentials are redacted.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from icrl_core.config import PipelineConfig, TrackingConfig, config_to_flat_params

log = logging.getLogger(__name__)

PARENT_RUN_ENV = "ICRL_MLFLOW_PARENT_RUN_ID"  # set by the pipeline flow so stage runs nest under it


def tracking_uri(cfg: TrackingConfig) -> str:
    if cfg.tracking_uri:
        return cfg.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path('mlflow.db').resolve()}"


def artifact_root() -> str:
    return Path("mlartifacts").resolve().as_uri()


def setup(cfg: TrackingConfig) -> Any:
    """Point MLflow at the configured store and make sure the experiment exists; return the mlflow module."""
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    import mlflow

    uri = tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(cfg.experiment) is None:
        location = artifact_root() if uri.startswith("sqlite:") else None
        with contextlib.suppress(Exception):  # created concurrently by another process
            mlflow.create_experiment(cfg.experiment, artifact_location=location)
    mlflow.set_experiment(cfg.experiment)
    return mlflow


class Tracker:
    """What a stage uses to report. A disabled tracker accepts the same calls and does nothing."""

    def __init__(self, mlflow: Any | None = None, run_id: str | None = None):
        self._mlflow = mlflow
        self.run_id = run_id

    @property
    def enabled(self) -> bool:
        return self._mlflow is not None

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._mlflow is None:
            return
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and v == v}
        if clean:
            self._mlflow.log_metrics(clean, step=step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self._mlflow is not None:
            self._mlflow.log_params({k: str(v)[:6000] for k, v in params.items()})

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        if self._mlflow is not None and Path(path).exists():
            if Path(path).is_dir():
                self._mlflow.log_artifacts(str(path), artifact_path=artifact_path)
            else:
                self._mlflow.log_artifact(str(path), artifact_path=artifact_path)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self._mlflow is not None:
            self._mlflow.set_tags({k: str(v) for k, v in tags.items()})


@contextlib.contextmanager
def stage_run(config: PipelineConfig, stage: str, run_name: str | None = None,
              tags: Mapping[str, Any] | None = None) -> Iterator[Tracker]:
    """An MLflow run for one stage with the whole resolved config as params."""
    if not config.tracking.enabled:
        yield Tracker()
        return
    mlflow = setup(config.tracking)
    parent = os.environ.get(PARENT_RUN_ENV)
    run_tags = {"icrl.stage": stage, **(tags or {})}
    if parent:
        run_tags["mlflow.parentRunId"] = parent
    with mlflow.start_run(run_name=run_name or stage, tags=run_tags) as run:
        tracker = Tracker(mlflow, run.info.run_id)
        tracker.log_params(config_to_flat_params(config))
        yield tracker

"""MLflow tracking for stages: one run per stage, nested under a pipeline run when there is one.

Default store: `sqlite:///mlflow.db` in the working directory, artifacts under `./mlartifacts`. A tracking
server is used when `tracking.tracking_uri` (or MLFLOW_TRACKING_URI) says so. Params are the full resolved
config, flattened to dotted keys; URIs with credentials are redacted.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tasks.settings import PipelineConfig, TrackingConfig, config_to_flat_params

log = logging.getLogger(__name__)

PARENT_RUN_ENV = "ICRL_MLFLOW_PARENT_RUN_ID"  # set by the pipeline flow so stage runs nest under it

# What the user (or a parent process) set, read before this process touches MLflow: `mlflow.set_tracking_uri`
# writes MLFLOW_TRACKING_URI into os.environ itself, so reading the variable later would pin every later call
# in a long-lived process (a test session, a notebook) to the first working directory's store.
_ENV_TRACKING_URI = os.environ.get("MLFLOW_TRACKING_URI") or None


def tracking_uri(cfg: TrackingConfig) -> str:
    """`tracking.tracking_uri`, else MLFLOW_TRACKING_URI as the process found it, else ./mlflow.db (SQLite)."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    if _ENV_TRACKING_URI:
        return _ENV_TRACKING_URI
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
    """What a stage uses to report, bound to one MLflow run id (works from any process, e.g. a Ray worker,
    given the tracking URI). A disabled tracker accepts the same calls and does nothing."""

    def __init__(self, uri: str | None = None, run_id: str | None = None):
        self.uri = uri
        self.run_id = run_id
        self._client = None
        if uri and run_id:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=uri)

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if self._client is None:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        clean = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)]
        if clean:
            self._client.log_batch(self.run_id, metrics=clean)

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self._client is None:
            return
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            self._client.log_batch(self.run_id, params=items[start:start + 100])

    def log_artifact(self, path: Path | str, artifact_path: str | None = None) -> None:
        if self._client is None or not Path(path).exists():
            return
        if Path(path).is_dir():
            self._client.log_artifacts(self.run_id, str(path), artifact_path=artifact_path)
        else:
            self._client.log_artifact(self.run_id, str(path), artifact_path=artifact_path)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self._client is None:
            return
        for key, value in tags.items():
            self._client.set_tag(self.run_id, key, str(value))


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
        tracker = Tracker(tracking_uri(config.tracking), run.info.run_id)
        tracker.log_params(config_to_flat_params(config))
        yield tracker


@contextlib.contextmanager
def pipeline_run(config: PipelineConfig, name: str = "pipeline") -> Iterator[Tracker]:
    """The parent MLflow run of a pipeline (stage runs started with PARENT_RUN_ENV nest under it)."""
    if not config.tracking.enabled:
        yield Tracker()
        return
    mlflow = setup(config.tracking)
    with mlflow.start_run(run_name=name, tags={"icrl.stage": name}) as run:
        tracker = Tracker(tracking_uri(config.tracking), run.info.run_id)
        tracker.log_params(config_to_flat_params(config))
        yield tracker

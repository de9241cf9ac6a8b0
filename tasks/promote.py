"""Stage `promote`: register the evaluated adapter in the MLflow model registry and give it the alias `champion`
only if it passes the promotion gates (recomputed from the evaluation: held-out gain, forgetting; see
tasks/registry.py: promotion_gates) AND beats the current champion on `evaluate.metric`; otherwise `challenger`.
The adapter is the one the evaluation measured (evaluate.adapter, or its interpolation toward the base), checked
by its sha256. Reads evaluate.output_dir/metrics.json; writes metrics/promote.json."""

from __future__ import annotations

import json
from pathlib import Path

from icrl_core.errors import UserError
from icrl_core.io import read_user_text
from tasks.settings import PipelineConfig

STAGE = "promote"
HEADLINE = ("version", "alias", "metric", "eligible")  # metrics/promote.json; the whole outcome goes to MLflow


def evaluation_file(config: PipelineConfig) -> Path:
    """The evaluate stage's full metrics (its headline is metrics/evaluate.json)."""
    return Path(config.evaluate.output_dir) / "metrics.json"


def read_evaluation(path: Path | str) -> dict:
    """The evaluate stage's metrics, from `path`."""
    text = read_user_text(path, "evaluate stage's metrics JSON file", "run the evaluate stage first")
    try:
        metrics = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(metrics, dict):
        raise UserError(f"{path}: expected a JSON object of metrics")
    return metrics


def run(config: PipelineConfig, evaluation: Path | str | None = None,
        output: Path | None = Path("metrics") / f"{STAGE}.json") -> dict:
    """Promote what `evaluation` (default: evaluate.output_dir/metrics.json) measured; write the headline of the
    outcome to `output` (None: nowhere)."""
    from tasks.registry import run_promotion
    from tasks.runtime import write_stage_metrics

    result = run_promotion(config, read_evaluation(evaluation or evaluation_file(config)))
    if output is not None:
        write_stage_metrics(Path(output).stem, result, Path(output).parent, headline=HEADLINE)
    return result

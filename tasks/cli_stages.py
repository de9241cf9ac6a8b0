"""CLI commands of the pipeline stages: `icrl stage NAME` runs one stage from the config schema."""

import importlib
from enum import Enum
from typing import Annotated

import typer

from tasks.cli_common import ParamsOpt, SetOpt, console, resolve_config

# stage name -> module in tasks/ exposing `run(config) -> dict` (the stage's final metrics)
STAGES = {
    "build_dataset": "tasks.build_dataset",
    "tokenize": "tasks.tokenize",
    "bootstrap": "tasks.bootstrap",
    "reward_model": "tasks.reward_model",
    "ppo": "tasks.ppo",
    "adapt": "tasks.adapt",
}

StageName = Enum("StageName", {name: name for name in STAGES}, type=str)


def run_stage(name: str, config) -> dict:
    """Run one stage in this process; return its final metrics (also written to metrics/<name>.json)."""
    module = importlib.import_module(STAGES[name])
    return module.run(config)


def register(app: typer.Typer) -> None:
    @app.command("stage")
    def stage(
        name: Annotated[StageName, typer.Argument(help="Stage to run: " + ", ".join(STAGES) + ".",
                                                  show_default=False)],
        params: ParamsOpt = None,
        overrides: SetOpt = None,
    ) -> None:
        """Run one pipeline stage from the config: reads its inputs, writes its outputs atomically and
        metrics/NAME.json, logs to MLflow, and resumes from its last checkpoint if it was interrupted."""
        import json

        config = resolve_config(params, overrides)
        metrics = run_stage(name.value, config)
        console().print_json(json.dumps(metrics, default=str))

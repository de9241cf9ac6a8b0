"""CLI commands of the orchestration layer: pipeline, up, sweep, promote."""

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from tasks.cli_common import ParamsOpt, SetOpt, console, resolve_config


def register(app: typer.Typer) -> None:
    @app.command("pipeline")
    def pipeline(
        stages: Annotated[Optional[list[str]], typer.Option("--stage", help="Run only this stage (repeatable); "
                                                            "default: every stage.", show_default=False)] = None,
        overrides: Annotated[Optional[list[str]], typer.Option(
            "--set", "-s", help="Write KEY=VALUE into params.yaml before running (like `dvc exp run -S`); "
            "repeatable.", show_default=False)] = None,
    ) -> None:
        """Run the training pipeline as a Prefect flow: each stage is a task that runs `dvc repro` of that
        stage (so unchanged stages are skipped), training stages run as Ray Train jobs, and everything is
        logged to MLflow under one pipeline run, ending with a registered, promoted model version."""
        from icrl_core.config import parse_value
        from icrl_core.errors import ConfigError

        flat = {}
        for item in overrides or []:
            key, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"--set expects KEY=VALUE (e.g. ppo.kl_beta=0.02), got {item!r}")
            flat[key.strip()] = parse_value(raw)
        from flows.pipeline import pipeline_flow

        results = pipeline_flow(overrides=flat or None, stages=stages or None)
        console().print_json(json.dumps(results, default=str))

    @app.command("sweep")
    def sweep(params: ParamsOpt = None, overrides: SetOpt = None) -> None:
        """Ray Tune sweep of sweep.stage over sweep.search_space with ASHA early stopping; each trial is an
        MLflow child run; the best config is printed and saved to <artifacts_dir>/sweep/best.json."""
        from tasks.sweep import run_sweep

        summary = run_sweep(resolve_config(params, overrides))
        console().print(f"best {summary['metric']} = {summary['best_metric']} with "
                        f"{json.dumps(summary['best_params'])}")

    @app.command("promote")
    def promote(
        adapter: Annotated[Path, typer.Option(help="Adapter folder to register (safetensors).")] = Path(
            "artifacts/ppo/adapter"),
        metric_file: Annotated[Path, typer.Option(help="JSON file holding the evaluation metric.")] = Path(
            "metrics/evaluate.json"),
        metric: Annotated[str, typer.Option(help="Key of the evaluation metric in --metric-file (higher is "
                                            "better).")] = "trained_final_test_accuracy",
        params: ParamsOpt = None,
        overrides: SetOpt = None,
    ) -> None:
        """Register the adapter as a new MLflow model version and give it the alias `champion` only if its
        metric beats the current champion's (else `challenger`). Writes metrics/promote.json."""
        from icrl_core.errors import UserError
        from tasks.registry import run_promotion

        config = resolve_config(params, overrides)
        try:
            value = float(json.loads(metric_file.read_text())[metric])
        except FileNotFoundError:
            raise UserError(f"{metric_file}: not found (run the evaluate stage first)") from None
        except KeyError:
            raise UserError(f"{metric_file} has no key '{metric}'") from None
        result = run_promotion(config, adapter, value, metric)
        console().print_json(json.dumps(result))

    @app.command("up")
    def up(
        prefect_port: Annotated[int, typer.Option(help="Prefect server port.")] = 4200,
        mlflow_port: Annotated[int, typer.Option(help="MLflow server port.")] = 5000,
        host: Annotated[str, typer.Option(help="Interface to bind. Default loopback only; 0.0.0.0 exposes the "
                                          "servers to the network.")] = "127.0.0.1",
        deploy: Annotated[bool, typer.Option(help="Deploy the flows of prefect.yaml.")] = True,
    ) -> None:
        """Start a Prefect server, an MLflow server and a Prefect process worker, deploy the flows, and wait
        (Ctrl-C stops everything). Then open the Prefect UI, run the `icrl-pipeline/pipeline` deployment with
        parameters, and follow each stage's state and logs; runs and models appear in the MLflow UI."""
        import time

        from flows.services import Services

        services = Services(host=host, prefect_port=prefect_port, mlflow_port=mlflow_port)
        out = console()
        try:
            services.start_prefect()
            out.print(f"Prefect UI   http://{host}:{prefect_port}")
            services.start_mlflow()
            out.print(f"MLflow UI    {services.mlflow_uri}")
            services.ensure_work_pool()
            if deploy:
                services.deploy()
                out.print("deployed: icrl-pipeline/pipeline, icrl-evaluation/evaluation, icrl-sweep/sweep, "
                          "icrl-promotion/promotion")
            services.start_worker()
            out.print("worker started on pool icrl-process; logs in .icrl/logs/. Ctrl-C to stop.")
            while all(p.poll() is None for p in services.processes.values()):
                time.sleep(1)
            dead = [name for name, p in services.processes.items() if p.poll() is not None]
            out.print(f"stopped: {', '.join(dead)} exited (see .icrl/logs/)")
        except KeyboardInterrupt:
            out.print("stopping")
        finally:
            services.stop()


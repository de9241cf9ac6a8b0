"""CLI commands of the orchestration layer: pipeline, up, sweep, promote."""

import contextlib
import json
from pathlib import Path
from typing import Annotated

import typer

from tasks.cli_common import ParamsOpt, SetOpt, console, resolve_config


def register(app: typer.Typer) -> None:
    @app.command("pipeline")
    def pipeline(
        stages: Annotated[list[str] | None, typer.Option("--stage", help="Run only this stage (repeatable); "
                                                            "default: every stage.", show_default=False)] = None,
        params: ParamsOpt = None,
        overrides: SetOpt = None,
        experiment: Annotated[list[Path] | None, typer.Option(
            "--experiment", "-e", help="Config file layered after the -c files (after ./params.yaml by default), "
            "e.g. experiments/icrl_skill.yaml; repeatable. The run is a DVC experiment named after the last one.",
            show_default=False)] = None,
        name: Annotated[str | None, typer.Option(
            "--name", "-n", help="Name of the DVC experiment (with -c/--experiment/--set). Default: the experiment "
            "file's name or the flow run's, and the time.", show_default=False)] = None,
    ) -> None:
        """Run the training pipeline as a Prefect flow: each stage is a task that runs `dvc repro` of that
        stage (so unchanged stages are skipped), training stages run as Ray Train jobs, and everything is
        logged to MLflow under one pipeline run, ending with a registered, promoted model version. One run at
        a time per project folder (a second waits).

        The stages read params.yaml (that is what DVC tracks). When the layered config files and --set change
        it, the run is a DVC experiment (like `dvc exp run -S`): the changed keys are written into params.yaml for
        the run, `dvc exp show` lists it with its params and metrics, and params.yaml is unchanged afterwards
        (`dvc exp apply NAME` brings its results into the workspace). ICRL_* variables reach the stages through
        the environment."""
        import time

        from tasks.cli_common import DEFAULT_PARAMS, config_files
        from tasks.settings import params_file_overrides
        from tasks.stages import check_stage_names

        check_stage_names(stages or [])
        files = config_files(params) + list(experiment or [])
        flat = params_file_overrides(DEFAULT_PARAMS, files, overrides or [])
        if name is None and experiment:
            name = f"{experiment[-1].stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        results = _run_pipeline(overrides=flat or None, stages=stages or None, experiment=name)
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
        metric_file: Annotated[Path | None, typer.Option(
            help="JSON file of the evaluation (the evaluate stage's full metrics; it names the adapter it measured). "
            "Default: evaluate.output_dir/metrics.json.", show_default=False)] = None,
        params: ParamsOpt = None,
        overrides: SetOpt = None,
    ) -> None:
        """Register the adapter the evaluation measured as a new MLflow model version; give it the alias `champion`
        only if it passes the promotion gates (held-out gain, forgetting, recomputed from the evaluation) and its
        evaluate.metric beats the current champion's, else `challenger`. Writes metrics/promote.json."""
        from tasks.promote import run

        config = resolve_config(params, overrides)
        console().print_json(json.dumps(run(config, metric_file)))

    @app.command("up")
    def up(
        prefect_port: Annotated[int, typer.Option(help="Prefect server port.", min=1, max=65535)] = 4200,
        mlflow_port: Annotated[int, typer.Option(help="MLflow server port.", min=1, max=65535)] = 5000,
        host: Annotated[str, typer.Option(help="Interface to bind. Default loopback only; 0.0.0.0 exposes the "
                                          "servers to the network.")] = "127.0.0.1",
        deploy: Annotated[bool, typer.Option(help="Deploy the flows of prefect.yaml.")] = True,
    ) -> None:
        """Start a Prefect server, an MLflow server and a Prefect process worker, deploy the flows, and wait
        (Ctrl-C stops everything). Then open the Prefect UI, run the `icrl-pipeline/pipeline` deployment with
        parameters, and follow each stage's state and logs; runs and models appear in the MLflow UI."""
        import time

        from flows.services import Services, stop_descendants, stop_on_signals

        services = Services(host=host, prefect_port=prefect_port, mlflow_port=mlflow_port)
        out = console()
        with stop_on_signals(), _stopping(services, stop_descendants):
            services.start_prefect(wait=False)
            services.start_mlflow(wait=False)
            services.wait_ready()
            out.print(f"Prefect UI   http://{host}:{prefect_port}")
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


@contextlib.contextmanager
def _stopping(services, stop_descendants):
    """`icrl up`'s end, however it comes (Ctrl-C, SIGTERM, a service that died, an error while starting): every
    service's process tree, then anything else this process started."""
    try:
        yield
    except KeyboardInterrupt:
        console().print("stopping")
    finally:
        services.stop()
        stop_descendants()


def _run_pipeline(**kwargs) -> dict:
    """The pipeline flow in this process (`icrl pipeline`, `icrl demo`), reporting to `prefect_api()`; SIGTERM or
    SIGINT stops it and every process it started."""
    import os

    os.environ.setdefault("PREFECT_HOME", str((Path(".icrl") / "prefect").resolve()))
    # Prefect creates only the last folder of PREFECT_HOME: on a fresh clone .icrl/ does not exist yet.
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    from flows.pipeline import pipeline_flow
    from flows.services import prefect_api, run_stopping_children

    def work() -> dict:
        with prefect_api():
            return pipeline_flow(**kwargs)

    return run_stopping_children(work)


def run_pipeline_with_summary(out) -> dict:
    """`icrl demo`: the pipeline, then the numbers a user wants to see."""
    import time

    from rich.table import Table

    from icrl_core.errors import UserError

    if not Path("dvc.yaml").exists() or not Path("params.yaml").exists():
        raise UserError("run `icrl demo` in the project folder (dvc.yaml and params.yaml are needed)")
    started = time.perf_counter()
    results = _run_pipeline()
    seconds = time.perf_counter() - started
    table = Table("stage", "result")
    for stage, metrics in results.items():  # each stage's headline numbers (metrics/STAGE.json)
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
        table.add_row(stage, shown or f"(see metrics/{stage}.json)")
    out.print(table)
    out.print(f"pipeline wall time {seconds / 60:.1f} min; metrics in metrics/, artifacts in artifacts/, runs in "
              "MLflow (`mlflow ui --backend-store-uri sqlite:///mlflow.db`), learning curves: "
              "artifacts/evaluate/learning_curve.png, artifacts/ppo/reward_curve.png")
    if "evaluate" in results:  # what the demo showed, in sentences (also metrics/demo.json)
        from tasks.demo import write_demo_summary
        from tasks.settings import load_config

        out.print("")
        for line in write_demo_summary(load_config("params.yaml")):
            out.print(line)
    return results


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)

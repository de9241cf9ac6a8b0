"""Screenshots of the Prefect UI and the MLflow UI for the README, taken with headless Chromium.

Run in the project folder after `make demo` (the pipeline's outputs, mlflow.db and its registered model exist):

    .venv/bin/python scripts/screenshots.py            (or: make screenshots)

It starts the same services as `icrl up` (Prefect server, MLflow server, process worker; 127.0.0.1, ports
4200/5000 unless --prefect-port/--mlflow-port), deploys prefect.yaml, triggers the `icrl-pipeline/pipeline`
deployment through the REST API with a parameter (what the UI's "Run" does), waits for it, and saves:

    docs/screenshots/prefect-flow-run.png      the deployment's flow run: stage tasks, states, logs
    docs/screenshots/prefect-deployment.png    the deployment page
    docs/screenshots/mlflow-runs.png           the experiment's runs (pipeline run with nested stage runs)
    docs/screenshots/mlflow-charts.png         the PPO stage runs compared in the runs chart view
    docs/screenshots/mlflow-run-curves.png     the PPO stage run's metric curves by step (reward, KL, entropy,
                                               losses, validation accuracy)
    docs/screenshots/mlflow-model.png          the registered model, its versions and aliases

With --q-view artifacts/critic/q_view.html it only saves docs/screenshots/critic-q-view.png (the critic stage's
self-contained page of tokens coloured by Q-value; docs/CRITIC.md).

Needs a Chromium binary (`apt-get install chromium`; --chromium to point at another) and, for the run's curves,
the `screenshots` extra (Playwright, driving that same Chromium: a run's metric page renders its charts only in
real time, not under --virtual-time-budget).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def shoot(chromium: str, url: str, out: Path, wait_ms: int = 15000, size: str = "1440,1000") -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.png")
    command = [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--disable-dev-shm-usage", f"--window-size={size}", f"--virtual-time-budget={wait_ms}",
               f"--screenshot={tmp}", url]
    subprocess.run(command, check=True, capture_output=True, timeout=180)
    os.replace(tmp, out)  # atomic: a failed shot never leaves half an image
    print(f"{out}  <-  {url}")


RUN_CURVES = "^(mean_reward|val_accuracy|kl|entropy|policy_loss|value_loss)$"


def shoot_run_curves(chromium: str, url: str, out: Path, metric_filter: str = RUN_CURVES,
                     settle_s: float = 10.0) -> None:
    """An MLflow run's "Model metrics" tab filtered to `metric_filter` (a regex in the page's search box),
    through Playwright so the charts get real time to load (they stay on spinners under virtual time)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    from icrl_core.io import atomic_write_bytes

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium,
                                             args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.goto(url)
            search = page.get_by_placeholder("Search metric charts")
            search.wait_for(timeout=60_000)
            time.sleep(settle_s)
            try:  # the "MLflow Assistant" side panel opens by default and hides a column of charts
                page.locator("button[aria-label*='lose']").first.click(timeout=5_000)
            except PlaywrightTimeout:  # no panel in this MLflow version: nothing to close
                pass
            search.fill(metric_filter)
            time.sleep(settle_s)
            image = page.screenshot()
        finally:
            browser.close()
    atomic_write_bytes(out, image)
    print(f"{out}  <-  {url}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefect-port", type=int, default=4200)
    parser.add_argument("--mlflow-port", type=int, default=5000)
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    parser.add_argument("--registered-model", default="icrl-policy")
    parser.add_argument("--q-view", type=Path, metavar="HTML",
                        help="only shoot the critic stage's Q-value view (e.g. artifacts/critic/q_view.html) to "
                        "OUT/critic-q-view.png; no services are started")
    args = parser.parse_args()
    if not args.chromium:
        sys.exit("no chromium found: apt-get install chromium, or pass --chromium PATH")
    if args.q_view:
        if not args.q_view.is_file():
            sys.exit(f"{args.q_view}: no such file (run `icrl stage critic` first)")
        shoot(args.chromium, args.q_view.resolve().as_uri(), args.out / "critic-q-view.png", wait_ms=2000,
              size="1100,700")
        return

    import httpx
    import mlflow

    from flows.services import Services, prefect_rest

    os.environ.setdefault("PREFECT_WORKER_QUERY_SECONDS", "2")
    services = Services(prefect_port=args.prefect_port, mlflow_port=args.mlflow_port)
    try:
        services.start_prefect()
        services.start_mlflow()
        services.ensure_work_pool()
        services.deploy()
        services.start_worker()
        with httpx.Client(base_url=services.prefect_api, timeout=30) as client:
            deployment = prefect_rest(client, "GET", "/deployments/name/icrl-pipeline/pipeline")
            # The demo's own value: DVC sees no change, every stage is up to date, the run shows all eight.
            flow_run = prefect_rest(client, "POST", f"/deployments/{deployment['id']}/create_flow_run",
                                    json={"parameters": {"overrides": {"ppo.kl_beta": 0.02}}})
            state = "SCHEDULED"
            deadline = time.time() + 3600
            while state not in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") and time.time() < deadline:
                time.sleep(3)
                state = prefect_rest(client, "GET", f"/flow_runs/{flow_run['id']}")["state"]["type"]
            print(f"flow run {flow_run['name']}: {state}")
        ui = f"http://127.0.0.1:{args.prefect_port}"
        shoot(args.chromium, f"{ui}/runs/flow-run/{flow_run['id']}", args.out / "prefect-flow-run.png")
        shoot(args.chromium, f"{ui}/deployments/deployment/{deployment['id']}", args.out / "prefect-deployment.png")

        client = mlflow.MlflowClient(tracking_uri=services.mlflow_uri)
        experiment = client.get_experiment_by_name("icrl")
        ppo_runs = client.search_runs([experiment.experiment_id], "tags.`icrl.stage` = 'ppo'",
                                      order_by=["attributes.start_time DESC"], max_results=1)
        mlflow_ui = services.mlflow_uri
        runs_page = f"{mlflow_ui}/#/experiments/{experiment.experiment_id}/runs"
        shoot(args.chromium, runs_page, args.out / "mlflow-runs.png", wait_ms=40000, size="1440,1100")
        if ppo_runs:
            run = ppo_runs[0].info
            shoot_run_curves(args.chromium, f"{mlflow_ui}/#/experiments/{experiment.experiment_id}/runs/"
                             f"{run.run_id}/model-metrics", args.out / "mlflow-run-curves.png")
            shoot(args.chromium, f"{runs_page}?compareRunsMode=CHART&searchFilter="
                  "tags.%60icrl.stage%60%20%3D%20%27ppo%27", args.out / "mlflow-charts.png", wait_ms=40000,
                  size="1440,1100")
        shoot(args.chromium, f"{mlflow_ui}/#/models/{args.registered_model}", args.out / "mlflow-model.png")
    finally:
        services.stop()


if __name__ == "__main__":
    main()

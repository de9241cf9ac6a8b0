"""Local services for the UI workflow: a Prefect server, an MLflow server and a Prefect process worker, all
bound to 127.0.0.1 by default. `icrl up` starts them, deploys the flows of prefect.yaml and waits; Ctrl-C stops
everything. State lives in `.icrl/` (PREFECT_HOME, logs); MLflow uses the same SQLite store and artifact
folder as the stages (mlflow.db, mlartifacts/), so the UI shows every run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

STATE_DIR = Path(".icrl")
WORK_POOL = "icrl-process"


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def prefect_env(api_url: str | None = None) -> dict[str, str]:
    from tasks.env import DEFAULTS

    env = {**DEFAULTS, **os.environ}
    env.setdefault("PREFECT_HOME", str((STATE_DIR / "prefect").resolve()))
    Path(env["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect makes only the last folder
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def wait_http(url: str, timeout: float = 120.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status < 500:
                    return
        except Exception:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


@dataclass
class Services:
    host: str = "127.0.0.1"
    prefect_port: int = 4200
    mlflow_port: int = 5000
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def prefect_api(self) -> str:
        return f"http://{self.host}:{self.prefect_port}/api"

    @property
    def mlflow_uri(self) -> str:
        return f"http://{self.host}:{self.mlflow_port}"

    def _spawn(self, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        logs = STATE_DIR / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        handle = open(logs / f"{name}.log", "ab")
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        self.processes[name] = process
        return process

    def start_prefect(self) -> None:
        env = prefect_env()
        env["PREFECT_SERVER_API_HOST"] = self.host
        env["PREFECT_SERVER_API_PORT"] = str(self.prefect_port)
        process = self._spawn("prefect-server", [_bin("prefect"), "server", "start", "--host", self.host,
                                                 "--port", str(self.prefect_port)], env)
        wait_http(f"{self.prefect_api}/health", process=process)

    def start_mlflow(self) -> None:
        env = prefect_env()
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        store = f"sqlite:///{Path('mlflow.db').resolve()}"
        process = self._spawn("mlflow-server", [
            _bin("mlflow"), "server", "--host", self.host, "--port", str(self.mlflow_port),
            "--backend-store-uri", store, "--default-artifact-root", Path("mlartifacts").resolve().as_uri(),
            "--workers", "1"], env)
        wait_http(f"{self.mlflow_uri}/health", process=process)

    def ensure_work_pool(self, pool: str = WORK_POOL) -> None:
        env = prefect_env(self.prefect_api)
        found = subprocess.run([_bin("prefect"), "work-pool", "inspect", pool], capture_output=True, env=env)
        if found.returncode != 0:
            subprocess.run([_bin("prefect"), "work-pool", "create", pool, "--type", "process"], check=True,
                           capture_output=True, env=env)

    def deploy(self, project_dir: Path | None = None) -> str:
        """`prefect deploy --all` from prefect.yaml (deployments run in `project_dir`)."""
        env = prefect_env(self.prefect_api)
        env["ICRL_PROJECT_DIR"] = str((project_dir or Path.cwd()).resolve())
        result = subprocess.run([_bin("prefect"), "--no-prompt", "deploy", "--all"], capture_output=True,
                                text=True, env=env, cwd=project_dir)
        if result.returncode != 0:
            raise RuntimeError(f"prefect deploy failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def start_worker(self, pool: str = WORK_POOL, tracking_uri: str | None = None) -> None:
        env = prefect_env(self.prefect_api)
        if tracking_uri:
            env["MLFLOW_TRACKING_URI"] = tracking_uri
        self._spawn("prefect-worker", [_bin("prefect"), "worker", "start", "--pool", pool, "--type", "process"],
                    env)

    def stop(self) -> None:
        import signal

        for name in reversed(list(self.processes)):
            process = self.processes.pop(name)
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                    process.wait(timeout=20)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(process.pid, signal.SIGKILL)

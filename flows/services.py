"""Local services for the UI workflow: a Prefect server, an MLflow server and a Prefect process worker, all
bound to 127.0.0.1 by default. `icrl up` starts them, deploys the flows of prefect.yaml and waits; Ctrl-C stops
everything. State lives in `.icrl/` (PREFECT_HOME, logs); MLflow uses the same SQLite store and artifact
folder as the stages (mlflow.db, mlartifacts/), so the UI shows every run.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
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
        except (OSError, http.client.HTTPException):  # not listening yet, reset, or a 5xx (HTTPError)
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


def prefect_rest(client, method: str, path: str, **kwargs):
    """One call to the Prefect REST API by raw HTTP (what the UI does), with the retries Prefect's own client makes:
    the server answers 503 for errors it marks retryable (SQLite busy on a loaded machine), 429 and 502 likewise,
    so back off 1, 2, 4, ... 32 s. `client` is an httpx.Client on the API URL; returns the decoded JSON body."""
    for attempt in range(6):
        response = client.request(method, path, **kwargs)
        if response.status_code not in (429, 502, 503):
            break
        time.sleep(2 ** attempt)
    if response.status_code >= 400:
        raise RuntimeError(f"Prefect API {method} {path}: {response.status_code} {response.text[:500]}")
    return response.json()


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
        with open(logs / f"{name}.log", "ab") as handle:  # the child keeps its own copy of the descriptor
            process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        self.processes[name] = process
        return process

    def start_prefect(self, wait: bool = True, ui: bool = True, name: str = "prefect-server") -> None:
        """Start the Prefect server (logs in .icrl/logs/NAME.log); with `wait`, return once it answers (else see
        `wait_ready`)."""
        env = prefect_env()
        env["PREFECT_SERVER_API_HOST"] = self.host
        env["PREFECT_SERVER_API_PORT"] = str(self.prefect_port)
        process = self._spawn(name, [_bin("prefect"), "server", "start", "--host", self.host,
                                     "--port", str(self.prefect_port), "--ui" if ui else "--no-ui"], env)
        if wait:
            wait_http(f"{self.prefect_api}/health", process=process)

    def wait_ready(self) -> None:
        """Return once the servers started so far answer (they start side by side: each first migrates its
        database, which takes tens of seconds on a fresh folder)."""
        urls = {"prefect-server": f"{self.prefect_api}/health", "mlflow-server": f"{self.mlflow_uri}/health"}
        for name, process in self.processes.items():
            if name in urls:
                wait_http(urls[name], process=process)

    def start_mlflow(self, wait: bool = True) -> None:
        """Start the MLflow server; with `wait`, return once it answers (else see `wait_ready`)."""
        env = prefect_env()
        env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
        store = f"sqlite:///{Path('mlflow.db').resolve()}"
        process = self._spawn("mlflow-server", [
            _bin("mlflow"), "server", "--host", self.host, "--port", str(self.mlflow_port),
            "--backend-store-uri", store, "--default-artifact-root", Path("mlartifacts").resolve().as_uri(),
            "--workers", "1"], env)
        if wait:
            wait_http(f"{self.mlflow_uri}/health", process=process)

    def ensure_work_pool(self, pool: str = WORK_POOL) -> None:
        env = prefect_env(self.prefect_api)
        found = subprocess.run([_bin("prefect"), "work-pool", "inspect", pool], check=False, capture_output=True,
                               env=env)
        if found.returncode != 0:
            subprocess.run([_bin("prefect"), "work-pool", "create", pool, "--type", "process"], check=True,
                           capture_output=True, env=env)

    def deploy(self, project_dir: Path | None = None) -> str:
        """`prefect deploy --all` from prefect.yaml (deployments run in `project_dir`)."""
        env = prefect_env(self.prefect_api)
        env["ICRL_PROJECT_DIR"] = str((project_dir or Path.cwd()).resolve())
        result = subprocess.run([_bin("prefect"), "--no-prompt", "deploy", "--all"], check=False, capture_output=True,
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

    def stop(self, grace: float = 20.0) -> None:
        """Stop the services, last started first: each one's whole process tree (see `stop_tree`)."""
        for name in reversed(list(self.processes)):
            process = self.processes.pop(name)
            stop_tree(process.pid, grace)
            with contextlib.suppress(subprocess.TimeoutExpired, ChildProcessError):
                process.wait(timeout=5)


def stop_tree(pid: int, grace: float = 20.0) -> None:
    """SIGTERM a process and its descendants (and its process group, if it leads one), then SIGKILL whatever is
    left after `grace` seconds. The tree is read first: a server's workers outlive their parent otherwise
    (orphans are re-parented to init and are nobody's descendants any more)."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    group = pid if _leads_group(pid) else None
    _signal_all(tree, group, signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=grace)
    if alive or group is not None:
        _signal_all(alive, group, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)


def stop_descendants(grace: float = 20.0) -> None:
    """Stop every process this one started, directly or not (`stop_tree` of each child)."""
    import psutil

    for child in psutil.Process().children():
        stop_tree(child.pid, grace)


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def _signal_all(processes: list, group: int | None, signum: int) -> None:
    import psutil

    if group is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signum)
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signum)


def run_stopping_children(work: Callable[[], object]) -> object:
    """`work()`; on SIGTERM or SIGINT every process it started (stages, Ray, a temporary Prefect server) is stopped
    before KeyboardInterrupt leaves (`icrl pipeline`, `icrl demo`)."""
    with stop_on_signals():
        try:
            return work()
        except KeyboardInterrupt:
            stop_descendants()
            raise


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def prefect_api() -> Iterator[str]:
    """The Prefect API that flows run in this process report to, for the `with` block. With PREFECT_API_URL set
    (`icrl up`, a shared server) that one. Otherwise a temporary server on a free loopback port, in its own
    session, stopped when the block ends: Prefect's own temporary server starts in the caller's process group,
    so Ctrl-C in a terminal (which signals the whole foreground group) ended it before the flow had reported its
    crash, and the flow then kept retrying to reach it for minutes. Here the signal reaches the flow and its
    stages, the flow reports, then the server stops."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield PREFECT_API_URL.value()
        return
    services = Services(prefect_port=free_port())
    try:
        services.start_prefect(ui=False, name="prefect-temporary-server")
        with temporary_settings(updates={PREFECT_API_URL: services.prefect_api}):
            try:
                yield services.prefect_api
            finally:
                _send_pending_prefect_reports()
    finally:
        services.stop(grace=10)


def _send_pending_prefect_reports(timeout: float = 30.0) -> None:
    """Send the logs and events Prefect still queues in background threads, while the server still answers
    (otherwise they are retried against a stopped server at exit)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):  # best effort: what matters (states) was sent synchronously
            worker.drain_all(timeout=timeout)


@contextlib.contextmanager
def stop_on_signals(on_signal: Callable[[], None] | None = None) -> Iterator[None]:
    """SIGTERM (docker stop, systemd, kill) and SIGINT (Ctrl-C, kill -INT) end the `with` block with
    KeyboardInterrupt, so its `finally` blocks stop the children; Python's default for SIGTERM is to die at once
    and leave them running. `on_signal` runs first, in the handler. Signals arriving while stopping are ignored
    (a second Ctrl-C does not cut the cleanup short)."""
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}

    def handler(signum, frame) -> None:
        for each in previous:
            signal.signal(each, signal.SIG_IGN)
        if on_signal is not None:
            on_signal()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for signum in previous:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)

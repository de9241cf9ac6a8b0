"""`icrl up` stopped by a signal (docker stop, systemd, kill) leaves no process and no port behind: the real
Prefect server, MLflow server and Prefect worker."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from flows.services import free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def _port_is_free(port: int) -> bool:
    """Nothing listens on the port: a server could bind it now (SO_REUSEADDR, as servers do, so the closed
    connections of the health checks, in TIME_WAIT for a minute, do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _wait_for(predicate, timeout: float, what: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        assert process.poll() is None, f"icrl up exited early:\n{log.read_text()}"
        time.sleep(0.5)
    raise AssertionError(f"{what} not ready within {timeout:.0f}s:\n{log.read_text()}")


def _command(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def test_up_stops_every_child_on_sigterm(tmp_path):
    prefect_port, mlflow_port = free_port(), free_port()
    log = tmp_path / "up.log"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)
    with open(log, "wb") as out:
        up = subprocess.Popen([str(Path(sys.executable).parent / "icrl"), "up", "--no-deploy", "--prefect-port",
                               str(prefect_port), "--mlflow-port", str(mlflow_port)], cwd=tmp_path, env=env,
                              stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: "worker started" in log.read_text(), 150, "icrl up", up, log)
        children = psutil.Process(up.pid).children(recursive=True)
        commands = [_command(child) for child in children]
        assert any("prefect" in c and "server" in c for c in commands), commands
        assert any("mlflow" in c and "server" in c for c in commands), commands
        assert any("worker start" in c for c in commands), commands
        assert not _port_is_free(prefect_port) and not _port_is_free(mlflow_port)  # they answer (icrl up waited)

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0, log.read_text()
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, [_command(p) for p in alive]
        assert _port_is_free(prefect_port) and _port_is_free(mlflow_port)
        assert "stopping" in log.read_text()
    finally:
        if up.poll() is None:  # a failed test must not leave servers behind either
            from flows.services import stop_tree

            stop_tree(up.pid, grace=5)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_pipeline_guard_stops_children_in_their_own_sessions(tmp_path, signum):
    """What `icrl pipeline` runs under (flows.services.run_stopping_children): a signal stops every process the
    work started, also one in its own session with a child of its own (as `dvc repro` -> stage -> Ray)."""
    script = tmp_path / "work.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from flows.services import run_stopping_children\n"
        "def work():\n"
        "    subprocess.Popen(['sh', '-c', 'sleep 300 & sleep 300'], start_new_session=True)\n"
        "    subprocess.Popen(['sleep', '300'])\n"
        "    print('started', flush=True)\n"
        "    time.sleep(300)\n"
        "run_stopping_children(work)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    work = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert work.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 10
        while len(children := psutil.Process(work.pid).children(recursive=True)) < 3:
            assert time.monotonic() < deadline, [_command(c) for c in children]
            time.sleep(0.1)
        work.send_signal(signum)
        assert work.wait(timeout=60) != 0  # interrupted, not finished
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, [_command(p) for p in alive]
    finally:
        if work.poll() is None:
            from flows.services import stop_tree

            stop_tree(work.pid, grace=5)


_FLOW_SCRIPT = """
import subprocess, sys, time
from prefect import flow, task
from flows.services import prefect_api, run_stopping_children

@task
def stage(sleep: bool) -> int:
    if sleep:
        subprocess.Popen(["sleep", "300"])
        print("started", flush=True)
        time.sleep(300)
    return 42

@flow
def guarded(sleep: bool) -> int:
    return stage(sleep)

def work():
    with prefect_api() as api:
        print("api", api, flush=True)
        print("result", guarded(sys.argv[1] == "sleep"), flush=True)

run_stopping_children(work)
"""


def _group_leader(tmp_path, mode: str, log: Path) -> subprocess.Popen:
    """The script in a session of its own, as a command a user started in a terminal (its process group is the
    terminal's foreground group, which Ctrl-C signals as a whole)."""
    script = tmp_path / "flow.py"
    script.write_text(_FLOW_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(tmp_path / "prefect-home")}
    env.pop("PREFECT_API_URL", None)
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, str(script), mode], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def test_flow_reports_to_a_temporary_server_it_stops(tmp_path):
    log = tmp_path / "flow.log"
    run = _group_leader(tmp_path, "finish", log)
    try:
        assert run.wait(timeout=120) == 0, log.read_text()
        text = log.read_text()
        assert "result 42" in text and "Finished in state Completed" in text, text
        port = int(text.split("api http://127.0.0.1:")[1].split("/")[0])
        assert _port_is_free(port)  # the temporary server stopped with the flow
    finally:
        if run.poll() is None:
            from flows.services import stop_tree

            stop_tree(run.pid, grace=5)


def test_ctrl_c_to_the_process_group_ends_the_flow_at_once(tmp_path):
    """Ctrl-C signals the terminal's whole process group. With Prefect's own temporary server (in that group) the
    server died first and the flow retried reaching it for minutes (seen: over 2 min, then kill -9); with
    `prefect_api()` the flow reports its crash to a server the signal did not reach, and everything stops."""
    log = tmp_path / "flow.log"
    run = _group_leader(tmp_path, "sleep", log)
    try:
        _wait_for(lambda: "started" in log.read_text(), 120, "the flow's task", run, log)
        children = psutil.Process(run.pid).children(recursive=True)
        port = int(log.read_text().split("api http://127.0.0.1:")[1].split("/")[0])
        os.killpg(run.pid, signal.SIGINT)
        assert run.wait(timeout=60) != 0, log.read_text()
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, [_command(p) for p in alive]
        assert _port_is_free(port)
        text = log.read_text()
        assert "Flow run" in text and "Finished in state Crashed" in text, text  # reported before the server stopped
        assert "Error logging to API" not in text, text
    finally:
        if run.poll() is None:
            from flows.services import stop_tree

            stop_tree(run.pid, grace=5)

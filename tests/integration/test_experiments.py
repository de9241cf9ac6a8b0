"""Runs that do not collide: a run with overrides is a DVC experiment (real git and DVC in a temporary project)
and leaves params.yaml, dvc.lock, the metrics and the outputs as they were; one run at a time per folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from icrl_core.errors import UserError
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent

STAGE = """import json, os, yaml
params = yaml.safe_load(open("params.yaml"))
os.makedirs("artifacts/one", exist_ok=True)
os.makedirs("metrics", exist_ok=True)
open("artifacts/one/value.txt", "w").write(str(params["ppo"]["kl_beta"]))
json.dump({"kl_beta_seen": params["ppo"]["kl_beta"]}, open("metrics/one.json", "w"))
"""


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), cwd=cwd, check=False, capture_output=True, text=True)
    assert result.returncode == 0, f"{args}: {result.stdout}\n{result.stderr}"
    return result


def _dvc(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return _run(str(BIN / "dvc"), *args, cwd=cwd)


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A committed git + DVC project with one stage that reads ppo.kl_beta; its baseline has run."""
    (tmp_path / "stage.py").write_text(STAGE)
    (tmp_path / "params.yaml").write_text("# demo params\nseed: 0\nppo:\n  kl_beta: 0.1  # kept comment\n")
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  one:\n    cmd: python stage.py\n    deps: [stage.py]\n    params: [ppo.kl_beta]\n"
        "    outs: [artifacts/one]\n    metrics:\n      - metrics/one.json:\n          cache: false\n")
    (tmp_path / ".gitignore").write_text("/artifacts/\n/metrics/\n/.icrl/\n")
    _run("git", "init", "-q", "-b", "main", cwd=tmp_path)
    _run("git", "config", "user.email", "test@example.invalid", cwd=tmp_path)
    _run("git", "config", "user.name", "test", cwd=tmp_path)
    _dvc("init", "-q", cwd=tmp_path)
    _dvc("repro", cwd=tmp_path)
    _run("git", "add", "-A", cwd=tmp_path)
    _run("git", "commit", "-qm", "baseline", cwd=tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes()
            for name in ("params.yaml", "dvc.lock", "metrics/one.json", "artifacts/one/value.txt")}


def test_a_run_with_overrides_is_a_dvc_experiment_and_the_workspace_returns(project):
    from flows.pipeline import dvc_experiment

    before = _snapshot(project)
    with dvc_experiment({"ppo.kl_beta": 0.5}, "kl-half"):
        assert "kl_beta: 0.5" in (project / "params.yaml").read_text()
        _dvc("repro", cwd=project)
        assert (project / "artifacts/one/value.txt").read_text() == "0.5"
    # params.yaml (comments and all), dvc.lock, the metrics and the outputs are the baseline's again
    assert _snapshot(project) == before
    assert "up to date" in _dvc("status", cwd=project).stdout
    shown = json.loads(_dvc("exp", "show", "--json", cwd=project).stdout)
    experiments = {exp["name"]: exp["revs"][0]["data"] for row in shown for exp in row.get("experiments") or []}
    assert set(experiments) == {"kl-half"}
    data = experiments["kl-half"]
    assert data["params"]["params.yaml"]["data"]["ppo"]["kl_beta"] == 0.5
    assert data["metrics"]["metrics/one.json"]["data"] == {"kl_beta_seen": 0.5}
    # its results come back on request, the DVC way
    _dvc("exp", "apply", "kl-half", cwd=project)
    assert (project / "artifacts/one/value.txt").read_text() == "0.5"


def test_a_failed_experiment_restores_params_and_saves_nothing(project):
    from flows.pipeline import dvc_experiment

    before = _snapshot(project)
    with pytest.raises(RuntimeError, match="stage failed"), dvc_experiment({"ppo.kl_beta": 0.7}, "broken"):
        _dvc("repro", cwd=project)
        raise RuntimeError("stage failed")
    assert _snapshot(project) == before
    assert not _run("git", "for-each-ref", "refs/exps", cwd=project).stdout.strip()
    with pytest.raises(UserError, match="exists already"):
        with dvc_experiment({"ppo.kl_beta": 0.5}, "named"):
            _dvc("repro", cwd=project)
        with dvc_experiment({"ppo.kl_beta": 0.6}, "named"):
            pass
    # an invalid value fails before anything runs
    with pytest.raises(Exception, match="ppo.kl_beta"), dvc_experiment({"ppo.kl_beta": "lots"}, "invalid"):
        pass
    assert (project / "params.yaml").read_bytes() == before["params.yaml"]


def test_a_run_killed_inside_an_experiment_is_undone_by_the_next_run(project):
    """kill -9 skips the `finally` that restores params.yaml: the bytes kept in .icrl/experiment-restore are put back
    by the next run, with or without overrides, and the next experiment records its own params only."""
    from flows.pipeline import EXPERIMENT_RESTORE, dvc_experiment, recover_interrupted_experiment

    before = _snapshot(project)
    killed = subprocess.run(
        [sys.executable, "-c", "import os, signal, subprocess\n"
         "from flows.pipeline import dvc_experiment\n"
         "with dvc_experiment({'ppo.kl_beta': 0.9}, 'killed'):\n"
         f"    subprocess.run([{str(BIN / 'dvc')!r}, 'repro'], check=True, capture_output=True)\n"
         "    os.kill(os.getpid(), signal.SIGKILL)\n"],
        cwd=project, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    assert "kl_beta: 0.9" in (project / "params.yaml").read_text()  # left changed: the finally never ran
    assert (project / EXPERIMENT_RESTORE / "manifest.json").exists()

    with dvc_experiment({"ppo.kl_beta": 0.5}, "after-kill"):
        # params.yaml is the baseline's plus this run's override, not the killed run's
        assert "kl_beta: 0.5" in (project / "params.yaml").read_text()
        assert "# demo params" in (project / "params.yaml").read_text()
        _dvc("repro", cwd=project)
    assert _snapshot(project) == before
    assert not (project / EXPERIMENT_RESTORE).exists()
    assert recover_interrupted_experiment() is False  # nothing left to undo
    # an invalid override leaves nothing to undo either
    with pytest.raises(Exception, match="ppo.kl_beta"), dvc_experiment({"ppo.kl_beta": "lots"}, "invalid"):
        pass
    assert not (project / EXPERIMENT_RESTORE).exists()


def test_a_hand_edit_after_a_killed_experiment_wins_and_the_old_params_are_kept_beside_it(project):
    from flows.pipeline import EXPERIMENT_RESTORE, recover_interrupted_experiment

    before = (project / "params.yaml").read_bytes()
    killed = subprocess.run(  # a run killed inside its experiment, as in the test above
        [sys.executable, "-c", "import os, signal\nfrom flows.pipeline import dvc_experiment\n"
         "with dvc_experiment({'ppo.kl_beta': 0.9}, 'killed'):\n    os.kill(os.getpid(), signal.SIGKILL)\n"],
        cwd=project, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    edited = (project / "params.yaml").read_text().replace("kl_beta: 0.9", "kl_beta: 0.3")
    (project / "params.yaml").write_text(edited)
    assert recover_interrupted_experiment() is True
    assert (project / "params.yaml").read_text() == edited
    assert (project / "params.yaml.before-interrupted-run").read_bytes() == before
    assert not (project / EXPERIMENT_RESTORE).exists()


def test_the_workspace_lock_makes_a_second_run_wait(tmp_path):
    """Two processes, one folder: the second holder starts only after the first lets go."""
    code = ("import sys, time; from icrl_core.io import exclusive_lock\n"
            "with exclusive_lock(sys.argv[1]):\n"
            "    print('start', time.time(), flush=True); time.sleep(1.5); print('end', time.time(), flush=True)\n")
    lock = str(tmp_path / ".icrl" / "workspace.lock")
    first = subprocess.Popen([sys.executable, "-c", code, lock], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert first.stdout.readline().startswith("start")
    waited: list[float] = []
    from icrl_core.io import exclusive_lock

    with exclusive_lock(lock, on_wait=lambda: waited.append(time.time())):
        acquired = time.time()
    ended = float(first.stdout.readline().split()[1])
    first.wait()
    assert waited and acquired >= ended

"""Shared fixtures. Tests run offline; the real SmolLM2 loads from the wheel's GGUF via the local cache."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.env import apply_defaults

apply_defaults()
# Under pytest-xdist the workers share the cores. torch's default (a thread per core in every worker and in every
# process a test starts) oversubscribes them, and OpenMP threads spinning for a core they do not get cost more than
# they compute: the unit tier took 249 s on 2 workers and 2 cores, 103 s with one thread each. So each worker, and
# what it starts, gets its share of the cores (a Ray worker still gets its own from Ray; set OMP_NUM_THREADS to
# override).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _WORKERS)))
os.environ.setdefault("PREFECT_HOME", str(ROOT / ".icrl" / "prefect-test-home"))
Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # a fresh clone has no .icrl/

TASKS_DIR = Path(os.environ.get("ICRL_TEST_TASKS_DIR", ROOT.parent / "shared" / "data" / "icrl-tasks"))
LAST_MODULES = ("test_vllm_backend.py",)


def pytest_collection_modifyitems(config, items):
    """The vllm module runs last: its engine lives in this process and leaves vLLM's settings behind after it is
    closed (environment variables such as LD_PRELOAD, which later subprocesses would inherit; the global random
    seed; about 1.2 GB of memory not returned), so no other test runs after it. Otherwise the order is pytest's."""
    items.sort(key=lambda item: item.path.name in LAST_MODULES)  # a stable sort


def perturb_lora_b(policy, std: float, seed: int = 0) -> None:
    """Draw every LoRA B matrix of `policy` from N(0, std^2), so its adapter is non-zero (the policy differs from
    its reference). From a seeded generator: this torch build seeds its global one differently in every process."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=std, generator=generator)


def write_toy_task(root: Path, queries: int) -> Path:
    """A two-label task folder `root/tasks/toy` laid out as ../shared/data/icrl-tasks/<task> is (labels.txt,
    train.jsonl, test.jsonl with the same `queries` rows: `query i`, labelled yes for odd i); returns root/tasks."""
    import json

    folder = root / "tasks" / "toy"
    folder.mkdir(parents=True)
    (folder / "labels.txt").write_text("yes\nno\n")
    rows = [{"text": f"query {i}", "label": "yes" if i % 2 else "no"} for i in range(queries)]
    for split in ("train", "test"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root / "tasks"


@pytest.fixture(scope="session")
def tasks_dir() -> Path:
    assert TASKS_DIR.is_dir(), f"test data not found at {TASKS_DIR}"
    return TASKS_DIR


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (frozen), loaded once per session."""
    from icrl_core.model import load_policy

    return load_policy("smollm2-135m")


@pytest.fixture(scope="session")
def tiny():
    """A tiny random model with SmolLM2's architecture and tokenizer (frozen)."""
    from icrl_core.model import load_policy

    return load_policy("tiny", seed=0)


@pytest.fixture(scope="session")
def tokens(tiny):
    return tiny.tokens


@pytest.fixture(autouse=True)
def _fresh_mlflow_uri(monkeypatch):
    """`mlflow.set_tracking_uri` writes MLFLOW_TRACKING_URI into os.environ; without this, a test's store would
    leak into every later test and into the subprocesses they start (a deleted SQLite file: 'readonly database')."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield
    import sys as _sys

    if "mlflow" in _sys.modules:
        import mlflow

        mlflow.set_tracking_uri(None)  # type: ignore[arg-type]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run the test inside a fresh working directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


TIMING_KEYS = frozenset({"tokens_per_s", "step_seconds", "seconds"})  # differ between two runs of the same work


def timeless(metrics):
    """A metrics dict, or a list of them (a history), without the wall-clock keys (TIMING_KEYS)."""
    if isinstance(metrics, dict):
        return {k: v for k, v in metrics.items() if k not in TIMING_KEYS}
    return [timeless(row) for row in metrics]


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600):
    """Run the real `icrl` console script; return the CompletedProcess."""
    exe = Path(sys.executable).parent / "icrl"
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([str(exe), *args], cwd=cwd or ROOT, env=full_env, check=False, capture_output=True, text=True,
                          timeout=timeout)


def call_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """Call the `icrl` CLI in this process (`tasks.cli.main`, the console script's function) from `cwd`; a
    CompletedProcess as run_cli returns. For commands whose process is not what the test is about: a console-script
    subprocess costs ~5 s of interpreter start-up and imports."""
    import contextlib
    import io

    from tasks.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["icrl", *args], code, out.getvalue(), err.getvalue())


def own_ray_train_workers() -> list:
    """Ray Train worker processes of this test process's own local Ray (its descendants): fault-injection tests
    kill these, never another job's workers on the same machine."""
    import psutil

    me = os.getpid()
    return [proc for proc in psutil.process_iter(["pid", "cmdline"])
            if "RayTrainWorker" in " ".join(proc.info["cmdline"] or [])
            and any(parent.pid == me for parent in _parents(proc))]


@contextmanager
def a_ray_train_worker_killed_after(checkpoints: Path, step: int, timeout: float):
    """Kills one of this process's Ray Train workers once `checkpoints` holds a checkpoint of step `step` or later,
    from a thread beside the block; yields the list the killed pid goes into (empty if none was killed)."""
    from icrl_core.checkpoint import latest_checkpoint

    killed: list[int] = []
    done = threading.Event()

    def watch():
        deadline = time.time() + timeout
        while time.time() < deadline and not done.is_set():
            latest = latest_checkpoint(checkpoints)
            if latest is not None and latest.name >= f"step-{step:08d}":
                for proc in own_ray_train_workers():
                    proc.kill()
                    killed.append(proc.info["pid"])
                    return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield killed
    finally:  # the run ended (or failed) without the kill: stop watching now, not at the deadline
        done.set()
        watcher.join()


def _parents(proc) -> list:
    import psutil

    try:
        return proc.parents()
    except psutil.Error:  # exited meanwhile
        return []


class Killed(Exception):
    """A run killed right after a checkpoint."""


class MemoryRuntime:
    """The runtime protocol of the training loop (train_ppo, train_dpo, ...) with checkpoints kept in memory."""

    rank, world_size = 0, 1

    def __init__(self, checkpoints: list | None = None, kill_after: int | None = None):
        self.checkpoints = checkpoints if checkpoints is not None else []
        self.reports: list[tuple[int, dict]] = []
        self.kill_after = kill_after  # the run dies right after writing this many checkpoints

    def report(self, metrics, step):
        self.reports.append((step, dict(metrics)))

    def save_checkpoint(self, state):
        self.checkpoints.append(copy.deepcopy(state))
        if len(self.checkpoints) == self.kill_after:
            raise Killed

    def load_latest_checkpoint(self):
        return self.checkpoints[-1] if self.checkpoints else None

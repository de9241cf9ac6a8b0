"""`icrl stage bootstrap` killed with SIGKILL after its first checkpoint and started again ends with the same
final metrics and bitwise the same adapter as an uninterrupted run; a truncated checkpoint is refused with exit
code 2 (never a silent fresh start). Tiny model, real console script in subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from tasks.settings import load_config
from tests.conftest import TIMING_KEYS, run_cli
from tests.stage_helpers import stage_args

# Enough steps that the kill lands well before the end; timing keys differ between runs by nature.
BOOTSTRAP = ("bootstrap.max_steps=8", "bootstrap.save_steps=2", "bootstrap.eval_steps=4", "bootstrap.batch_size=2",
             "bootstrap.grad_accum=2", "bootstrap.learning_rate=3e-3", "bootstrap.max_eval_episodes=4")


def _metrics(stdout: str) -> dict:
    return {k: v for k, v in json.loads(stdout[stdout.index("{"):]).items() if k not in TIMING_KEYS}


def _checkpoints(root: Path) -> list[Path]:
    return sorted(root.glob(".icrl/checkpoints/bootstrap-*/step-*"))


def test_bootstrap_resumes_after_sigkill_and_refuses_a_corrupt_checkpoint(tmp_path, monkeypatch):
    from tasks import build_dataset, tokenize

    first = tmp_path / "uninterrupted"
    first.mkdir()
    monkeypatch.chdir(first)
    config = load_config(None, [a for a in stage_args(*BOOTSTRAP) if a != "--set"])
    build_dataset.run(config)
    tokenize.run(config)
    killed = tmp_path / "killed"
    shutil.copytree(first, killed)
    args = ["stage", "bootstrap", *stage_args(*BOOTSTRAP)]

    full = run_cli(*args, cwd=first)
    assert full.returncode == 0, full.stderr
    expected = _metrics(full.stdout)
    assert expected["step"] == 8 and "val_answer_accuracy" in expected
    assert not _checkpoints(first)  # cleared once the stage completed

    exe = Path(sys.executable).parent / "icrl"
    proc = subprocess.Popen([str(exe), *args], cwd=killed, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=os.environ.copy())
    deadline = time.monotonic() + 300
    while not _checkpoints(killed) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the stage finished before it could be killed"
    saved = _checkpoints(killed)
    assert saved and not (killed / "artifacts/bootstrap/adapter").exists()

    corrupt = tmp_path / "corrupt"
    shutil.copytree(killed, corrupt)
    weights = _checkpoints(corrupt)[-1] / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    refused = run_cli(*args, cwd=corrupt)
    assert refused.returncode == 2
    assert "truncated" in refused.stderr and "trainable.safetensors" in refused.stderr
    assert not (corrupt / "artifacts/bootstrap/adapter").exists()

    resumed = run_cli(*args, cwd=killed)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from checkpoint at step" in resumed.stderr
    assert _metrics(resumed.stdout) == expected
    a = load_file(str(first / "artifacts/bootstrap/adapter/adapter_model.safetensors"))
    b = load_file(str(killed / "artifacts/bootstrap/adapter/adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((killed / "artifacts/bootstrap/metrics.json").read_text())["step"] == 8

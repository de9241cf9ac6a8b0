"""The `ppo` stage end to end on the tiny model: outputs, the reward-model path, and resume after SIGKILL with
the same final metrics and weights as an uninterrupted run; a truncated checkpoint is refused (exit code 2)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tasks.settings import load_config
from tests.conftest import ROOT, call_cli, run_cli
from tests.ppo_helpers import write_keyword_dataset
from tests.unit.test_ppo_stage import TINY_PPO


def _cli_args(overrides: list[str]) -> list[str]:
    return [arg for item in overrides for arg in ("--set", item)]


def _final_metrics(folder: Path) -> dict:
    metrics = json.loads((folder / "artifacts" / "ppo" / "metrics.json").read_text())
    metrics.pop("seconds")
    return metrics


def test_ppo_stage_writes_outputs_and_uses_a_reward_model(in_tmp):
    from icrl_core.config import ModelConfig
    from icrl_core.reward_model import new_reward_model, save_reward_model
    from tasks.ppo import run

    write_keyword_dataset(in_tmp / "data", train=8, val=2)
    save_reward_model(in_tmp / "rm", new_reward_model(ModelConfig(spec="tiny"), None, seed=1))
    overrides = TINY_PPO + ["ppo.max_steps=2", "ppo.reward={kind: both, task_weight: 1.0, model_weight: 0.5}",
                            "ppo.reward_model_path=rm"]
    metrics = run(load_config(None, overrides, environ={}))
    out = in_tmp / "artifacts" / "ppo"
    assert {p.name for p in (out / "adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                                             "icrl_adapter.json", "value_head.safetensors"}
    history = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2]
    assert isinstance(json.loads((out / "evals.json").read_text()), list)
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert json.loads((out / "metrics.json").read_text())["iterations"] == 2
    assert set(json.loads((in_tmp / "metrics" / "ppo.json").read_text())) == {"mean_reward_last_20pct",
                                                                               "val_accuracy_after"}
    for key in ("mean_reward_first_20pct", "mean_reward_last_20pct", "final_kl", "final_entropy",
                "final_clip_frac", "final_approx_kl", "final_value_loss", "final_explained_variance",
                "val_accuracy_before", "val_accuracy_after"):
        assert key in metrics, key
    last = history[-1]
    # the tiny model never answers right: the reward is the reward model's score alone, 0.5 * r(x, y)
    assert last["task_accuracy"] == 0.0 and last["mean_reward"] != 0.0
    assert not (in_tmp / ".icrl" / "checkpoints").exists() or not any((in_tmp / ".icrl" / "checkpoints").iterdir())


def _wait_for_checkpoint(folder: Path, process: subprocess.Popen, timeout: float = 300) -> Path:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = sorted((folder / ".icrl" / "checkpoints").glob("ppo-*/step-*"))
        if found:
            return found[-1]
        if process.poll() is not None:
            raise AssertionError(f"stage ended before its first checkpoint: {process.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError("no checkpoint appeared")


def test_ppo_resumes_after_sigkill_with_the_same_final_metrics(tmp_path):
    uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
    for folder in (uninterrupted, killed):
        write_keyword_dataset(folder / "data", train=12, val=2)
    args = ("stage", "ppo", *_cli_args(TINY_PPO))
    exe = str(Path(sys.executable).parent / "icrl")

    def start(folder: Path) -> subprocess.Popen:
        return subprocess.Popen([exe, *args], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=os.environ.copy())

    process, reference = start(killed), start(uninterrupted)
    checkpoint = _wait_for_checkpoint(killed, process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL and not (killed / "metrics" / "ppo.json").exists()

    # A truncated checkpoint is refused with a clear message, never loaded or skipped silently.
    backup = tmp_path / "backup"
    shutil.copytree(checkpoint.parent, backup)
    latest = max(checkpoint.parent.glob("step-*"))
    weights = latest / "trainable.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    refused = run_cli(*args, cwd=killed)
    assert refused.returncode == 2 and "truncated" in refused.stderr, refused.stderr
    shutil.rmtree(checkpoint.parent)
    shutil.copytree(backup, checkpoint.parent)

    resumed = run_cli(*args, cwd=killed)
    assert resumed.returncode == 0, resumed.stderr
    _, reference_err = reference.communicate(timeout=600)
    assert reference.returncode == 0, reference_err
    assert "resuming from checkpoint at step" in resumed.stdout + resumed.stderr
    assert _final_metrics(killed) == _final_metrics(uninterrupted)  # bitwise: same floats
    for name in ("adapter_model.safetensors", "value_head.safetensors"):
        assert (killed / "artifacts/ppo/adapter" / name).read_bytes() == \
            (uninterrupted / "artifacts/ppo/adapter" / name).read_bytes()
    history = json.loads((killed / "artifacts/ppo/history.json").read_text())
    reference_history = json.loads((uninterrupted / "artifacts/ppo/history.json").read_text())
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_seconds")} for r in rows]
    assert strip(history) == strip(reference_history)


def test_cli_has_ppo_and_adapt_options_documented():
    result = call_cli("adapt", "--help", cwd=ROOT)
    assert result.returncode == 0 and "--episode-id" in result.stdout and "untouched" in result.stdout

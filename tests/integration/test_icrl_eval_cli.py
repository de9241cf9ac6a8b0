"""`icrl eval` end to end (tiny model): run folder, MLflow, kill -9 + --resume, count-tokens, inspect, plot,
max-examples."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import call_cli, run_cli

MEASURED = ("seconds", "tokens_computed", "prob")  # depend on what was cached, not on the protocol
ENV = {"OMP_NUM_THREADS": "1"}


def _eval_args(tmp: Path, run_name: str, train_k: int = 60, *extra: str) -> list[str]:
    return ["eval", "--model", "tiny", "--task", "keyword_map", "--strategy", "explorative", "--p-keep", "0.5",
            "--train-k", str(train_k), "--test-every", "20", "--test-k", "10", "--seed", "5", "--threads", "1",
            "--output-dir", str(tmp / "runs"), "--run-name", run_name, "--no-progress", *extra]


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_complete(path: Path) -> list[dict]:
    """The complete lines of a log whose last line may be cut."""
    return [json.loads(line) for line in path.read_text().splitlines()[:-1]]


def _stable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in MEASURED} for r in records]


def test_eval_run_folder_tracking_and_tools(tmp_path):
    out = run_cli(*_eval_args(tmp_path, "full"), cwd=tmp_path, env=ENV)
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "runs" / "full"
    for name in ("config.json", "run.json", "steps.jsonl", "tests.jsonl", "metrics.json", "learning_curve.png"):
        assert (run_dir / name).exists(), name
    steps, tests = _read(run_dir / "steps.jsonl"), _read(run_dir / "tests.jsonl")
    assert [s["step"] for s in steps] == list(range(60))
    assert [t["step"] for t in tests] == [0, 19, 39, 59]
    assert {"query", "prediction", "gold", "reward", "context", "tokens_computed", "seconds"} <= set(steps[0])
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["regret"] == sum(1 - s["reward"] for s in steps)
    assert "test accuracy: step 0:" in out.stdout
    wrong = [(a, b) for a, b in itertools.pairwise(steps) if a["reward"] == 0]   # no flips: feedback == reward
    assert metrics["repeat_after_wrong"] == round(sum(a["prediction"] == b["prediction"] for a, b in wrong)
                                                  / len(wrong), 4)
    assert f"repeats its last answer after {metrics['repeat_after_wrong']:.0%} of wrong answers" in out.stdout

    # MLflow (sqlite store in the working directory): params, step metrics and the run folder as artifacts.
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["icrl"], output_format="list")
    assert len(runs) == 1 and runs[0].data.params["icrl_eval.strategy"] == "explorative"
    history = mlflow.MlflowClient().get_metric_history(runs[0].info.run_id, "test_accuracy")
    assert [m.step for m in history] == [0, 19, 39, 59]
    assert runs[0].data.metrics["repeat_after_wrong"] == metrics["repeat_after_wrong"]
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(runs[0].info.run_id, "icrl_eval")}
    assert "icrl_eval/steps.jsonl" in artifacts

    again = run_cli(*_eval_args(tmp_path, "full"), cwd=tmp_path, env=ENV)
    assert again.returncode == 2 and "--resume" in again.stderr

    other = run_cli(*_eval_args(tmp_path, "naive", 30, "--strategy", "naive", "--no-tracking"), cwd=tmp_path,
                    env=ENV)
    assert other.returncode == 0, other.stderr
    counted = call_cli("count-tokens", str(run_dir), str(tmp_path / "runs" / "naive"), cwd=tmp_path)
    assert counted.returncode == 0 and "reuse factor" in counted.stdout and "full" in counted.stdout
    inspected = call_cli("inspect", str(run_dir), "--window", "20", "--json", cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert [w["first_step"] for w in report["windows"]] == [0, 20, 40]
    assert all(w["repeat_after_wrong"] is None or 0 <= w["repeat_after_wrong"] <= 1 for w in report["windows"])
    assert [e["step"] for e in report["evaluations"]] == [0, 19, 39, 59]
    table = call_cli("inspect", str(run_dir), cwd=tmp_path)
    assert table.returncode == 0 and "top label share" in table.stdout
    png = tmp_path / "cmp.png"
    plotted = call_cli("plot", str(run_dir), str(tmp_path / "runs" / "naive"), "--output", str(png), "--title", "t",
                       cwd=tmp_path)
    assert plotted.returncode == 0 and png.stat().st_size > 10_000
    cap = call_cli("max-examples", "--model", "tiny", "--task", "keyword_map", "--window", "1024", cwd=tmp_path)
    assert cap.returncode == 0 and int(cap.stdout.strip().splitlines()[-1]) > 5


def test_killed_run_resumes_to_the_same_log(tmp_path):
    """SIGKILL at a random step, --resume, and the per-step log equals an uninterrupted run's."""
    train_k = 120
    reference = run_cli(*_eval_args(tmp_path, "reference", train_k, "--no-tracking"), cwd=tmp_path, env=ENV)
    assert reference.returncode == 0, reference.stderr

    kill_at = random.Random().randint(20, 90)
    run_dir = tmp_path / "runs" / "killed"
    exe = Path(sys.executable).parent / "icrl"
    proc = subprocess.Popen([str(exe), *_eval_args(tmp_path, "killed", train_k, "--no-tracking")], cwd=tmp_path,
                            env={**os.environ, **ENV}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    steps_file = run_dir / "steps.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if steps_file.exists() and steps_file.read_bytes().count(b"\n") >= kill_at:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run ended before it could be killed"
    done = steps_file.read_bytes().count(b"\n")
    assert kill_at <= done < train_k
    # A kill can also land mid-line: simulate the worst case, a truncated last line.
    with open(steps_file, "ab") as handle:
        handle.write(b'{"step": 99999, "query": "trunc')
    # ... and the run goes on from a copy without the queries' text (`icrl redact`, e.g. parked in a repository)
    redacted = call_cli("redact", str(run_dir), str(tmp_path / "redacted"), cwd=tmp_path)
    assert redacted.returncode == 0 and "1 step log(s)" in " ".join(redacted.stdout.split()), redacted.stderr
    queries = {s["query"] for s in _read_complete(steps_file)}
    assert not any(q.encode() in path.read_bytes() for path in (tmp_path / "redacted").iterdir() for q in queries)
    again = call_cli("redact", str(run_dir), str(tmp_path / "redacted"), cwd=tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr
    os.rename(run_dir, tmp_path / "original")
    os.rename(tmp_path / "redacted", run_dir)

    resumed = run_cli(*_eval_args(tmp_path, "killed", train_k, "--no-tracking", "--resume"), cwd=tmp_path, env=ENV)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {done}" in resumed.stdout.replace("\n", " ")
    ref_dir = tmp_path / "runs" / "reference"
    from icrl_core.icrl_eval import redact_step_event

    reference_steps = _read(ref_dir / "steps.jsonl")
    assert _stable(_read(steps_file)) == _stable([redact_step_event(s) for s in reference_steps[:done]]
                                                 + reference_steps[done:])
    assert _stable(_read(run_dir / "tests.jsonl")) == _stable(_read(ref_dir / "tests.jsonl"))

    changed = run_cli(*_eval_args(tmp_path, "killed", train_k, "--no-tracking", "--resume", "--seed", "6"),
                      cwd=tmp_path, env=ENV)
    assert changed.returncode == 2 and "icrl_eval.seed" in changed.stderr

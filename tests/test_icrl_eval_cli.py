"""`icrl eval` end to end (tiny model): run folder, MLflow, kill -9 + --resume, count-tokens, inspect, plot,
max-examples, and the Hugging Face dataset path (a DatasetDict saved to disk)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli

MEASURED = ("seconds", "tokens_computed", "prob")  # depend on what was cached, not on the protocol
ENV = {"OMP_NUM_THREADS": "1"}


def _eval_args(tmp: Path, run_name: str, train_k: int = 60, *extra: str) -> list[str]:
    return ["eval", "--model", "tiny", "--task", "keyword_map", "--strategy", "explorative", "--p-keep", "0.5",
            "--train-k", str(train_k), "--test-every", "20", "--test-k", "10", "--seed", "5", "--threads", "1",
            "--output-dir", str(tmp / "runs"), "--run-name", run_name, "--no-progress", *extra]


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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

    # MLflow (sqlite store in the working directory): params, step metrics and the run folder as artifacts.
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["icrl"], output_format="list")
    assert len(runs) == 1 and runs[0].data.params["icrl_eval.strategy"] == "explorative"
    history = mlflow.MlflowClient().get_metric_history(runs[0].info.run_id, "test_accuracy")
    assert [m.step for m in history] == [0, 19, 39, 59]
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(runs[0].info.run_id, "icrl_eval")}
    assert "icrl_eval/steps.jsonl" in artifacts

    again = run_cli(*_eval_args(tmp_path, "full"), cwd=tmp_path, env=ENV)
    assert again.returncode == 2 and "--resume" in again.stderr

    other = run_cli(*_eval_args(tmp_path, "naive", 30, "--strategy", "naive", "--no-tracking"), cwd=tmp_path,
                    env=ENV)
    assert other.returncode == 0, other.stderr
    counted = run_cli("count-tokens", str(run_dir), str(tmp_path / "runs" / "naive"), cwd=tmp_path, env=ENV)
    assert counted.returncode == 0 and "reuse factor" in counted.stdout and "full" in counted.stdout
    inspected = run_cli("inspect", str(run_dir), "--window", "20", "--json", cwd=tmp_path, env=ENV)
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert [w["first_step"] for w in report["windows"]] == [0, 20, 40]
    assert [e["step"] for e in report["evaluations"]] == [0, 19, 39, 59]
    table = run_cli("inspect", str(run_dir), cwd=tmp_path, env=ENV)
    assert table.returncode == 0 and "top label share" in table.stdout
    png = tmp_path / "cmp.png"
    plotted = run_cli("plot", str(run_dir), str(tmp_path / "runs" / "naive"), "--output", str(png), "--title", "t",
                      cwd=tmp_path, env=ENV)
    assert plotted.returncode == 0 and png.stat().st_size > 10_000
    cap = run_cli("max-examples", "--model", "tiny", "--task", "keyword_map", "--window", "1024", cwd=tmp_path,
                  env=ENV)
    assert cap.returncode == 0 and int(cap.stdout.strip().splitlines()[-1]) > 5


def test_killed_run_resumes_to_the_same_log(tmp_path):
    """SIGKILL at a random step, --resume, and the per-step log equals an uninterrupted run's."""
    train_k = 400
    reference = run_cli(*_eval_args(tmp_path, "reference", train_k, "--no-tracking"), cwd=tmp_path, env=ENV)
    assert reference.returncode == 0, reference.stderr

    kill_at = random.Random().randint(20, 300)
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

    resumed = run_cli(*_eval_args(tmp_path, "killed", train_k, "--no-tracking", "--resume"), cwd=tmp_path, env=ENV)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at step {done}" in resumed.stdout.replace("\n", " ")
    ref_dir = tmp_path / "runs" / "reference"
    assert _stable(_read(steps_file)) == _stable(_read(ref_dir / "steps.jsonl"))
    assert _stable(_read(run_dir / "tests.jsonl")) == _stable(_read(ref_dir / "tests.jsonl"))

    changed = run_cli(*_eval_args(tmp_path, "killed", train_k, "--no-tracking", "--resume", "--seed", "6"),
                      cwd=tmp_path, env=ENV)
    assert changed.returncode == 2 and "icrl_eval.seed" in changed.stderr


def test_hub_dataset_path_offline_via_save_to_disk(tmp_path, tasks_dir):
    """The Hub conversion (ClassLabel ids -> dataset label names -> the paper's label text) on a DatasetDict
    shaped like CogComp/trec, saved to disk and loaded back."""
    import datasets

    from icrl_core.task_data import load_task, load_task_from_disk, load_task_from_source

    real = load_task("trec_fine", tasks_dir)
    fine_names = [line.split("\t")[0] for line in (tasks_dir / "trec_fine" / "label_map.tsv").read_text()
                  .splitlines()[1:]]
    features = datasets.Features({
        "text": datasets.Value("string"),
        "coarse_label": datasets.ClassLabel(names=["ABBR", "ENTY", "DESC", "HUM", "LOC", "NUM"]),
        "fine_label": datasets.ClassLabel(names=fine_names),
    })
    rows = {"text": ["What does NASA stand for ?", "Who wrote Hamlet ?", "How far is the moon ?"],
            "coarse_label": [0, 3, 5], "fine_label": [1, 29, 40]}
    data = datasets.DatasetDict({split: datasets.Dataset.from_dict(rows, features=features)
                                 for split in ("train", "test")})
    data.save_to_disk(str(tmp_path / "trec"))

    coarse = load_task_from_disk("trec_coarse", tmp_path / "trec", tasks_dir)
    assert [e.label for e in coarse.train] == ["abbreviation", "human", "numeric"]
    assert coarse.labels == load_task("trec_coarse", tasks_dir).labels
    fine = load_task_from_source("trec_fine", "disk", tasks_dir, disk_path=tmp_path / "trec")
    assert fine.labels == real.labels
    assert [e.label for e in fine.test] == ["abbreviation expansion", "human individual", "numeric distance"]
    assert fine.template.query_prefix == "Question:"
    unsemantic = load_task_from_disk("trec_coarse_unsemantic", tmp_path / "trec", tasks_dir)
    assert all(label.startswith("L") for label in unsemantic.labels)

    # The NLU dataset has one split: it is split 80/20 with seed 0 as the paper does.
    nlu = datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"text": [f"utterance {i}" for i in range(20)], "label": [i % 2 for i in range(20)]},
        features=datasets.Features({"text": datasets.Value("string"),
                                    "label": datasets.ClassLabel(names=["alarm_query", "alarm_set"])}))})
    nlu.save_to_disk(str(tmp_path / "nlu"))
    task = load_task_from_disk("nlu", tmp_path / "nlu")
    assert len(task.train) == 16 and len(task.test) == 4 and task.labels == ["alarm query", "alarm set"]
    from icrl_core.errors import UserError

    with pytest.raises(UserError, match="save_to_disk"):
        load_task_from_disk("trec_coarse", tmp_path / "missing")
    assert ROOT.exists()


def test_jsonl_reader_drops_only_a_truncated_last_line(tmp_path):
    from icrl_core.errors import UserError
    from tasks.icrl_eval import read_jsonl

    path = tmp_path / "steps.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "qu')
    assert read_jsonl(path) == ([{"step": 0}, {"step": 1}], True)
    path.write_text('{"step": 0}\n{"step": 1}\n')
    assert read_jsonl(path) == ([{"step": 0}, {"step": 1}], False)
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(UserError, match="steps.jsonl:2"):
        read_jsonl(path)


def test_a_run_folder_of_the_one_number_p_keep_resumes(tmp_path):
    """A run written when icrl_eval.p_keep was one number resumes under the per-strategy form of the same
    value, and not under another value."""
    from icrl_core.errors import UserError
    from tasks.icrl_eval import _check_resumable
    from tasks.settings import load_config, with_overrides

    config = with_overrides(load_config(), {"icrl_eval.p_keep": 0.3})
    saved = config.model_dump(mode="json")
    saved["icrl_eval"]["p_keep"] = 0.3
    (tmp_path / "config.json").write_text(json.dumps(saved))
    _check_resumable(tmp_path, config)
    with pytest.raises(UserError, match="icrl_eval.p_keep"):
        _check_resumable(tmp_path, with_overrides(config, {"icrl_eval.p_keep": {"explorative": 0.5}}))

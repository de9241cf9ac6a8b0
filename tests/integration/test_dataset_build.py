"""`icrl stage build_dataset` with a bad episode file: exit code 2 naming the file, nothing written. The dataset
build itself: tests/unit/test_dataset_build.py."""

from __future__ import annotations

from tests.conftest import ROOT, run_cli
from tests.stage_helpers import stage_args


def test_bad_episode_file_exits_2_and_writes_nothing(tmp_path):
    bad = ROOT / "tests" / "data" / "bad_episodes" / "several_bad.jsonl"
    result = run_cli("stage", "build_dataset", *stage_args(f"data.sources=[{{kind: file, path: '{bad}'}}]"),
                     cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"{bad}:" in result.stderr
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "metrics").exists()

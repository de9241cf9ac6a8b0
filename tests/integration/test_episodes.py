"""`icrl validate-episodes` through the real console script: every bad line named, exit code 2; a good file
passes (in this process). Reading, writing and rendering episodes: tests/unit/test_episodes.py."""

from __future__ import annotations

from tests.conftest import ROOT, call_cli, run_cli
from tests.unit.test_episodes import BAD, EXPECTED


def test_cli_validate_lists_each_bad_line_and_exits_2():
    path = BAD / "several_bad.jsonl"
    result = run_cli("validate-episodes", str(path))
    assert result.returncode == 2
    for line in EXPECTED["several_bad.jsonl"]:
        assert f"{path}:{line}: " in result.stderr
    ok = call_cli("validate-episodes", str(ROOT / "examples" / "episodes.jsonl"), cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert "3 episode(s)" in ok.stdout

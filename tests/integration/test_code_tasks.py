"""`icrl tasks` (a fresh interpreter) lists the code-task family. Its parts: tests/unit/test_code_tasks.py."""

from __future__ import annotations

import subprocess
import sys

from icrl_core.code_tasks import code_tasks
from tests.conftest import ROOT


def test_icrl_tasks_lists_the_code_family():
    out = subprocess.run([sys.executable, "-m", "tasks.cli", "tasks"], cwd=ROOT, check=False, capture_output=True,
                         text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"code_tasks: {len(code_tasks())} Python function tasks" in out.stdout
    assert "run_length" in out.stdout and "list[int]" in out.stdout

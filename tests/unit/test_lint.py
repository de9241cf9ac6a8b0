"""The code base stays ruff-clean: `ruff check .` with the project's settings ([tool.ruff] in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

RUFF = Path(sys.executable).parent / "ruff"


def test_ruff_check_finds_nothing():
    if not RUFF.exists():
        pytest.skip(f"ruff is not installed beside this interpreter ({RUFF}); pip install -c constraints.txt ruff")
    # --no-cache: the test writes nothing into the checkout
    result = subprocess.run([str(RUFF), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                            check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (f"`ruff check .` failed (fix the code; a deliberate exception gets a "
                                    f"`# noqa: RULE - reason` or a line in [tool.ruff.lint]):\n"
                                    f"{result.stdout}{result.stderr}")

"""experiments/icrl_stream_rl/run.sh park / unpark (addendum 23): a run that cannot finish inside a session parks
each stage's latest checkpoint beside the script, and the next session's training target restores it before it
starts, so the stage resumes. The script runs for real in a copy of the project layout; `icrl` is a stand-in
that records its calls (what it runs is tested elsewhere)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

SCRIPT = Path("experiments/icrl_stream_rl/run.sh")
PARKED = Path("experiments/icrl_stream_rl/checkpoints")


def _run(project: Path, *targets: str) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", str(project / SCRIPT), *targets], cwd=project, capture_output=True, text=True,
                            check=False, timeout=60, env={**os.environ, "PATH": os.environ.get("PATH", "")})
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def _checkpoint(folder: Path, marker: str) -> None:
    folder.mkdir(parents=True)
    (folder / "state.safetensors").write_text(marker)


def test_park_keeps_the_latest_checkpoint_and_a_training_target_restores_it(tmp_path):
    project = tmp_path
    (project / SCRIPT).parent.mkdir(parents=True)
    shutil.copy2(ROOT / SCRIPT, project / SCRIPT)
    stub = project / ".venv" / "bin" / "icrl"
    stub.parent.mkdir(parents=True)
    stub.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls.log"\n')
    stub.chmod(0o755)
    run = project / ".icrl" / "checkpoints" / "ppo-0123abcd"
    _checkpoint(run / "step-00000003", "3")
    _checkpoint(run / "step-00000004", "4")
    (run / ".step-00000005.123.tmp").mkdir()  # a checkpoint being written when the run was killed
    (project / ".icrl" / "checkpoints" / "dpo-4567ef01").mkdir()  # a stage with no checkpoint yet

    parked = _run(project, "park")
    assert sorted(p.name for p in (project / PARKED).iterdir()) == ["ppo-0123abcd"], parked.stdout
    assert [p.name for p in (project / PARKED / "ppo-0123abcd").iterdir()] == ["step-00000004"]
    assert (project / PARKED / "ppo-0123abcd" / "step-00000004" / "state.safetensors").read_text() == "4"

    # the next session: a fresh working tree holds only what was committed
    shutil.rmtree(project / ".icrl")
    resumed = _run(project, "s15")
    restored = project / ".icrl" / "checkpoints" / "ppo-0123abcd" / "step-00000004" / "state.safetensors"
    assert restored.read_text() == "4" and "restored the parked checkpoint" in resumed.stdout
    calls = (stub.parent / "calls.log").read_text().splitlines()
    assert calls[0].startswith("stage ppo ") and calls[1].startswith("stage evaluate ")
    # ... once: after the run went on (newer checkpoints, the parked step rotated away) a target leaves it alone
    _checkpoint(project / ".icrl" / "checkpoints" / "ppo-0123abcd" / "step-00000006", "6")
    shutil.rmtree(project / ".icrl" / "checkpoints" / "ppo-0123abcd" / "step-00000004")
    again = _run(project, "s15")
    assert "restored" not in again.stdout
    assert [p.name for p in (project / ".icrl" / "checkpoints" / "ppo-0123abcd").iterdir()] == ["step-00000006"]
    _run(project, "park")
    assert [p.name for p in (project / PARKED / "ppo-0123abcd").iterdir()] == ["step-00000006"]

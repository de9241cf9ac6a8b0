"""atomic_dir replaces a folder so that a reader sees the old version or the new one, even when the writing process
dies between the steps (simulated here by a subprocess that exits hard at that point)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from icrl_core import io
from icrl_core.io import atomic_dir, recover_dir
from tests.conftest import ROOT

# A writer that replaces `target` with a folder holding new.txt and dies hard (no cleanup, like SIGKILL) at the
# step named by argv[2]: 'fallback' forces the two-rename path and dies between the renames; 'exchange' dies right
# after the RENAME_EXCHANGE swap, before the old folder is deleted.
WRITER = """
import os, shutil, sys
from pathlib import Path
from icrl_core import io

target, crash = Path(sys.argv[1]), sys.argv[2]
if crash == "fallback":
    io._renameat2 = lambda source, dest, flags: False
    real_replace, calls = os.replace, []
    def replace(source, dest):
        calls.append(dest)
        if len(calls) == 2:
            os._exit(9)
        real_replace(source, dest)
    os.replace = replace
else:
    shutil.rmtree = lambda *args, **kwargs: os._exit(9)
with io.atomic_dir(target) as tmp:
    (tmp / "new.txt").write_text("new")
"""


def _old_version(tmp_path: Path) -> Path:
    target = tmp_path / "adapter"
    with atomic_dir(target) as tmp:
        (tmp / "old.txt").write_text("old")
    return target


def _crash(target: Path, step: str) -> None:
    done = subprocess.run([sys.executable, "-c", WRITER, str(target), step], cwd=ROOT, check=False,
                          capture_output=True, text=True)
    assert done.returncode == 9, done.stderr


def _hidden(target: Path) -> list[str]:
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith("."))


def test_a_crash_between_the_two_renames_is_recovered_on_next_access(tmp_path):
    target = _old_version(tmp_path)
    _crash(target, "fallback")
    hidden = _hidden(target)
    assert not target.exists() and len(hidden) == 2 and any(".old-" in name for name in hidden)
    recover_dir(target)
    assert [p.name for p in target.iterdir()] == ["old.txt"] and _hidden(target) == []
    # the next write goes through
    _crash(target, "fallback")
    with atomic_dir(target) as tmp:  # recovers first
        (tmp / "newer.txt").write_text("newer")
    assert [p.name for p in target.iterdir()] == ["newer.txt"] and _hidden(target) == []


@pytest.mark.skipif(io._libc_renameat2() is None, reason="no renameat2 here")
def test_an_exchange_leaves_the_new_folder_in_place_at_every_step(tmp_path):
    target = _old_version(tmp_path)
    _crash(target, "exchange")
    assert [p.name for p in target.iterdir()] == ["new.txt"]  # in place before the old one is deleted
    assert len(_hidden(target)) == 1  # the old version, left by the dead writer
    recover_dir(target)
    assert _hidden(target) == [] and [p.name for p in target.iterdir()] == ["new.txt"]


def test_replace_and_no_overwrite_in_both_modes(tmp_path, monkeypatch):
    for mode in ("exchange", "fallback"):
        if mode == "fallback":
            monkeypatch.setattr(io, "_renameat2", lambda source, dest, flags: False)
        target = tmp_path / mode
        for text in ("one", "two"):
            with atomic_dir(target) as tmp:
                (tmp / "file.txt").write_text(text)
            assert (target / "file.txt").read_text() == text
        with pytest.raises(FileExistsError), atomic_dir(target, overwrite=False) as tmp:
            (tmp / "file.txt").write_text("three")
        assert (target / "file.txt").read_text() == "two" and _hidden(target) == []
        # a failure inside the block leaves the old version and no temporary folder
        with pytest.raises(RuntimeError), atomic_dir(target) as tmp:
            (tmp / "file.txt").write_text("half")
            raise RuntimeError("writer failed")
        assert (target / "file.txt").read_text() == "two" and _hidden(target) == []

"""The README is a front door: small, its result tables generated from the JSON files runs wrote, its links alive."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_generated_tables_are_current():
    out = subprocess.run([sys.executable, "scripts/results_tables.py", "--check"], cwd=ROOT, check=False,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr + out.stdout


def test_readme_is_small():
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024


def test_markdown_links_point_at_files():
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "experiments").rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)}: broken link {target}"

"""The README is a front door: small, its result tables generated from the JSON files runs wrote, its links alive
(files and the anchors in them)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT


def _documents() -> list:
    """The markdown files a reader opens: the README, docs/ and every experiment's."""
    return [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "experiments").rglob("*.md")]


def test_generated_tables_are_current():
    out = subprocess.run([sys.executable, "scripts/results_tables.py", "--check"], cwd=ROOT, check=False,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr + out.stdout


def test_readme_is_small():
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024


def test_markdown_links_point_at_files():
    for doc in _documents():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)}: broken link {target}"


def _anchors(text: str) -> set[str]:
    """The anchors GitHub gives a markdown file: each heading's slug (lower case, punctuation dropped, spaces to
    hyphens, repeats numbered) outside code fences, and every explicit `<a id="...">`."""
    anchors, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6} (.*)", line)):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors | set(re.findall(r'<a id="([^"]+)"', text))


def test_markdown_anchor_links_point_at_anchors():
    for doc in _documents():
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            linked = doc.parent / target if target else doc
            if linked.suffix != ".md":
                continue  # a source file's line anchors (#L10) are GitHub's, not the file's
            assert anchor in _anchors(linked.read_text(encoding="utf-8")), \
                f"{doc.relative_to(ROOT)}: no #{anchor} in {target or doc.name}"

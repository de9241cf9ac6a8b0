"""`icrl check-text`'s search: the task folders' query texts, looked for in files about to be committed
(icrl_core/text_guard.py does the matching)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from icrl_core.errors import UserError


def dataset_texts(tasks_dir: Path) -> list[str]:
    """Every row's `text` in every task folder's JSONL files under `tasks_dir` (train, test, any other split)."""
    tasks_dir = Path(tasks_dir)
    texts = []
    for path in sorted(tasks_dir.glob("*/*.jsonl")):
        for number, raw in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            try:
                row = json.loads(raw) if raw.strip() else None
            except json.JSONDecodeError:
                raise UserError(f"{path}:{number}: not a JSON line (task folders hold JSONL)") from None
            if isinstance(row, dict) and isinstance(row.get("text"), str):
                texts.append(row["text"])
    if not texts:
        raise UserError(f"{tasks_dir}: no task folders with JSONL rows holding a text (set --tasks-dir or "
                        "data.tasks_dir)")
    return texts


def _searchable_text(path: Path) -> str:
    """A file's content as text to search: a safetensors file's JSON header only (its tensors are numbers), any
    other file whole, undecodable bytes dropped."""
    with path.open("rb") as handle:
        if path.suffix == ".safetensors":
            size = int.from_bytes(handle.read(8), "little")
            return handle.read(min(size, 100_000_000)).decode("utf-8", "ignore")
        return handle.read().decode("utf-8", "ignore")


def find_dataset_text(paths: Sequence[Path], tasks_dir: Path) -> tuple[int, list[tuple[Path, str]]]:
    """Files under `paths` (files or folders, recursively; `.git` folders skipped) that hold a dataset query
    (icrl_core.text_guard): the number of texts looked for and (file, the first text found) per file with one."""
    from icrl_core.text_guard import TextFinder

    finder = TextFinder(dataset_texts(tasks_dir))
    hits = []
    for root in paths:
        root = Path(root)
        files = [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if p.is_file() and ".git" not in p.relative_to(root).parts)
        for path in files:
            hit = finder.find(_searchable_text(path))
            if hit is not None:
                hits.append((path, hit.text))
    return finder.count, hits

"""`icrl check-text` and its matcher (icrl_core.text_guard): the datasets' query text must never enter the
repository, so a copy of it is found at any position, raw or escaped inside JSON, and the repository holds none."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import ROOT, call_cli


def test_finder_finds_every_text_at_every_offset_raw_and_json_escaped():
    from icrl_core.text_guard import MIN_CHARS, TextFinder

    texts = ['Where is the "Eiffel" tower ?', "Ca coûte combien, ce café ?", "x" * MIN_CHARS, "too short"]
    finder = TextFinder(texts)
    assert finder.count == 3  # the short one is not looked for
    for text in texts[:3]:
        for form in (text, json.dumps(text)[1:-1], json.dumps({"query": text})):
            for pad in range(7):  # every position relative to the probe stride
                data = "-" * pad + "{" + form + "} and more"
                hit = finder.find(data)
                assert hit is not None and hit.text == text, (text, form, pad)
    assert finder.find("too short, and Where is the Eiffel tower ?") is None
    assert finder.find("Where is the \"Eiffel\" tower") is None  # a prefix is not the text
    assert finder.find("") is None


def test_check_text_cli_finds_a_query_in_a_folder_and_exits_1(tmp_path, tasks_dir):
    from icrl_core.icrl_eval import query_digest

    query = next(json.loads(line)["text"] for line in (tasks_dir / "trec_coarse" / "test.jsonl").open()
                 if len(json.loads(line)["text"].strip()) >= 30)
    clean, leaky = tmp_path / "clean", tmp_path / "leaky"
    (clean / "run").mkdir(parents=True)
    (clean / "run" / "steps.jsonl").write_text(json.dumps({"step": 0, "query_sha256": query_digest(query)}) + "\n")
    (leaky / "run").mkdir(parents=True)
    (leaky / "run" / "steps.jsonl").write_text(json.dumps({"step": 0, "query": query}) + "\n")

    ok = call_cli("check-text", str(clean), "--tasks-dir", str(tasks_dir), cwd=tmp_path)
    assert ok.returncode == 0 and "0 file(s) hold one" in " ".join(ok.stdout.split()), ok.stdout + ok.stderr
    found = call_cli("check-text", str(clean), str(leaky), "--tasks-dir", str(tasks_dir), cwd=tmp_path)
    printed = " ".join(found.stdout.split())
    assert found.returncode == 1 and "1 file(s) hold one" in printed and query_digest(query) in printed
    assert query not in found.stdout + found.stderr  # the report itself can be pasted anywhere

    missing = call_cli("check-text", str(clean), "--tasks-dir", str(tmp_path / "none"), cwd=tmp_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    empty = call_cli("check-text", str(clean), "--tasks-dir", str(clean), cwd=tmp_path)
    assert empty.returncode == 2 and "no task folders" in empty.stderr


def test_the_repository_holds_no_dataset_text(tasks_dir):
    """Every tracked file (committed experiment logs, adapters' headers, test fixtures, docs)."""
    from tasks.text_check import find_dataset_text

    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    files = [ROOT / name for name in listed.stdout.decode().split("\0") if name and (ROOT / name).is_file()]
    count, hits = find_dataset_text(files, tasks_dir)
    assert count > 10_000
    assert hits == [], [str(path.relative_to(ROOT)) for path, _ in hits]

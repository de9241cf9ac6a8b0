"""experiments/icrl_stream_rl/park_evaluations.py: the parked run store keeps the runs in progress, the runs
finished since the last park and new probe caches, and nothing older that was left out."""

from __future__ import annotations

import importlib.util
import json

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("park_evaluations",
                                               ROOT / "experiments" / "icrl_stream_rl" / "park_evaluations.py")
park = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(park)


def _run(folder, key, finished=None):
    run = folder / key
    run.mkdir(parents=True)
    status = {"status": "finished", "finished": finished} if finished else {"status": "running"}
    (run / "run.json").write_text(json.dumps(status))
    (run / "steps.jsonl").write_text('{"step": 0}\n')
    return run


def test_merge_adds_what_finished_since_the_last_park_and_replaces_the_partials(tmp_path, capsys):
    staged, parked = tmp_path / "staged", tmp_path / "parked"
    _run(parked, "kept", "2026-12-01T10:00:00")
    _run(parked / "partial", "finished_since")  # was in progress at the last park
    (parked / "ability").mkdir()
    (parked / "ability" / "old.json").write_text("{}")
    _run(staged, "kept", "2026-12-01T10:00:00")
    _run(staged, "collected_long_ago", "2026-11-20T10:00:00")  # left out of the store on purpose
    _run(staged, "finished_since", "2026-12-02T09:00:00")
    _run(staged / "partial", "in_progress")
    (staged / "ability").mkdir()
    (staged / "ability" / "old.json").write_text('{"changed": true}')
    (staged / "ability" / "new.json").write_text("{}")
    (staged / "feedback-abc.json").write_text("{}")
    assert park.main([str(staged), str(parked)]) == 0
    names = sorted(p.name for p in parked.iterdir())
    assert names == ["ability", "feedback-abc.json", "finished_since", "kept", "partial"]
    assert [p.name for p in (parked / "partial").iterdir()] == ["in_progress"]
    assert (parked / "ability" / "old.json").read_text() == "{}"  # a parked file is never changed
    assert (parked / "ability" / "new.json").exists()
    out = capsys.readouterr().out
    assert "4 added" in out and "collected_long_ago" not in out
    # nothing in progress any more: partial/ leaves; a second merge adds nothing
    (staged / "partial" / "in_progress").rename(tmp_path / "gone")
    assert park.merge(staged, parked) == [] and not (parked / "partial").exists()


def test_an_empty_store_takes_every_finished_run_and_bad_arguments_exit_2(tmp_path):
    staged = tmp_path / "staged"
    _run(staged, "a", "2026-11-01T00:00:00")
    _run(staged, "b", "2026-11-02T00:00:00")
    assert park.merge(staged, tmp_path / "parked") == ["a", "b"]
    assert park.main([str(tmp_path / "missing"), str(tmp_path / "parked")]) == 2

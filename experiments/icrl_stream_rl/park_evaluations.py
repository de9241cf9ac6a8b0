"""Merge a redacted copy of the evaluation run store into the parked one (run.sh park; addendum 23).

    .venv/bin/python experiments/icrl_stream_rl/park_evaluations.py STAGED PARKED

STAGED is `icrl redact .icrl/evaluations STAGED` (no query text); PARKED is checkpoints/evaluations beside this
script. The parked store is what the next session restores, so it keeps what a later run or collection needs,
and not every run this machine ever finished (which re-added collected runs to the repository at each park):
- `partial/` (runs in progress) becomes STAGED's: a work folder that finished or was dropped since leaves;
- a finished run (KEY/run.json status finished) not parked yet is added when it finished after the newest run
  already parked (it finished since the last park, so no park has kept it); older ones were left out on purpose;
- anything else (the probe caches under ability/, feedback-*.json) is added when not parked yet.
Nothing parked is changed or removed except partial/. Prints what was added.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def finished_at(run: Path) -> str | None:
    """run.json's `finished` timestamp of a finished run folder, else None."""
    try:
        record = json.loads((run / "run.json").read_text())
    except (OSError, ValueError):
        return None
    return record.get("finished") if record.get("status") == "finished" else None


def merge(staged: Path, parked: Path) -> list[str]:
    """Merge STAGED into PARKED as the module docstring says; returns the entries added (relative names)."""
    parked.mkdir(parents=True, exist_ok=True)
    newest = max((t for run in parked.iterdir() if run.is_dir() and (t := finished_at(run))), default="")
    added = []
    shutil.rmtree(parked / "partial", ignore_errors=True)
    if (staged / "partial").is_dir() and any((staged / "partial").iterdir()):
        shutil.copytree(staged / "partial", parked / "partial")
        added += [f"partial/{work.name}" for work in sorted((staged / "partial").iterdir())]
    for entry in sorted(staged.iterdir()):
        target = parked / entry.name
        if entry.name == "partial":
            continue
        if entry.is_dir() and (when := finished_at(entry)) is not None:
            if not target.exists() and when > newest:
                shutil.copytree(entry, target)
                added.append(entry.name)
        elif entry.is_dir():
            for file in sorted(p for p in entry.rglob("*") if p.is_file()):
                dest = parked / file.relative_to(staged)
                if not dest.exists():
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(file, dest)
                    added.append(str(file.relative_to(staged)))
        elif not target.exists():
            shutil.copy2(entry, target)
            added.append(entry.name)
    return added


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or not Path(args[0]).is_dir():
        print("usage: park_evaluations.py STAGED PARKED (STAGED: a folder written by `icrl redact`)", file=sys.stderr)
        return 2
    added = merge(Path(args[0]), Path(args[1]))
    print(f"== parked evaluations: {len(added)} added" + (f" ({', '.join(added)})" if added else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

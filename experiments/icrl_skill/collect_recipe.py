"""Collect the skill recipe's end-to-end run (issue 26, Deliver 4: `make experiment` from a fresh clone) and its final
tests (experiments/icrl_stream_rl/PREREGISTERED.md, addendum 39) into results.json beside this file, under keys of
their own: the record of recipe H32 above them stays as it is.

    .venv/bin/python experiments/icrl_skill/collect_recipe.py --recipe artifacts/evaluate \
        --promote metrics/promote.json --commit 7e9e9e1 --stage-minutes bootstrap=38 --stage-minutes ppo=150
    .venv/bin/python experiments/icrl_skill/collect_recipe.py --final trec_fine=artifacts/final_tests/trec_fine

`--recipe` is the recipe's evaluate stage output (after `dvc exp apply NAME`, since a run with overrides leaves the
workspace as it was): every run's test curve, the forgetting and feedback measures, the promotion gates and the
evaluated adapters' sha256. `--final TASK=FOLDER` is one final test's evaluate output (`run.sh final-TASK`); a task
collected again replaces its entry, a task still running is collected with the runs it has finished. Exit 2 with
one message on a missing folder or a bad argument.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"
FINAL_TASKS = ("trec_fine", "trec_fine_unsemantic", "nlu", "nlu_unsemantic")
PER_RUN = ("base_", "start_", "trained_")  # metrics of one run: seed_row has them in `runs`

sys.path.insert(0, str(HERE.parent / "icrl_stream_rl"))
from collect_gate2 import seed_row  # one reading of an evaluate folder, shared with gate 2


class Usage(Exception):
    """A bad argument or a missing input: one message, exit 2."""


def evaluate_row(folder: Path) -> dict:
    """An evaluate stage's output: seed_row's runs, and the stage's other metrics (gates, forgetting and feedback
    measures, adapter sha256) when it has finished."""
    if not (folder / "runs").is_dir():
        raise Usage(f"{folder}: no runs/ folder: give the evaluate stage's output folder (evaluate.output_dir)")
    row = seed_row(folder)
    stage = folder / "metrics.json"
    metrics = json.loads(stage.read_text()) if stage.exists() else {}
    row.update({key: value for key, value in metrics.items() if not key.startswith(PER_RUN) and key != "seconds"})
    return row


def _pairs(values: list[str], what: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key or not rest:
            raise Usage(f"{what} {value!r}: expected NAME=VALUE")
        pairs[key] = rest
    return pairs


def collect(results: dict, recipe: Path | None, promote: Path | None, commit: str | None,
            stage_minutes: dict[str, float], finals: dict[str, Path]) -> dict:
    """results.json with the recipe run and/or the final tests given replaced (the rest kept as it was)."""
    if recipe is not None:
        entry = {"commit": commit, "seed": 100, **evaluate_row(recipe)}
        if promote is not None:
            if not promote.exists():
                raise Usage(f"{promote}: no such file (the promote stage writes metrics/promote.json)")
            entry["promote"] = json.loads(promote.read_text())
        if stage_minutes:
            entry["stage_minutes"] = stage_minutes
            entry["wall_minutes"] = round(sum(stage_minutes.values()), 1)
        results["recipe_rl"] = entry
    for task, folder in finals.items():
        if task not in FINAL_TASKS:
            raise Usage(f"--final {task}: the final tests are {', '.join(FINAL_TASKS)} (addendum 39)")
        results.setdefault("final_tests", {})[task] = evaluate_row(folder)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, help="the recipe run's evaluate output folder")
    parser.add_argument("--promote", type=Path, help="the recipe run's metrics/promote.json")
    parser.add_argument("--commit", help="the commit the recipe run started from")
    parser.add_argument("--stage-minutes", action="append", default=[], metavar="STAGE=MINUTES")
    parser.add_argument("--final", action="append", default=[], metavar="TASK=FOLDER")
    args = parser.parse_args(argv)
    try:
        if args.recipe is None and not args.final:
            raise Usage("nothing to collect: give --recipe FOLDER and/or --final TASK=FOLDER")
        try:
            minutes = {k: float(v) for k, v in _pairs(args.stage_minutes, "--stage-minutes").items()}
        except ValueError as exc:
            raise Usage(f"--stage-minutes: {exc}") from None
        finals = {k: Path(v) for k, v in _pairs(args.final, "--final").items()}
        for folder in [args.recipe, *finals.values()]:
            if folder is not None and not folder.is_dir():
                raise Usage(f"{folder}: no such folder")
        results = collect(json.loads(RESULTS.read_text()), args.recipe, args.promote, args.commit, minutes, finals)
    except Usage as exc:
        print(f"collect_recipe.py: {exc}", file=sys.stderr)
        return 2
    from icrl_core.io import atomic_write_text

    atomic_write_text(RESULTS, json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

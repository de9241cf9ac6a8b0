"""Collect the skill recipe's end-to-end run (issue 26, Deliver 4: `make experiment` from a fresh clone) and its final
tests (experiments/icrl_stream_rl/PREREGISTERED.md, addendum 39) into results.json beside this file, under keys of
their own: the record of recipe H32 above them stays as it is.

    .venv/bin/python experiments/icrl_skill/collect_recipe.py --recipe artifacts/evaluate \
        --promote metrics/promote.json --commit 7e9e9e1 --stage-minutes bootstrap=38 --stage-minutes ppo=150
    .venv/bin/python experiments/icrl_skill/collect_recipe.py --final trec_fine=artifacts/final_tests/trec_fine

`--recipe` is the recipe's evaluate stage output (after `dvc exp apply NAME`, since a run with overrides leaves the
workspace as it was): every run's test curve, the forgetting and feedback measures, the promotion gates and the
evaluated adapters' sha256. `--final TASK=FOLDER` is one final test's evaluate output (`run.sh final-TASK`); a task
collected again replaces its entry, a task still running is collected with the runs it has finished. A final test
leaves out the stage's promotion verdicts (`eligible`, `passes_*`: no forgetting is measured on a final test and
the gates are trec_coarse's) and gets, per strategy, the paired differences at the last test step (paired_gain.py:
RL adapter - bootstrap, bootstrap - base, RL adapter - base, on the same test queries, with their standard errors;
gold labels from the task under the runs' data.tasks_dir, relative to the working directory) and each run's
minutes. Exit 2 with one message on a missing folder or a bad argument.
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
# The evaluate stage's promotion verdicts: a final test measures no forgetting and its task is not the gate's, so
# they mean nothing there and are left out of its entry (its gains, plain differences, stay).
GATE_VERDICTS = ("eligible", "passes_")

sys.path.insert(0, str(HERE.parent / "icrl_stream_rl"))
from collect_gate2 import seed_row  # one reading of an evaluate folder, shared with gate 2
from paired_gain import pair_rows  # the paired difference of two runs on the same test queries

from icrl_core.errors import UserError

# The model pairs a final test reports (addendum 39): RL adapter - bootstrap, bootstrap - base, RL adapter - base.
MODEL_PAIRS = (("trained", "start"), ("start", "base"), ("trained", "base"))


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


def paired_rows(folder: Path) -> dict:
    """Per strategy and model pair (MODEL_PAIRS) whose two runs both wrote tests.jsonl: the paired difference at the
    last test step both reached (`first`, `second` accuracies; `only_first`/`only_second` right; its standard error)."""
    runs = folder / "runs"
    out: dict[str, dict] = {}
    for strategy in sorted({run.name.split("-", 1)[1] for run in runs.iterdir() if "-" in run.name}):
        for first, second in MODEL_PAIRS:
            pair = runs / f"{first}-{strategy}", runs / f"{second}-{strategy}"
            if not all((run / "tests.jsonl").is_file() for run in pair):
                continue
            try:
                steps = pair_rows(*pair)["steps"]
            except UserError as exc:
                raise Usage(str(exc)) from None
            if not steps:
                continue
            last = max(steps, key=int)
            d = steps[last]
            out.setdefault(strategy, {})[f"{first}-{second}"] = {
                "step": int(last), "n": d["n"], "first": d["trained"], "second": d["start"],
                "only_first": d["only_trained"], "only_second": d["only_start"], "difference": d["difference"],
                "standard_error": d["standard_error"]}
    return out


def run_minutes(folder: Path) -> dict[str, float]:
    """Each run's own compute time (its metrics.json `seconds`, summed over the sessions it ran in), in minutes."""
    minutes = {}
    for run in sorted((folder / "runs").iterdir()):
        seconds = json.loads((run / "metrics.json").read_text()).get("seconds")
        if seconds is not None:
            minutes[run.name] = round(seconds / 60, 1)
    return minutes


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
        row = {key: value for key, value in evaluate_row(folder).items() if not key.startswith(GATE_VERDICTS)}
        row.update(paired=paired_rows(folder), run_minutes=run_minutes(folder))
        results.setdefault("final_tests", {})[task] = row
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

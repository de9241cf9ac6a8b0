"""Which test queries an explorative run gets right: those whose gold label has a rewarded episode in the step's
context, or those whose label the context lacks (the diagnostic behind setting 26, addendum 44).

At a test step the harness answers every test query after one context: the step's rewarded episodes as the
explorative strategy drew them (`steps.jsonl`: the step's `context` indices into the history). For each run folder
(config.json, steps.jsonl, tests.jsonl) and each test step from --from-step on: the share of test queries whose
gold label is absent from that context, the accuracy on those and on the others, and per label the accuracy and
the context's episodes of it. Reported, not a gate.

    .venv/bin/python experiments/icrl_stream_rl/label_coverage.py RUN [RUN ...] [--from-step 499] [--output F] \
        [--record NAME]   # also into results.json under label_coverage/NAME (REPORT.md's generated table)

Gold labels come from the task the run's config names (data.tasks_dir, relative to the working directory).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from experiments.icrl_stream_rl.paired_gain import run_answers
from icrl_core.errors import UserError
from icrl_core.io import atomic_write_text, read_user_text
from icrl_core.task_data import load_task_from_dir


def coverage_row(gold: list[str], predictions: list[str], context_labels: Counter) -> dict:
    """One test step: test queries split by whether the context holds a rewarded episode of their gold label.

    absent_share = #(label not in context) / n; accuracy_absent / accuracy_present: the accuracy on each part
    (None when a part is empty); per_label[label] = [right, queries, context episodes of the label]."""
    if len(gold) != len(predictions):
        raise UserError(f"{len(predictions)} test answers for {len(gold)} test queries")
    absent = [p == g for g, p in zip(gold, predictions) if not context_labels.get(g)]
    present = [p == g for g, p in zip(gold, predictions) if context_labels.get(g)]
    per_label = {label: [sum(p == g for g, p in zip(gold, predictions) if g == label), gold.count(label),
                         context_labels.get(label, 0)] for label in sorted(set(gold))}
    return {"accuracy": sum(absent + present) / len(gold), "absent_share": len(absent) / len(gold),
            "accuracy_absent": sum(absent) / len(absent) if absent else None,
            "accuracy_present": sum(present) / len(present) if present else None,
            "right_absent": sum(absent), "absent": len(absent), "right_present": sum(present),
            "present": len(present), "per_label": per_label}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def run_rows(run: Path, from_step: int) -> dict:
    config, answers = run_answers(run)
    evaluation = config["icrl_eval"]
    task = load_task_from_dir(evaluation["task"], config["data"]["tasks_dir"])
    gold = [example.label for example in task.test_set(evaluation["test_k"], evaluation["test_seed"])]
    lines = [line for line in read_user_text(run / "steps.jsonl", "step log").splitlines() if line.strip()]
    try:
        steps = [json.loads(line) for line in lines]
        contexts = {step: Counter(steps[i]["gold"] for i in steps[step]["context"] if steps[i]["reward"])
                    for step in answers if step < len(steps)}
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise UserError(f"{run}: not an evaluate-stage run's steps.jsonl ({exc!r})") from None
    return {"seed": evaluation["seed"], "strategy": evaluation["strategy"],
            "steps": {str(step): coverage_row(gold, answers[step], contexts[step])
                      for step in sorted(contexts) if step >= from_step}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (config.json, steps.jsonl, tests.jsonl)")
    parser.add_argument("--from-step", type=int, default=499, help="the first test step reported (default 499)")
    parser.add_argument("--output", type=Path, help="also write the rows to this JSON file")
    parser.add_argument("--record", metavar="NAME", help="also record the per-step shares and the pooled counts "
                        "in results.json beside this script, under label_coverage/NAME")
    args = parser.parse_args(argv)
    try:
        rows = {str(run): run_rows(run, args.from_step) for run in args.runs}
    except UserError as exc:
        print(f"label_coverage.py: {exc}", file=sys.stderr)
        return 2
    pooled = {"absent": [0, 0], "present": [0, 0]}
    for run, row in rows.items():
        for step, cov in row["steps"].items():
            for part, counts in pooled.items():
                counts[0] += cov[f"right_{part}"]
                counts[1] += cov[part]
            print(f"{run} seed {row['seed']} step {step}: accuracy {cov['accuracy']:.3f}; label absent from the "
                  f"context {cov['absent_share']:.2f} of the queries, accuracy there {_fmt(cov['accuracy_absent'])}, "
                  f"elsewhere {_fmt(cov['accuracy_present'])}")
    summary = {part: {"right": right, "queries": total, "accuracy": right / total if total else None}
               for part, (right, total) in pooled.items()}
    print("pooled over the runs and steps: " + "; ".join(
        f"label {part}: {s['right']}/{s['queries']}" for part, s in summary.items()))
    if args.output:
        atomic_write_text(args.output, json.dumps({"runs": rows, "pooled": summary}, indent=1) + "\n")
    if args.record:
        record(args.record, rows, summary)
    return 0


def record(name: str, rows: dict, pooled: dict, results_file: Path | None = None) -> None:
    """results.json's label_coverage/NAME: per run (by seed) and test step the absent share and the accuracies
    on each part, and the pooled counts (no per-label detail: that stays in --output)."""
    results_file = results_file or Path(__file__).resolve().parent / "results.json"
    results = json.loads(results_file.read_text())
    keep = ("accuracy", "absent_share", "accuracy_absent", "accuracy_present")
    results.setdefault("label_coverage", {})[name] = {
        "runs": {str(row["seed"]): {step: {k: cov[k] for k in keep} for step, cov in row["steps"].items()}
                 for row in rows.values()},
        "pooled": pooled}
    atomic_write_text(results_file, json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())

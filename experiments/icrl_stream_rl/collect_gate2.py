"""Collect gate 2 of issue 26's pre-registered experiment (PREREGISTERED.md, "Gates") into results.json: per seed,
the evaluate stage's runs of the RL adapter (`trained`), the bootstrap it started from (`start`) and the base model
(test accuracy at every test step, train accuracy), its forgetting measures, and the pre-registered decision.

    .venv/bin/python experiments/icrl_stream_rl/collect_gate2.py --setting 12 \
        --seed 100=artifacts/evaluate_gate2_seed100 --seed 101=... --seed 102=...

A seed evaluated in parts (one strategy per part, addendum 23) is given once per part's folder:
`--seed 100=artifacts/gate2_s15/seed100-explorative --seed 100=artifacts/gate2_s15/seed100-naive`; a part given
alone for a seed already in results.json joins that seed's kept runs (a run collected again replaces its copy), so
the parts may be collected in different sessions, and a part still running is collected with the runs it finished.

Rule (fixed before the runs): for naive or for explorative, RL minus bootstrap test accuracy at step 999 is
positive on all three seeds AND its mean over them is at least 0.05. With fewer than three seeds the decision is
`pending`, unless a seed already has a difference <= 0 (then `failed`: the rule needs every seed positive).
Seeds already in results.json and not given again are kept.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from icrl_core.icrl_eval import repeat_rates

SEEDS = (100, 101, 102)
STRATEGIES = ("explorative", "naive", "zero_shot")
MIN_MEAN = 0.05


def seed_row(folder: Path) -> dict:
    """One seed's evaluate-stage output: every run's test curve and train accuracy, and the forgetting numbers
    (absent while the stage has not finished: a folder of the runs finished so far, runs/<model>-<strategy>/)."""
    stage = folder / "metrics.json"
    metrics = json.loads(stage.read_text()) if stage.exists() else {}
    runs = {}
    for run in sorted((folder / "runs").iterdir()):
        run_metrics = json.loads((run / "metrics.json").read_text())
        runs[run.name] = {"test_accuracy": {str(k): v for k, v in run_metrics["test_accuracy"].items()},
                          "train_accuracy": run_metrics.get("train_accuracy"), "regret": run_metrics.get("regret"),
                          "behaviour": stream_behaviour(run / "steps.jsonl")}
    keep = ("forgetting_base_accuracy", "forgetting_trained_accuracy", "forgetting_drop",
            "forgetting_probe_base_accuracy", "forgetting_probe_trained_accuracy", "forgetting_probe_change",
            "feedback_effect_base", "feedback_effect_trained")
    row = {"runs": runs, **{k: metrics[k] for k in keep if k in metrics}}
    if "seconds" in metrics:  # written when the stage has finished
        row["part_seconds"] = {part_name(runs): metrics["seconds"]}
    return with_seconds(row)


def part_name(runs) -> str:
    """A part by the strategies of its runs (`start-naive`, `trained-naive` -> "naive")."""
    return "+".join(sorted({name.split("-", 1)[1] for name in runs}))


def with_seconds(row: dict) -> dict:
    """`part_seconds` (the stage seconds of each part) and their sum as `seconds`; a row written before parts had
    their own seconds counts its `seconds` as one part, named by its runs."""
    parts = row.get("part_seconds") or ({part_name(row["runs"]): row["seconds"]} if "seconds" in row else {})
    out = {k: v for k, v in row.items() if k not in ("seconds", "part_seconds")}
    if parts:
        out.update(part_seconds=parts, seconds=round(sum(parts.values()), 2))
    return out


def merge_parts(first: dict, second: dict) -> dict:
    """One seed run in parts (addendum 23: one strategy per part, each in its own folder, `--seed S=A --seed S=B`,
    or parts collected in different sessions): the runs of both (the second's replacing the first's of the same
    name), each part's stage seconds (likewise) and their sum, the other measures from whichever part has them (the
    later one when both do: the forgetting measures are the same cached numbers)."""
    first, second = with_seconds(first), with_seconds(second)
    merged = {**first, **second, "runs": {**first["runs"], **second["runs"]}}
    parts = {**first.get("part_seconds", {}), **second.get("part_seconds", {})}
    if parts:
        merged.update(part_seconds=parts, seconds=round(sum(parts.values()), 2))
    return merged


def stream_behaviour(steps: Path) -> dict:
    """How a run answered its training stream (steps.jsonl): how often the next answer repeats the last one after
    a reward of 0 and after a reward of 1 (a copier repeats either way), the answers given per label, and the
    answers rewarded per gold label. Diagnostics reported beside the gate, not part of its rule."""
    rows = [json.loads(line) for line in steps.read_text().splitlines() if line.strip()]
    labels = sorted({r["gold"] for r in rows} | {r["prediction"] for r in rows})
    return {**{k: round(v or 0.0, 3) for k, v in repeat_rates(rows).items()},
            "answers": {label: sum(r["prediction"] == label for r in rows) for label in labels},
            "right_per_gold": {label: [sum(r["gold"] == label and r["reward"] > 0 for r in rows),
                                       sum(r["gold"] == label for r in rows)] for label in labels}}


def final(run: dict) -> float:
    return run["test_accuracy"][max(run["test_accuracy"], key=int)]


def rule(diffs: dict) -> tuple[float | None, str]:
    """The pre-registered rule on per-seed differences: (their mean, "passed" | "failed" | "pending")."""
    mean = round(sum(diffs.values()) / len(diffs), 4) if diffs else None
    if any(d <= 0 for d in diffs.values()):
        return mean, "failed"
    if len(diffs) < len(SEEDS):
        return mean, "pending"
    return mean, "passed" if mean >= MIN_MEAN else "failed"


def decision(seeds: dict) -> dict:
    """Per strategy: the per-seed differences RL - bootstrap at the last test step, their mean, and the rule."""
    out = {}
    for strategy in ("naive", "explorative"):
        diffs = {seed: round(final(row["runs"][f"trained-{strategy}"]) - final(row["runs"][f"start-{strategy}"]), 4)
                 for seed, row in seeds.items()
                 if f"trained-{strategy}" in row["runs"] and f"start-{strategy}" in row["runs"]}
        mean, verdict = rule(diffs)
        out[strategy] = {"differences": diffs, "mean": mean, "verdict": verdict}
    verdicts = [v["verdict"] for v in out.values()]
    out["gate2"] = "passed" if "passed" in verdicts else "pending" if "pending" in verdicts else "failed"
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", required=True, help="the setting whose adapter the runs evaluated")
    parser.add_argument("--seed", action="append", default=[], help="SEED=EVALUATE_OUTPUT_DIR")
    args = parser.parse_args()
    from collect import read_results, write_results  # beside this file; the rule above needs none of it

    results = read_results()
    gate2 = results.setdefault("gate2", {}).setdefault(args.setting, {"seeds": {}})
    given: dict[str, dict] = {}
    for item in args.seed:
        seed, folder = item.split("=", 1)
        row = seed_row(Path(folder))
        given[seed] = merge_parts(given[seed], row) if seed in given else row
    for seed, row in given.items():
        kept = gate2["seeds"].get(seed)
        gate2["seeds"][seed] = merge_parts(kept, row) if kept else row
    gate2["seeds"] = dict(sorted(gate2["seeds"].items()))
    gate2["decision"] = decision(gate2["seeds"])
    write_results(results)
    for strategy in ("naive", "explorative"):
        d = gate2["decision"][strategy]
        print(f"setting {args.setting} {strategy}: RL - bootstrap {d['differences']} mean {d['mean']} -> {d['verdict']}")
    print(f"gate 2: {gate2['decision']['gate2']}")


if __name__ == "__main__":
    main()

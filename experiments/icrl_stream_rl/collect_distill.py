"""Collect issue 29's context-distillation measurement (PREREGISTERED.md, addendum 27) into results.json
(`context_distillation`): per seed, the naive runs of the plain and the distilled student (and of the bootstrap and
the base model that came with them), each student's gate-1 probe and forgetting measures, and the decision.

    .venv/bin/python experiments/icrl_stream_rl/collect_distill.py \
        --part 100:plain=artifacts/cd_eval/seed100-plain --part 100:distill=artifacts/cd_eval/seed100-distill \
        --probe plain=runs/cd-plain/probe.json --forgetting plain=runs/cd-plain/forgetting.json \
        --run plain=artifacts/cd_plain

Rule (addendum 27, fixed before the runs): distilled minus plain naive test accuracy at step 999 is positive on all
three seeds AND its mean is at least 0.05 ("moved"). With fewer than three seeds: `pending`, unless a seed already
has a difference <= 0 (`not moved`). Parts and arms already in results.json and not given again are kept.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from collect import compute, curve, forgetting_row, probe_row, read_results, write_results
from collect_gate2 import final, rule, seed_row

ARMS = ("plain", "distill")


def decision(seeds: dict) -> dict:
    """Per seed: distilled minus plain at the last test step of the students' naive runs; their mean; the rule."""
    diffs = {seed: round(final(arms["distill"]["runs"]["trained-naive"]) - final(arms["plain"]["runs"]["trained-naive"]), 4)
             for seed, arms in seeds.items()
             if all(arm in arms and "trained-naive" in arms[arm]["runs"] for arm in ARMS)}
    mean, verdict = rule(diffs)  # gate 2's rule
    return {"differences": diffs, "mean": mean,
            "verdict": {"passed": "moved", "failed": "not moved", "pending": "pending"}[verdict]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", action="append", default=[], help="SEED:ARM=EVALUATE_OUTPUT_DIR (ARM plain|distill)")
    parser.add_argument("--probe", action="append", default=[], help="ARM=PROBE_JSON (the student's gate-1 probe)")
    parser.add_argument("--forgetting", action="append", default=[], help="ARM=ABILITY_JSON (forgetting.py)")
    parser.add_argument("--run", action="append", default=[],
                        help="ARM=RUN_DIR (the student's ppo output: its validation streams and training wall time)")
    args = parser.parse_args()
    results = read_results()
    measured = results.setdefault("context_distillation", {"seeds": {}, "students": {}})
    for item in args.part:
        key, folder = item.split("=", 1)
        seed, arm = key.split(":", 1)
        if arm not in ARMS:
            raise SystemExit(f"--part {item}: the arm must be one of {ARMS}")
        measured["seeds"].setdefault(seed, {})[arm] = seed_row(Path(folder))
    def training(run_dir: Path) -> dict:
        return {"run": str(run_dir), "validation_training_tasks": curve(run_dir), "compute": compute(run_dir)}

    for option, reader, key in ((args.probe, probe_row, "probe"), (args.forgetting, forgetting_row, "forgetting"),
                                (args.run, training, "training")):
        for item in option:
            arm, path = item.split("=", 1)
            measured["students"].setdefault(arm, {})[key] = reader(Path(path))
    measured["seeds"] = dict(sorted(measured["seeds"].items()))
    measured["decision"] = decision(measured["seeds"])
    write_results(results)
    d = measured["decision"]
    print(f"context distillation: distilled - plain {d['differences']} mean {d['mean']} -> {d['verdict']}")


if __name__ == "__main__":
    main()

"""How far a gate's RL-minus-bootstrap test gain stands above test noise: the paired difference of two
evaluate-stage runs on the same test queries (issue 26's gates measure both adapters on one seed's 200 queries).

At each test step, for the RL adapter's run (`trained-STRATEGY`) and the bootstrap's (`start-STRATEGY`) of one
evaluate-stage output folder: both accuracies, b = queries only the RL adapter answered right, c = queries only the
bootstrap did, the difference (b - c) / n and its paired standard error sqrt(b + c - (b - c)^2 / n) / n. Reported,
not a gate: it is the test-query noise of one seed's step-999 number, not the spread between seeds.

    .venv/bin/python experiments/icrl_stream_rl/paired_gain.py artifacts/gate_explorative_s22 \
        artifacts/gate_explorative_s22_seed8 [--strategy explorative] [--output paired.json]
    .venv/bin/python experiments/icrl_stream_rl/paired_gain.py --pair TRAINED_RUN START_RUN  # two run folders,
        # e.g. the parked run store's experiments/icrl_stream_rl/checkpoints/evaluations/<key>

Gold labels come from the task the run's config names (data.tasks_dir, relative to the working directory).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from icrl_core.errors import UserError
from icrl_core.io import atomic_write_text, read_user_text
from icrl_core.task_data import load_task_from_dir


def paired_difference(right_trained: list[int], right_start: list[int]) -> dict:
    """Paired difference of two runs' per-query correctness (0/1, the same n queries in the same order).

    b = #(trained right, start wrong), c = #(start right, trained wrong);
    difference = (b - c) / n;  standard error = sqrt(b + c - (b - c)^2 / n) / n
    (the standard error of the mean of the n per-query differences, each in {-1, 0, 1}, with divisor n).
    """
    if len(right_trained) != len(right_start) or not right_trained:
        raise UserError(f"the two runs answered {len(right_trained)} and {len(right_start)} test queries: "
                        "a paired difference needs the same queries")
    n = len(right_trained)
    b = sum(1 for t, s in zip(right_trained, right_start) if t and not s)
    c = sum(1 for t, s in zip(right_trained, right_start) if s and not t)
    return {"n": n, "trained": sum(right_trained) / n, "start": sum(right_start) / n, "only_trained": b,
            "only_start": c, "difference": (b - c) / n, "standard_error": math.sqrt(b + c - (b - c) ** 2 / n) / n}


def run_answers(run: Path) -> tuple[dict, dict[int, list[str]]]:
    """A run folder's icrl_eval config and its test predictions by test step."""
    for name in ("config.json", "tests.jsonl"):
        if not (run / name).is_file():
            raise UserError(f"{run}: no {name} (an evaluate-stage run folder, runs/<model>-<strategy>/, holds it)")
    lines = [line for line in read_user_text(run / "tests.jsonl", "test log").splitlines() if line.strip()]
    try:
        config = json.loads(read_user_text(run / "config.json", "run config"))
        config = {"icrl_eval": config["icrl_eval"], "data": {"tasks_dir": config["data"]["tasks_dir"]}}
        answers = {int(test["step"]): test["predictions"] for test in map(json.loads, lines)}
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{run}: not an evaluate-stage run's config.json and tests.jsonl ({exc!r})") from None
    return config, answers


def pair_rows(trained_run: Path, start_run: Path) -> dict:
    """Two run folders (RL adapter, bootstrap): the seed and, per test step both reached, the paired difference."""
    trained_config, trained = run_answers(trained_run)
    start_config, start = run_answers(start_run)
    evaluation = trained_config["icrl_eval"]
    same = ("task", "seed", "test_k", "test_seed", "strategy")
    if any(evaluation[key] != start_config["icrl_eval"][key] for key in same):
        raise UserError(f"{trained_run} and {start_run} differ in one of {', '.join(same)}: not a paired "
                        "measurement")
    task = load_task_from_dir(evaluation["task"], trained_config["data"]["tasks_dir"])
    gold = [example.label for example in task.test_set(evaluation["test_k"], evaluation["test_seed"])]
    steps = {}
    for step in sorted(set(trained) & set(start)):
        steps[str(step)] = paired_difference([int(p == g) for p, g in zip(trained[step], gold)],
                                             [int(p == g) for p, g in zip(start[step], gold)])
    return {"seed": evaluation["seed"], "strategy": evaluation["strategy"], "steps": steps}


def folder_rows(folder: Path, strategy: str) -> dict:
    """One evaluate-stage output folder: its RL adapter's and bootstrap's runs in `strategy`, paired."""
    return pair_rows(folder / "runs" / f"trained-{strategy}", folder / "runs" / f"start-{strategy}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, help="evaluate-stage output folders (each holds runs/)")
    parser.add_argument("--pair", nargs=2, type=Path, action="append", default=[], metavar=("TRAINED", "START"),
                        help="two run folders (each holds config.json and tests.jsonl) to pair; repeatable")
    parser.add_argument("--strategy", default="explorative", help="the runs' strategy (default explorative)")
    parser.add_argument("--output", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    try:
        if not args.folders and not args.pair:
            raise UserError("name at least one evaluate-stage output folder or one --pair TRAINED START")
        rows = {str(folder): folder_rows(folder, args.strategy) for folder in args.folders}
        rows.update({f"{trained} vs {start}": pair_rows(trained, start) for trained, start in args.pair})
    except UserError as exc:
        print(f"paired_gain.py: {exc}", file=sys.stderr)
        return 2
    for folder, row in rows.items():
        for step, pair in row["steps"].items():
            print(f"{folder} seed {row['seed']} step {step}: RL {pair['trained']:.3f} bootstrap {pair['start']:.3f} "
                  f"difference {pair['difference']:+.3f} +- {pair['standard_error']:.3f} "
                  f"(only RL right {pair['only_trained']}, only bootstrap {pair['only_start']})")
    if args.output:
        atomic_write_text(args.output, json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Collect gate E of setting 15 (PREREGISTERED.md, addendum 19) into results.json: the evaluate stage's explorative
runs at the development seed (`gate_explorative.yaml`) of the RL adapter (`trained`) and the bootstrap it started
from (`start`), their stream behaviour, and the pre-registered decision.

    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 15 --folder artifacts/gate_explorative

Rule (fixed before the runs): passes if the RL adapter's training-stream reward over the run (`train_accuracy`) is
at least the bootstrap's + 0.03 AND its test accuracy at the last test step is at least the bootstrap's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from collect import read_results, write_results
from collect_gate2 import final, seed_row

MIN_TRAIN_GAIN = 0.03


def decision(runs: dict) -> dict:
    """The two numbers of the rule and the verdict ('pending' until both runs are in)."""
    trained, start = runs.get("trained-explorative"), runs.get("start-explorative")
    if trained is None or start is None:
        return {"verdict": "pending"}
    train_gain = round(trained["train_accuracy"] - start["train_accuracy"], 4)
    test_gain = round(final(trained) - final(start), 4)
    passed = train_gain >= MIN_TRAIN_GAIN - 1e-9 and test_gain >= -1e-9
    return {"train_gain": train_gain, "test_gain": test_gain, "verdict": "passed" if passed else "failed"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", required=True, help="the setting whose adapter the runs evaluated")
    parser.add_argument("--folder", type=Path, required=True, help="the evaluate stage's output folder")
    args = parser.parse_args()
    results = read_results()
    row = seed_row(args.folder)
    config = json.loads(next((args.folder / "runs").glob("*-explorative/config.json")).read_text())
    seed = config["icrl_eval"]["seed"]
    results.setdefault("gate_e", {})[args.setting] = {"seed": seed, **row, "decision": decision(row["runs"])}
    write_results(results)
    d = results["gate_e"][args.setting]["decision"]
    print(f"setting {args.setting} gate E (seed {seed}): {d}")


if __name__ == "__main__":
    main()

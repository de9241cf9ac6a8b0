"""Collect the critic's second run (PREREGISTERED.md) into results_run2.json beside this file.

    python experiments/critic/collect.py --workspace /work/exp-critic --commit 6fdc6fb

Reads the workspace's artifacts/{critic_data,critic,critic_distill,critic_rft}/metrics.json and the wall times
that runs/*.log recorded (`<stage> wall <seconds> s`), and applies the pre-registered decisions."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workspace", type=Path, required=True)
    parser.add_argument("--commit", required=True)
    args = parser.parse_args()
    art = args.workspace / "artifacts"

    def metrics(name: str) -> dict:
        return json.loads((art / name / "metrics.json").read_text())

    logs = "\n".join(path.read_text() for path in sorted((args.workspace / "runs").glob("*.log")))
    walls = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+) wall ([\d.]+) s$", logs, re.MULTILINE)}
    data, critic = metrics("critic_data"), metrics("critic")
    reverse_kl, rft = metrics("critic_distill"), metrics("critic_rft")
    decisions = {
        "auc_goal_met": critic["val_auc"] >= 0.7,
        "auc_goal_established": critic["val_auc_low"] >= 0.7,
        "q_weighted_beats_plain": critic["q_minus_plain_low"] > 0,
        "reverse_kl_raises_reward": reverse_kl["val_reward"] > reverse_kl["val_reward_before"],
        "reverse_kl_vs_rft": reverse_kl["val_reward"] - rft["val_reward"],
        "best_of_n_beats_random": critic["best_of_n_reward"] > critic["random_of_n_reward"],
    }
    commit = subprocess.check_output(["git", "rev-parse", args.commit], cwd=HERE, text=True).strip()
    results = {
        "task": "keyword_map feedback episodes (data.num_episodes 800), the answer to each episode's first query",
        "model": "smollm2-135m float32; reference = the base model; critic = LoRA + 8 joint-bin tokens",
        "settings": "experiments/critic/run2.yaml on params.yaml (PREREGISTERED.md)",
        "commit": commit, "seed": 0, "threads": 1,
        "machine_load": "beside another one-thread experiment (the 2 cores both busy)",
        "critic_data": data | {"wall_seconds": walls.get("critic_data")},
        "critic": critic | {"wall_seconds": walls.get("critic")},
        "reverse_kl": reverse_kl | {"wall_seconds": walls.get("critic_distill")},
        "rft": rft | {"wall_seconds": walls.get("rft")},
        "decisions": decisions,
    }
    (HERE / "results_run2.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(decisions, indent=2))


if __name__ == "__main__":
    main()

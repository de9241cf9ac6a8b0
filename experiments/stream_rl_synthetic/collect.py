"""Collect the pre-registered runs (run.sh) into results.json beside this file and print the decision table.

    .venv/bin/python experiments/stream_rl_synthetic/collect.py [--out runs/stream_rl_synthetic]

Per run: the validation mean reward at iteration 0 (before any update) and after the last iteration, the other
validation statistics at both, the wall time; per objective, the pre-registered decision (final - initial > 0 on
at least 2 of 3 seeds and positive on average)."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
KEYS = ("val_reward", "val_reward_first_half", "val_reward_second_half", "val_switch_after_wrong")


def tensor_digest(path: Path) -> str:
    """sha256 over the adapter's tensors (names sorted, raw bytes): the same for any file layout of them."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("runs/stream_rl_synthetic"))
    args = parser.parse_args()
    runs, decisions = [], {}
    dpo_runs = []
    for run_dir in sorted(args.out.glob("dpo-[0-9]")):
        if not (run_dir / "metrics.json").exists():
            continue
        metrics = json.loads((run_dir / "metrics.json").read_text())
        wall = json.loads((run_dir / "wall.json").read_text())["wall_seconds"] if (run_dir / "wall.json").exists() \
            else None
        before, after = metrics["val_preference_accuracy_before"], metrics["val_preference_accuracy"]
        dpo_runs.append({"seed": int(run_dir.name.rsplit("-", 1)[1]), "val_preference_accuracy_before": before,
                         "val_preference_accuracy_after": after, "change": after - before,
                         "val_margin": metrics.get("val_margin"), "wall_seconds": wall})
    if dpo_runs:
        changes = [r["change"] for r in dpo_runs]
        decisions["dpo"] = {"seeds": len(changes), "positive_seeds": sum(c > 0 for c in changes),
                            "mean_change": sum(changes) / len(changes),
                            "raises_val_preference_accuracy": len(changes) == 3
                            and sum(c > 0 for c in changes) >= 2 and sum(changes) > 0}
    for run_dir in sorted(args.out.glob("*-[0-9]")):
        kind, seed = run_dir.name.rsplit("-", 1)
        if kind == "dpo" or not (run_dir / "evals.json").exists():
            continue
        evals = json.loads((run_dir / "evals.json").read_text())
        evals = evals if isinstance(evals, list) else evals.get("evals", evals)
        first, last = evals[0], evals[-1]
        wall = json.loads((run_dir / "wall.json").read_text())["wall_seconds"] if (run_dir / "wall.json").exists() \
            else None
        runs.append({"objective": kind, "seed": int(seed), "initial_step": first["step"], "final_step": last["step"],
                     **{f"initial_{k}": first.get(k) for k in KEYS}, **{f"final_{k}": last.get(k) for k in KEYS},
                     "change": last["val_reward"] - first["val_reward"], "wall_seconds": wall})
    for kind in sorted({r["objective"] for r in runs}):  # the stream objectives
        changes = [r["change"] for r in runs if r["objective"] == kind]
        decisions[kind] = {"seeds": len(changes), "positive_seeds": sum(c > 0 for c in changes),
                           "mean_change": sum(changes) / len(changes),
                           "raises_mean_stream_reward": len(changes) == 3 and sum(c > 0 for c in changes) >= 2
                           and sum(changes) > 0}
    bootstrap = args.out / "bootstrap" / "adapter" / "adapter_model.safetensors"
    result = {"preregistration": "PREREGISTERED.md", "runs": runs, "dpo_runs": dpo_runs, "decisions": decisions,
              "bootstrap_adapter_tensor_sha256": tensor_digest(bootstrap) if bootstrap.exists() else None}
    (HERE / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print("| objective | seed | val reward before | after | change | switch after wrong before -> after | wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['objective']} | {r['seed']} | {r['initial_val_reward']:.3f} | {r['final_val_reward']:.3f} | "
              f"{r['change']:+.3f} | {r['initial_val_switch_after_wrong']:.2f} -> "
              f"{r['final_val_switch_after_wrong']:.2f} | {r['wall_seconds']} |")
    print(json.dumps(decisions, indent=1))


if __name__ == "__main__":
    main()

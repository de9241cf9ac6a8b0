"""Collect the pre-registered runs (run.sh) into results.json beside this file and print the decision table.

    .venv/bin/python experiments/code_rl/collect.py [--out runs/code_rl]

Per evaluated model (base, grpo-<seed>, dpo-<seed>): pass@k per level and overall, greedy and sampled; per
training run: the in-stage greedy pass@1 at each evaluation, the first and last 3 iterations' means of every
reward component, the pass rate, the KL and (DPO) the pairs per step; every command's wall seconds; the
pre-registered decision (both pass@1 above the base model's by more than 0.06)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
MARGIN = 0.06
WINDOW = 3


def read(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def evaluation(out: Path, name: str) -> dict | None:
    found = {}
    for decoding in ("greedy", "sampled"):
        result = read(out / f"eval-{name}-{decoding}.json")
        if result is None:
            return None
        wall = read(out / f"eval-{name}-{decoding}.wall.json") or {}
        found[decoding] = {"overall": result["overall"], "levels": result["levels"], "samples": result["samples"],
                           "temperature": result["temperature"], "tasks": result["tasks"],
                           "isolation": result["isolation"], "wall_seconds": wall.get("wall_seconds")}
    return found


def window_means(history: list[dict], keys: list[str]) -> dict:
    def mean(rows, key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    first, last = history[:WINDOW], history[-WINDOW:]
    return {key: {"first_3": mean(first, key), "last_3": mean(last, key)} for key in keys}


def training(out: Path, name: str) -> dict | None:
    run = out / name
    history = read(run / "history.json")
    if history is None:
        return None
    evals = read(run / "evals.json")
    if evals is None:  # the dpo stage keeps its evaluations in history.json
        evals = [{k: v for k, v in h.items() if k.startswith("val_") or k == "step"} for h in history
                 if h.get("val_accuracy") is not None]
        evals = [{"step": 0, **{k: v for k, v in (read(run / "metrics.json") or {}).items()
                                if k == "val_accuracy_before"}}] + evals
    keys = sorted({k for h in history for k in h if k.startswith("reward/")}) + [
        k for k in ("mean_reward", "task_accuracy", "groups_with_signal", "kl", "code_pairs", "loss", "accuracy")
        if any(k in h for h in history)]
    wall = read(out / f"{name}.wall.json") or {}
    return {"iterations": len(history), "evals": evals, "components": window_means(history, keys),
            "per_iteration": [{k: h.get(k) for k in ["step", *keys]} for h in history],
            "wall_seconds": wall.get("wall_seconds"), "metrics": read(run / "metrics.json")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("runs/code_rl"))
    args = parser.parse_args()
    seeds = sorted({p.name.rsplit("-", 1)[1] for p in args.out.glob("grpo-*") if p.is_dir()})
    results: dict = {"evaluations": {}, "trainings": {}, "decisions": {}}
    base = evaluation(args.out, "base")
    results["evaluations"]["base"] = base
    print(f"{'model':<10} {'greedy pass@1':>14} {'sampled pass@1':>15} {'pass@2':>7} {'pass@4':>7}  decision")
    for name in ["base"] + [f"{kind}-{seed}" for seed in seeds for kind in ("grpo", "dpo")]:
        found = base if name == "base" else evaluation(args.out, name)
        if name != "base":
            results["evaluations"][name] = found
            results["trainings"][name] = training(args.out, name)
        if found is None:
            continue
        greedy, sampled = found["greedy"]["overall"], found["sampled"]["overall"]
        decision = ""
        if name != "base" and base is not None:
            diff_greedy = greedy["pass_at_1"] - base["greedy"]["overall"]["pass_at_1"]
            diff_sampled = sampled["pass_at_1"] - base["sampled"]["overall"]["pass_at_1"]
            improves = diff_greedy > MARGIN and diff_sampled > MARGIN
            results["decisions"][name] = {"greedy_pass_at_1_minus_base": diff_greedy,
                                          "sampled_pass_at_1_minus_base": diff_sampled,
                                          "improves_held_out_pass_at_1": improves}
            decision = f"{diff_greedy:+.3f} / {diff_sampled:+.3f}: {'improves' if improves else 'not shown'}"
        print(f"{name:<10} {greedy['pass_at_1']:>14.3f} {sampled['pass_at_1']:>15.3f} {sampled['pass_at_2']:>7.3f} "
              f"{sampled['pass_at_4']:>7.3f}  {decision}")
    (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {HERE / 'results.json'}")


if __name__ == "__main__":
    main()

"""Collect the pre-registered trec_coarse runs into results.json beside this file (gate 1 per setting).

    .venv/bin/python experiments/icrl_stream_rl/collect.py \
        --bootstrap-probe runs/gate1/probe-boot.json \
        --setting 1=artifacts/ppo:runs/gate1/probe-rl.json \
        --setting 2=artifacts/ppo_distill:runs/gate1-s2/probe-rl.json \
        --setting 4=artifacts/dpo_hindsight:runs/gate1-s4/probe-rl.json \
        --describe 4="dpo stage (artifacts/dpo_hindsight), DPO on hindsight couples" \
        --lineage 12="after setting 10b's 20, opaque labels renamed per stream, fresh draws"
    .venv/bin/python experiments/icrl_stream_rl/collect.py \
        --ablation ppo=artifacts/ablation_ppo:runs/ablation-ppo/probe.json     (addendum 15's objective ablation)

A setting's run folder is a ppo stage output (evals.json) or a dpo stage output (metrics.json with the
validation numbers before and after; setting 4: DPO on hindsight couples, with their couple accuracy).

Per setting: the feedback probe of its RL adapter (p(target) per context), the training run's validation stream
statistics on the training tasks at iteration 0 and after the last one, and the gate-1 decision
(p(target | 1 wrong) at least 0.2 below p(target | 1 right)); the bootstrap adapter's probe beside them.
A setting already in results.json and not given again is kept."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"
sys.path.insert(0, str(HERE.parents[1]))  # the project's root: icrl_core.io (standard library only)

from icrl_core.io import atomic_write_text


def read_results() -> dict:
    """results.json beside this file (the collectors' shared record)."""
    return json.loads(RESULTS.read_text())


def write_results(results: dict) -> None:
    """results.json, written atomically (a collector stopped mid-write leaves the old file)."""
    atomic_write_text(RESULTS, json.dumps(results, indent=2) + "\n")


GATE_MARGIN = 0.2
# setting -> the least n=1 feedback effect of the probe check that decided it in place of gate 1 (check P, addenda
# 47, 50, 51): its row records `check_p` and no gate-1 verdict, so one number is not read against two thresholds;
# run.sh's probe_check stops a setting below it
CHECK_P = {"29": 0.10, "30": 0.10, "31": 0.10}
# Check C (addendum 55): the closure probe's absent recall - false alarm at least this, per setting.
CHECK_C = {"34": 0.05, "35": 0.05}
CONTEXTS = ("n0", "n1_wrong", "n1_right", "n4_wrong", "n4_right")


def probe_row(path: Path) -> dict:
    probe = json.loads(path.read_text())
    row = {c: round(probe["conditions"][c]["p_target"], 4) for c in CONTEXTS}
    return {"target": probe["target"], "task": probe["task"], "queries": probe["queries"], "seed": probe["seed"],
            "dtype": probe["dtype"], "p_target": row, "p_gold": {c: round(probe["conditions"][c]["p_gold"], 4)
                                                                    for c in CONTEXTS},
            # the one-attempt effect's paired bootstrap interval over queries (probes run from 2026-11-26 14:45 on)
            **({"gap_ci95": [round(x, 4) for x in probe["feedback_effect_ci95"]["1"]]}
               if "feedback_effect_ci95" in probe else {}),
            # p(gold | 1 marked wrong) - p(gold | no context) and its paired interval (probes from 2026-11-27 on)
            **({"gold_after_wrong": round(probe["gold_after_wrong"]["1"], 4),
                "gold_after_wrong_ci95": [round(x, 4) for x in probe["gold_after_wrong_ci95"]["1"]]}
               if "gold_after_wrong" in probe else {})}


def validation(run_dir: Path) -> tuple[int, dict]:
    """(iterations, {key: [at iteration 0, after the last]}) of the run's validation streams of the training
    tasks: a ppo run's evals.json, or a dpo run's metrics.json (`<key>_before` and `<key>`)."""
    metrics = json.loads((run_dir / "metrics.json").read_text())
    if (run_dir / "evals.json").exists():
        evals = json.loads((run_dir / "evals.json").read_text())
        first, last = evals[0], evals[-1]
        return metrics["iterations"], {key: [first[key], last[key]] for key in ("val_reward",
                                                                                 "val_switch_after_wrong")}
    pairs = {"val_reward": "val_stream_reward", "val_switch_after_wrong": "val_switch_after_wrong",
             "val_hindsight_accuracy": "val_hindsight_accuracy", "val_couple_accuracy": "val_couple_accuracy"}
    if "val_hindsight_margin" in metrics:  # logged from setting 6 on: beta m (contrast) or beta h (dpo) per pair
        pairs["val_hindsight_margin"] = "val_hindsight_margin"
    return metrics["step"], {key: [metrics[f"{name}_before"], metrics[name]] for key, name in pairs.items()}


def setting_row(run_dir: Path, probe: Path, description: str | None = None, loss: str | None = None,
                check_p: float | None = None) -> dict:
    """A setting's probe and validation; its verdict is gate 1's (`gate1_passed`, the n=1 effect >= GATE_MARGIN)
    or, with `check_p`, the probe check's (`check_p`: the effect >= check_p)."""
    iterations, values = validation(run_dir)
    if loss in ("rank", "rank_contrast") and "val_hindsight_margin" in values:
        # the rank loss logs beta x the margin per pair; a couple's contrast m is the sum of its two pairs' margins
        values["val_hindsight_margin"] = [2 * x for x in values["val_hindsight_margin"]]
    row = probe_row(probe)
    gap = row["p_target"]["n1_right"] - row["p_target"]["n1_wrong"]
    verdict = ({"gate1_passed": gap >= GATE_MARGIN} if check_p is None
               else {"check_p": {"least_effect": check_p, "passed": gap >= check_p}})
    return {"run": description or str(run_dir), "iterations": iterations, "validation_training_tasks": values,
            "probe": row, "gate1_gap": round(gap, 4), **verdict, **({"hindsight_loss": loss} if loss else {})}


def verdict(row: dict) -> str:
    """A setting's or arm's probe verdict: `check P (>= +0.10) failed` or `gate 1 passed`."""
    if "check_p" in row:
        return f"check P (>= {row['check_p']['least_effect']:+.2f}) {'passed' if row['check_p']['passed'] else 'failed'}"
    return f"gate 1 {'passed' if row['gate1_passed'] else 'failed'}"


def curve(run_dir: Path) -> list[dict]:
    """The validation streams of the training tasks at every evaluation of the run (iteration 0 and every
    eval_steps): a ppo run's evals.json, or the rows of a dpo run's history.json that carry them with the values
    before training from its metrics.json."""
    keep = ("val_reward", "val_switch_after_wrong")
    if (run_dir / "evals.json").exists():
        return [{"iteration": e["step"], **{k: round(e[k], 4) for k in keep}}
                for e in json.loads((run_dir / "evals.json").read_text())]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    rows = [{"iteration": 0, "val_reward": round(metrics["val_stream_reward_before"], 4),
             "val_switch_after_wrong": round(metrics["val_switch_after_wrong_before"], 4)}]
    return rows + [{"iteration": h["step"], "val_reward": round(h["val_stream_reward"], 4),
                    "val_switch_after_wrong": round(h["val_switch_after_wrong"], 4)}
                   for h in json.loads((run_dir / "history.json").read_text()) if h.get("val_stream_reward") is not None]


def compute(run_dir: Path) -> dict:
    """The run's compute from its per-iteration history (which survives a resume, unlike the process's own
    seconds): forward tokens of the updates, and wall time of the iterations (ppo: rollout + update seconds;
    dpo: each step's seconds, logged from commit 4367837 on). None where the history does not carry them."""
    history = json.loads((run_dir / "history.json").read_text())

    def total(key: str) -> float | None:
        return round(sum(h[key] for h in history), 1) if all(key in h for h in history) else None

    seconds = total("step_seconds")
    if seconds is None and all("rollout_seconds" in h and "update_seconds" in h for h in history):
        seconds = round(sum(h["rollout_seconds"] + h["update_seconds"] for h in history), 1)
    return {"iterations": len(history), "update_tokens": total("tokens"), "loop_seconds": seconds}


def ablation_row(run_dir: Path, probe: Path) -> dict:
    """One arm of the objective ablation (PREREGISTERED.md, addendum 15): gate 1 as for a setting, the validation
    curve at every evaluation, and the arm's compute."""
    row = probe_row(probe)
    measured = json.loads(probe.read_text())
    if "feedback_effect_ci95" in measured:  # the four-attempt effect's interval too (addendum 15 reports both)
        row["gap4_ci95"] = [round(x, 4) for x in measured["feedback_effect_ci95"]["4"]]
    gap = row["p_target"]["n1_right"] - row["p_target"]["n1_wrong"]
    return {"run": str(run_dir), "probe": row, "gate1_gap": round(gap, 4), "gate1_passed": gap >= GATE_MARGIN,
            "validation_training_tasks": curve(run_dir), "compute": compute(run_dir)}


def forgetting_row(path: Path) -> dict:
    """The forgetting measures of an adapter from a JSON of `tasks.evaluate.general_ability` for the base model and
    the adapter (`{"seconds", "base", "trained"}`): the 1509-item probe (gate 3) and the greedy check (addendum 14's
    `max_forgetting`), each as a paired change with its interval and McNemar p."""
    from icrl_core.general_ability import paired_change

    measured = json.loads(path.read_text())
    base, trained = measured["base"], measured["trained"]

    def paired(base_correct: list, trained_correct: list, base_accuracy: float, trained_accuracy: float) -> dict:
        change = paired_change(base_correct, trained_correct)
        return {"base": round(base_accuracy, 4), "trained": round(trained_accuracy, 4),
                "change": round(change.change, 4), "ci95": [round(change.ci95_low, 4), round(change.ci95_high, 4)],
                "became_correct": change.became_correct, "became_wrong": change.became_wrong,
                "mcnemar_p": float(f"{change.mcnemar_p:.2g}")}

    return {"measured_with": f"tasks.evaluate.general_ability ({path.name})",
            "probe_1509_items": paired(base["probe"]["correct"], trained["probe"]["correct"],
                                       base["probe"]["accuracy"], trained["probe"]["accuracy"]),
            "greedy_197_questions": paired([a["correct"] for a in base["greedy"]["answers"]],
                                           [a["correct"] for a in trained["greedy"]["answers"]],
                                           base["greedy"]["accuracy"], trained["greedy"]["accuracy"]),
            "wall": f"{measured['seconds']} s for both models"}


def closure_row(run_dir: Path, check_dir: Path) -> dict:
    """A setting decided by check C (addendum 55): its training (validation streams of the training tasks at
    every evaluation, the trained steps' gold-absent and discovery rates, compute), every adapter the check's
    closure probe measured (closure.json) and the verdict (check.json, written by run.sh's closure_check)."""
    history = json.loads((run_dir / "history.json").read_text())
    evals = json.loads((run_dir / "evals.json").read_text())
    probed = json.loads((check_dir / "closure.json").read_text())
    check = json.loads((check_dir / "check.json").read_text())
    return {"run": str(run_dir),
            "validation_training_tasks": [{"iteration": e["step"], "val_reward": round(e["val_reward"], 4),
                                           "val_gold_absent_rate": round(e["val_gold_absent_rate"], 4),
                                           "val_novel_rate": round(e["val_novel_rate"], 4)} for e in evals],
            "trained_steps": {key: round(sum(h[key] for h in history) / len(history), 4)
                              for key in ("gold_absent_rate", "novel_rate", "mean_reward")},
            "compute": compute(run_dir),
            "closure_probe": {name: {key: round(row[key], 4) if isinstance(row[key], float) else row[key]
                                     for key in ("adapter", "absent_recall", "present_recall", "false_alarm",
                                                 "queries", "episodes", "seed", "task")}
                              for name, row in probed.items()},
            "check_c": {"rule": check["rule"], "margin": round(check["margin"], 4), "passed": check["passed"]}}


def setting_order(name: str) -> tuple[int, str]:
    """'2' < '10a': settings sort by their number, then their letter."""
    digits = name.rstrip("abcdefghijklmnopqrstuvwxyz")
    return int(digits), name[len(digits):]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap-probe", type=Path)
    parser.add_argument("--setting", action="append", default=[], help="NAME=RUN_DIR:PROBE_JSON")
    parser.add_argument("--describe", action="append", default=[],
                        help="NAME=TEXT: what the setting's run was (results.json `run`; default: RUN_DIR)")
    parser.add_argument("--lineage", action="append", default=[],
                        help="NAME=TEXT: what the run continued, for the gate table (\"after setting 9's 20, ...\")")
    parser.add_argument("--hindsight-loss", action="append", default=[],
                        help="NAME=KIND: the setting's dpo.hindsight_loss (rank: its margin is logged per pair)")
    parser.add_argument("--forgetting", action="append", default=[],
                        help="NAME=ABILITY_JSON: the base model's and the adapter's general_ability measurements "
                             "(forgetting.py writes it)")
    parser.add_argument("--ablation", action="append", default=[],
                        help="ARM=RUN_DIR:PROBE_JSON: an arm of the objective ablation (addendum 15)")
    parser.add_argument("--training-task-probe", action="append", default=[],
                        help="NAME=PROBE_JSON: the feedback probe on a training task (banking77, addendum 47) of "
                             "a setting's adapter, or of the bootstrap's (NAME bootstrap)")
    parser.add_argument("--closure-check", action="append", default=[],
                        help="NAME=RUN_DIR:CHECK_DIR: a setting decided by check C (addendum 55): its ppo output "
                             "and the folder of its closure.json and check.json")
    args = parser.parse_args()
    results = read_results() if RESULTS.exists() else {"gate1_margin": GATE_MARGIN, "settings": {}}
    if args.bootstrap_probe:
        results["bootstrap_probe"] = probe_row(args.bootstrap_probe)
    descriptions = dict(item.split("=", 1) for item in args.describe)
    losses = dict(item.split("=", 1) for item in args.hindsight_loss)
    for item in args.setting:
        name, paths = item.split("=", 1)
        run_dir, probe = paths.split(":", 1)
        # keys added by hand (wall, intermediate validations) survive a re-collect
        kept = {key: value for key, value in results["settings"].get(name, {}).items()
                if key not in ("gate1_passed", "check_p")}  # the verdict is the new row's alone
        results["settings"][name] = {**kept, **setting_row(Path(run_dir), Path(probe), descriptions.get(name),
                                                           losses.get(name), CHECK_P.get(name))}
    for item in args.lineage:
        name, text = item.split("=", 1)
        results["settings"][name]["lineage"] = text
    for item in args.forgetting:
        name, path = item.split("=", 1)
        results["settings"][name]["forgetting"] = forgetting_row(Path(path))
    for item in args.training_task_probe:
        name, path = item.split("=", 1)
        row = probe_row(Path(path))
        row["gap"] = round(row["p_target"]["n1_right"] - row["p_target"]["n1_wrong"], 4)
        if name == "bootstrap":
            results["bootstrap_probe_training_task"] = row
        else:
            results["settings"][name]["probe_training_task"] = row
    for item in args.closure_check:
        name, paths = item.split("=", 1)
        run_dir, check_dir = paths.split(":", 1)
        results.setdefault("closure_checks", {})[name] = closure_row(Path(run_dir), Path(check_dir))
    for item in args.ablation:
        arm, paths = item.split("=", 1)
        run_dir, probe = paths.split(":", 1)
        results.setdefault("ablation", {})[arm] = ablation_row(Path(run_dir), Path(probe))
    if "ablation" in results:  # the pre-registered order of the arms
        order = ("ppo", "grpo", "rloo", "dpo_rank")
        results["ablation"] = dict(sorted(results["ablation"].items(), key=lambda item: order.index(item[0])))
    results["settings"] = dict(sorted(results["settings"].items(), key=lambda item: setting_order(item[0])))
    write_results(results)
    for name, s in results["settings"].items():
        print(f"setting {name}: gap {s['gate1_gap']:+.3f} -> {verdict(s)}")
    for name, c in results.get("closure_checks", {}).items():
        print(f"setting {name}: closure margin {c['check_c']['margin']:+.3f} -> "
              f"check C {'passed' if c['check_c']['passed'] else 'failed'}")
    for arm, a in results.get("ablation", {}).items():
        print(f"ablation {arm}: gap {a['gate1_gap']:+.3f} -> {verdict(a)}")


if __name__ == "__main__":
    main()

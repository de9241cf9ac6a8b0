"""Addendum 48's check L48 and addendum 49's L49 (PREREGISTERED.md): can the stream RL teach reading the verdict
where it is the only signal? Reads the ppo stage's evals.json and writes the decision:

    .venv/bin/python experiments/icrl_stream_rl/check_learnability.py \
        artifacts/feedback_learnability/evals.json runs/l48/check.json

and records a finished check in results.json (its decision, the training streams per block of 10 iterations, both
probes of its adapter, wall time; a check without training, L51, by `--record-ceiling L51 runs/l51`):

    .venv/bin/python experiments/icrl_stream_rl/check_learnability.py --record L48 \
        artifacts/feedback_learnability runs/l48

Passed when, at the last pre-registered iteration (60), the validation streams' switch rate after a wrong answer
minus their switch rate after a right answer is at least +0.30 and their reward at least iteration 0's + 0.10.
Check L50 (addendum 53) draws a stream's queries independently, where switching after "wrong" earns nothing: its
rule is the reward gain alone (RULES, keyed by the check's runs folder name)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project's root: icrl_core.io (standard library)

from icrl_core.io import atomic_write_text

ITERATIONS = 60
SWITCH_CONTRAST = 0.30
REWARD_GAIN = 0.10
# check (its runs folder) -> (least switch contrast or None: not a term, least reward gain) at iteration 60
RULES = {"l48": (SWITCH_CONTRAST, REWARD_GAIN), "l49": (SWITCH_CONTRAST, REWARD_GAIN), "l50": (None, REWARD_GAIN)}


def decision(evals: list[dict], switch_contrast: float | None = SWITCH_CONTRAST,
             reward_gain: float = REWARD_GAIN) -> dict:
    """A learnability check's verdict from a run's validation records (one per evaluation, `step` = iteration): pending
    until iteration 60 is there. Passed when the reward gain over iteration 0 is at least `reward_gain` and, unless
    `switch_contrast` is None, switch after wrong - switch after right at least `switch_contrast`."""
    by_step = {e["step"]: e for e in evals}
    halves = ("val_reward_first_half", "val_reward_second_half")  # the streams' first and second half of steps
    curve = [{"iteration": e["step"], "val_reward": round(e["val_reward"], 4),
              "switch_after_wrong": round(e["val_switch_after_wrong"], 4),
              "switch_after_right": round(e["val_switch_after_right"], 4),
              **({key[4:]: round(e[key], 4) for key in halves} if all(k in e for k in halves) else {})}
             for e in evals]
    if 0 not in by_step or ITERATIONS not in by_step:
        return {"verdict": "pending", "curve": curve}
    first, last = by_step[0], by_step[ITERATIONS]
    # rounded: a rate difference exactly at the threshold must not fail on a float's last bit
    contrast = round(last["val_switch_after_wrong"] - last["val_switch_after_right"], 9)
    gain = round(last["val_reward"] - first["val_reward"], 9)
    passed = gain >= reward_gain and (switch_contrast is None or contrast >= switch_contrast)
    rule = f"reward gain >= +{reward_gain} at iteration {ITERATIONS}"
    if switch_contrast is not None:
        rule = f"switch contrast >= +{switch_contrast} and " + rule
    return {"verdict": "passed" if passed else "failed", "switch_contrast": round(contrast, 4),
            "reward_gain": round(gain, 4), "rule": rule, "curve": curve}


def check_decision(name: str, evals: list[dict]) -> dict:
    """The verdict of check `name` (l48, l49, l50) by its own pre-registered rule."""
    return decision(evals, *RULES[name.lower()])


def training_blocks(history: list[dict], size: int = 10) -> list[dict]:
    """The training streams' reward, switch rates, KL and answer entropy averaged per block of `size` iterations
    (an iteration without a wrong or right answer has no switch rate: NaN, left out), and the redrawn groups."""

    def mean(rows: list[dict], key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None and not math.isnan(r[key])]
        return round(sum(values) / len(values), 4) if values else None

    return [{"iterations": [rows[0]["step"], rows[-1]["step"]],
             **{key: mean(rows, key) for key in ("mean_reward", "switch_after_wrong", "switch_after_right", "kl",
                                                 "entropy")},
             "redrawn_groups": int(sum(r["redrawn_groups"] for r in rows)),
             "uniform_groups": int(sum(r["uniform_groups"] for r in rows))}
            for rows in (history[i:i + size] for i in range(0, len(history), size))]


# checks decided by class_verdict_ceiling.py's probe (runs/CHECK/ceiling.json), not by the validation streams
CEILING_DECIDED = {"l52", "l54", "l56"}  # L54, L56 (addenda 60, 61): settings 37's and 38's checks (runs/s37, s38)
# checks whose six-label probe (ceiling-six.json) decides, the 2-label one (ceiling.json) reported when it ran
SIX_DECIDED = {"l55", "l56"}


def probe_files(name: str, runs: Path) -> tuple[dict, dict]:
    """The check's deciding probe (ceiling.json, or ceiling-six.json for SIX_DECIDED) and the reported other one,
    as {"ceiling_six": ...} or {"ceiling_two": ...} ({} when it did not run)."""
    six = name.lower() in SIX_DECIDED
    deciding, other = ("ceiling-six.json", "ceiling.json") if six else ("ceiling.json", "ceiling-six.json")
    reported = {("ceiling_two" if six else "ceiling_six"): json.loads((runs / other).read_text())} \
        if (runs / other).exists() else {}
    return json.loads((runs / deciding).read_text()), reported


def record_ceiling(name: str, runs: Path) -> None:
    """results.json's `learnability[name]` for a check without training (L51, L53, L55): its deciding probe file
    and decision, and the other probe (2 or 6 labels) when the check has one."""
    from collect import read_results, write_results

    ceiling, reported = probe_files(name, runs)
    results = read_results()
    results.setdefault("learnability", {})[name] = {"check": ceiling["decision"], "ceiling": ceiling, **reported}
    write_results(results)
    print(f"recorded {name}: {ceiling['decision'].get('verdict', ceiling['decision'].get('outcome'))}")


def record(name: str, run_dir: Path, runs: Path) -> None:
    """results.json's `learnability[name]`: the check, its training record, its compute (collect.compute) and its
    adapter's two probes (collect.probe_row, with the probe's own feedback effects). A check in CEILING_DECIDED
    takes its decision from its ceiling probe and keeps the validation curve beside it."""
    from collect import compute, probe_row, read_results, write_results

    probes = {}
    for key, file in (("trec_coarse", "probe.json"), ("banking77", "probe-banking77.json")):
        effect = json.loads((runs / file).read_text())["feedback_effect"]
        probes[key] = {**probe_row(runs / file), "effect": {n: round(v, 4) for n, v in effect.items()}}
    evals = json.loads((run_dir / "evals.json").read_text())
    if name.lower() in CEILING_DECIDED:
        ceiling, reported = probe_files(name, runs)
        check = {**ceiling["decision"], "curve": decision(evals, None)["curve"]}
        extra = {"ceiling": ceiling, **reported}
    else:
        check, extra = check_decision(name, evals), {}
    results = read_results()
    results.setdefault("learnability", {})[name] = {
        "run": str(run_dir), "check": check,
        "training_blocks": training_blocks(json.loads((run_dir / "history.json").read_text())), "probes": probes,
        "compute": compute(run_dir), **extra}
    write_results(results)
    print(f"recorded {name}: {results['learnability'][name]['check']['verdict']}")


def main() -> None:
    if sys.argv[1] == "--record":
        record(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]))
        return
    if sys.argv[1] == "--record-ceiling":
        record_ceiling(sys.argv[2], Path(sys.argv[3]))
        return
    evals, output = Path(sys.argv[1]), Path(sys.argv[2])
    if output.parent.name.lower() not in RULES:
        print(f"check_learnability.py: {output} is not in a check's runs folder ({', '.join(RULES)})", file=sys.stderr)
        sys.exit(2)
    result = check_decision(output.parent.name, json.loads(evals.read_text()))
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, json.dumps(result, indent=2) + "\n")
    numbers = (f" (switch contrast {result['switch_contrast']:+.3f}, reward gain {result['reward_gain']:+.3f})"
               if "reward_gain" in result else "")
    print(f"== check {output.parent.name.upper()}: {result['verdict']}{numbers}")


if __name__ == "__main__":
    main()

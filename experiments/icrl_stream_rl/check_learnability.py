"""Addendum 48's check L48 and addendum 49's L49 (PREREGISTERED.md): can the stream RL teach reading the verdict
where it is the only signal? Reads the ppo stage's evals.json and writes the decision:

    .venv/bin/python experiments/icrl_stream_rl/check_learnability.py \
        artifacts/feedback_learnability/evals.json runs/l48/check.json

Passed when, at the last pre-registered iteration (60), the validation streams' switch rate after a wrong answer
minus their switch rate after a right answer is at least +0.30 and their reward at least iteration 0's + 0.10."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project's root: icrl_core.io (standard library)

from icrl_core.io import atomic_write_text

ITERATIONS = 60
SWITCH_CONTRAST = 0.30
REWARD_GAIN = 0.10


def decision(evals: list[dict]) -> dict:
    """The L48 verdict from a run's validation records (one per evaluation, `step` = iteration): pending until
    iteration 60 is there."""
    by_step = {e["step"]: e for e in evals}
    curve = [{"iteration": e["step"], "val_reward": round(e["val_reward"], 4),
              "switch_after_wrong": round(e["val_switch_after_wrong"], 4),
              "switch_after_right": round(e["val_switch_after_right"], 4)} for e in evals]
    if 0 not in by_step or ITERATIONS not in by_step:
        return {"verdict": "pending", "curve": curve}
    first, last = by_step[0], by_step[ITERATIONS]
    # rounded: a rate difference exactly at the threshold must not fail on a float's last bit
    contrast = round(last["val_switch_after_wrong"] - last["val_switch_after_right"], 9)
    gain = round(last["val_reward"] - first["val_reward"], 9)
    passed = contrast >= SWITCH_CONTRAST and gain >= REWARD_GAIN
    return {"verdict": "passed" if passed else "failed", "switch_contrast": round(contrast, 4),
            "reward_gain": round(gain, 4), "rule": f"switch contrast >= +{SWITCH_CONTRAST} and reward gain >= "
                                                   f"+{REWARD_GAIN} at iteration {ITERATIONS}", "curve": curve}


def main() -> None:
    evals, output = Path(sys.argv[1]), Path(sys.argv[2])
    result = decision(json.loads(evals.read_text()))
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, json.dumps(result, indent=2) + "\n")
    print(f"== check {output.parent.name.upper()}: {result['verdict']}" + (f" (switch contrast {result['switch_contrast']:+.3f}, reward gain "
                                                   f"{result['reward_gain']:+.3f})" if "reward_gain" in result else ""))


if __name__ == "__main__":
    main()

"""Collect a development gate (PREREGISTERED.md) into results.json: the evaluate stage's runs, in the strategy
the setting's gate measures (explorative; naive for gate N18), at the development seed of the RL adapter
(`trained`) and the bootstrap it started from (`start`), their stream behaviour, and the pre-registered decision
of that setting's rule.

    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 15 --folder artifacts/gate_explorative
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 16 --folder artifacts/gate_explorative_s16
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 17 --folder artifacts/gate_explorative_s17
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 18 --folder artifacts/gate_naive_s18
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 19 --folder artifacts/gate_explorative_s19
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 20 --folder artifacts/gate_explorative_s20
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 21 --folder artifacts/gate_explorative_s21 \
        --folder artifacts/gate_explorative_s21_seed8
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 22 --folder artifacts/gate_explorative_s22 \
        --folder artifacts/gate_explorative_s22_seed8
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 23 --folder artifacts/gate_explorative_s23 \
        --folder artifacts/gate_explorative_s23_seed8
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 24 --folder artifacts/gate_explorative_s24 \
        --folder artifacts/gate_explorative_s24_seed8
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 25 --folder artifacts/gate_explorative_s25 \
        --folder artifacts/gate_explorative_s25_seed8
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 16 --folder artifacts/gate_explorative_s16_seed8
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 26 --folder artifacts/gate_explorative_s26 \
        --folder artifacts/gate_explorative_s26_seed8
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 29 --folder artifacts/gate_naive_s29 \
        --folder artifacts/gate_naive_s29_seed8
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 32 --folder artifacts/gate_naive_s32 \
        --folder artifacts/gate_naive_s32_seed8
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 36 --folder artifacts/gate_naive_s36 \
        --folder artifacts/gate_naive_s36_seed8
    .venv/bin/python experiments/icrl_stream_rl/collect_gate_e.py --setting 27 --start \
        --folder artifacts/gate_explorative_s27_start --folder artifacts/gate_explorative_s27_start_seed8

A run at a seed that is not its setting's development seed is stored as SETTING@SEED; one outside the setting's
rule (setting 16 at seed 8, addendum 36) is reported, not decided.

Rules (each fixed before its runs):
- setting 15 (addendum 19, `gate_explorative.yaml`, 500 steps): passes if the RL adapter's training-stream reward
  over the run (`train_accuracy`) is at least the bootstrap's + 0.03 AND its test accuracy at the last test step is
  at least the bootstrap's.
- setting 16 (addendum 29, gate E16, `gate_explorative_long.yaml`, 1000 steps): passes if the RL adapter's test
  accuracy at the last test step (999) is at least the bootstrap's + 0.05.
- setting 17 (addendum 31, gate E17, `gate_explorative_s17.yaml`, 1000 steps): passes if the RL adapter's test
  accuracy at step 999 is at least the bootstrap's + 0.125 (setting 16's +0.095 on the same seed, plus 0.03).
- setting 18 (addendum 32, gate N18, `gate_naive_s18.yaml`, 1000 steps, naive): passes if the RL adapter's naive
  test accuracy at step 999 is at least the bootstrap's + 0.10.
- setting 19 (addendum 33, gate E19, `gate_explorative_s19.yaml`, 1000 steps, explorative): passes if the RL
  adapter's test accuracy at step 999 is at least the bootstrap's + 0.10 (setting 16 gave +0.095 there).
- setting 20 (addendum 35, gate E20, `gate_explorative_s20.yaml`, 1000 steps, explorative): the same rule as
  setting 19's, + 0.10 at step 999.
- setting 21 (addendum 36, gate E21, `gate_explorative_s21.yaml`, 1000 steps, explorative, development seeds 7 and
  8): passes if the RL adapter's test accuracy at step 999 minus the bootstrap's is positive on both seeds and at
  least + 0.075 on their mean.
- setting 22 (addendum 38, gate E22, `gate_explorative_s22.yaml`): gate E21's rule, seeds 7 and 8.
- setting 23 (addendum 40, gate E23, `gate_explorative_s23.yaml`): gate E21's rule, seeds 7 and 8.
- setting 24 (addendum 41, gate E24, `gate_explorative_s24.yaml`): gate E21's rule, seeds 7 and 8.
- setting 25 (addendum 42, gate E25, `gate_explorative_s25.yaml`): gate E21's rule, seeds 7 and 8.
- setting 26 (addendum 44, gate E26, `gate_explorative_s26.yaml`, seeds 7 and 8): each seed's gain is the RL
  adapter's test accuracy minus the bootstrap's averaged over the test steps 499-999 (499, 749, 999); passes if it
  is positive on both seeds and at least + 0.08 on their mean (setting 16: +0.080 and +0.072, mean +0.076).
- setting 27 (addendum 45, gate E27, `gate_explorative_s27.yaml`, seeds 7 and 8, against the 25-step bootstrap it
  started from): gate E26's rule, and the RL adapter's own test accuracy averaged over test steps 499-999 and the
  two seeds at least 0.400 (the H32 bootstrap's 0.420 less 2 points: a weaker start must not make a weaker recipe).
  Its start's runs (`--start`: the 25-step bootstrap as the runs' `trained` adapter, the H32 bootstrap as their
  `start`) decide first whether it is trained at all: not if the 25-step bootstrap's own test accuracy averaged over
  test steps 499-999 and seeds 7, 8 is at least 0.390 (its start would not be weaker).
- setting 28 (addendum 46, gate E28): gate E26's rule against the H32 bootstrap.
- setting 29 (addendum 47, gate N29, `gate_naive_s29.yaml`, naive, seeds 7 and 8): each seed's gain is the RL
  adapter's naive test accuracy minus the H32 bootstrap's averaged over test steps 499-999; passes if positive on
  both seeds and at least +0.10 on their mean. It runs only after check P29 (run.sh) passed.
- setting 30 (addendum 50, gate N30, `gate_naive_s30.yaml`): gate N29's rule, after check P30 passed.
- setting 31 (addendum 51, gate N31, `gate_naive_s31.yaml`): gate N29's rule, after check P31 passed.
- setting 32 (addendum 52, gate N32, `gate_naive_s32.yaml`): gate N29's rule on check L49's adapter as it is.
- setting 33 (addendum 53, gate N33, `gate_naive_s33.yaml`): gate N29's rule on check L50's adapter as it is.
- settings 32 and 33 (addendum 54): a rule pass whose trained runs collapse (on any seed, repeat after at least 95%
  of the wrong answers) is "passed by the rule, collapsed" and does not go to gate 2.
- setting 36 (addendum 59, gate N36, `gate_naive_s36.yaml`): gate N29's rule and addendum 54's collapse rule on
  check L52's adapter as it is.
- setting 37 (addendum 60, gate N37, `gate_naive_s37.yaml`): the same rules on setting 37's adapter, after its check
  L54 passed.
- setting 38 (addendum 61, gate N38, `gate_naive_s38.yaml`): the same rules on setting 38's adapter (branch "six
  gap" after its check L56 passed, or branch "six carries").
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

# setting -> (least training-stream reward gain, least test-accuracy gain at the last test step); None: not a term
RULES = {"15": (0.03, 0.0), "16": (None, 0.05), "17": (None, 0.125), "18": (None, 0.10), "19": (None, 0.10),
         "20": (None, 0.10), "21": (None, 0.075), "22": (None, 0.075),
         "23": (None, 0.075), "24": (None, 0.075),
         "25": (None, 0.075), "26": (None, 0.08), "27": (None, 0.08),
         "28": (None, 0.08), "29": (None, 0.10), "30": (None, 0.10),
         "31": (None, 0.10), "32": (None, 0.10), "33": (None, 0.10), "36": (None, 0.10),
         "37": (None, 0.10), "38": (None, 0.10)}
# setting -> the strategy its development gate measures (explorative unless named)
STRATEGY = {"18": "naive", "29": "naive", "30": "naive", "31": "naive", "32": "naive",
            "33": "naive", "36": "naive", "37": "naive", "38": "naive"}
# setting -> its development seeds (7 unless named); with more than one, RULES' test gain is a bound on their mean
# and every seed's gain must be positive
SEEDS = {"21": (7, 8), "22": (7, 8), "23": (7, 8), "24": (7, 8), "25": (7, 8), "26": (7, 8), "27": (7, 8),
         "28": (7, 8), "29": (7, 8), "30": (7, 8), "31": (7, 8),
         "32": (7, 8), "33": (7, 8), "36": (7, 8), "37": (7, 8), "38": (7, 8)}
# setting -> (first, last) test step: its test gain is the mean gain over the test steps first..last both runs
# measured (the late steps, where one context draw moves the number less), not the last step's alone
LATE = {"26": (499, 999), "27": (499, 999), "28": (499, 999), "29": (499, 999), "30": (499, 999), "31": (499, 999),
        "32": (499, 999), "33": (499, 999), "36": (499, 999), "37": (499, 999), "38": (499, 999)}
# settings whose gate does not send a collapsed adapter to gate 2 (addendum 54): if on any seed the trained run
# repeats its last answer after at least COLLAPSE of its wrong answers, a rule pass is "passed by the rule, collapsed"
NO_COLLAPSE = {"32", "33", "36", "37", "38"}
COLLAPSE = 0.95
# setting -> the least test accuracy of the RL adapter itself, averaged over LATE's test steps and the seeds: for a
# setting that starts from a weaker bootstrap than H32, so beating its start cannot come from starting lower
LEAST_LEVEL = {"27": 0.400}
# setting -> the start's own late accuracy (LATE's steps, averaged over the seeds) at or above which the setting is
# not trained: a setting that starts from a weaker bootstrap, whose start turned out not to be weaker
START_STOP = {"27": 0.390}


def gate_strategy(setting: str) -> str:
    return STRATEGY.get(setting, "explorative")


def gains(runs: dict, strategy: str, late: tuple[int, int] | None = None) -> tuple[float, float] | None:
    """(training-stream reward gain, test-accuracy gain) of the RL adapter over the bootstrap in `strategy`: the
    gain at the last test step, or with `late` = (first, last) the mean gain over the test steps first..last both
    runs measured (`late_gain`); None until both runs are in."""
    trained, start = runs.get(f"trained-{strategy}"), runs.get(f"start-{strategy}")
    if trained is None or start is None:
        return None
    test_gain = final(trained) - final(start) if late is None else late_gain(trained, start, *late)
    return (round(trained["train_accuracy"] - start["train_accuracy"], 4), round(test_gain, 4))


def late_steps(first: int, last: int, *runs: dict) -> list[str]:
    """The test steps in [first, last] every run measured; ValueError if one stopped before test step `last`."""
    steps = [s for s in runs[0]["test_accuracy"] if first <= int(s) <= last
             and all(s in run["test_accuracy"] for run in runs)]
    if str(last) not in steps:
        raise ValueError(f"a run stopped before test step {last}: the late mean needs steps {first}-{last}")
    return steps


def late_gain(trained: dict, start: dict, first: int, last: int) -> float:
    """mean over the test steps s in [first, last] both runs measured of acc_trained(s) - acc_start(s)."""
    steps = late_steps(first, last, trained, start)
    return sum(trained["test_accuracy"][s] - start["test_accuracy"][s] for s in steps) / len(steps)


def late_level(run: dict, first: int, last: int) -> float:
    """mean over the test steps s in [first, last] of the run's test accuracy acc(s)."""
    steps = late_steps(first, last, run)
    return sum(run["test_accuracy"][s] for s in steps) / len(steps)


def seed_levels(runs_by_seed: dict[int, dict], setting: str) -> dict[str, float] | None:
    """Each development seed's `trained` run's late_level over LATE's test steps; None until every seed's is in."""
    levels = {}
    for seed in gate_seeds(setting):
        run = runs_by_seed.get(seed, {}).get(f"trained-{gate_strategy(setting)}")
        if run is None:
            return None
        levels[str(seed)] = round(late_level(run, *LATE[setting]), 4)
    return levels


def decision(runs: dict, setting: str = "15") -> dict:
    """The numbers of `setting`'s rule (RULES) and the verdict ('pending' until both runs are in)."""
    min_train_gain, min_test_gain = RULES[setting]
    measured = gains(runs, gate_strategy(setting))
    if measured is None:
        return {"verdict": "pending"}
    train_gain, test_gain = measured
    passed = test_gain >= min_test_gain - 1e-9 and (min_train_gain is None or train_gain >= min_train_gain - 1e-9)
    return {"train_gain": train_gain, "test_gain": test_gain, "min_test_gain": min_test_gain,
            "verdict": "passed" if passed else "failed"}


def gate_seeds(setting: str) -> tuple[int, ...]:
    return SEEDS.get(setting, (7,))


def entry_key(setting: str, seed: int) -> str:
    """Where results.json keeps a setting's run at `seed`: the setting at its first development seed, else
    SETTING@SEED."""
    return setting if seed == gate_seeds(setting)[0] else f"{setting}@{seed}"


def seeds_decision(runs_by_seed: dict[int, dict], setting: str) -> dict:
    """A rule over several development seeds (SEEDS): each seed's test gain positive, their mean at least RULES'
    bound; 'pending' until every seed's runs are in, unless a seed already in has a gain that is not positive (the
    rule has failed whatever the others give: 'failed', with the seeds still out listed as `not_run`)."""
    _, min_mean_gain = RULES[setting]
    test_gains, missing = {}, []
    for seed in gate_seeds(setting):
        measured = gains(runs_by_seed.get(seed, {}), gate_strategy(setting), LATE.get(setting))
        if measured is None:
            missing.append(seed)
        else:
            test_gains[str(seed)] = measured[1]
    if missing:
        if any(g <= 0 for g in test_gains.values()):
            return {"test_gains": test_gains, "not_run": missing, "min_test_gain": min_mean_gain,
                    "rule": rule_text(setting), "verdict": "failed"}
        return {"verdict": "pending", "rule": rule_text(setting)}
    mean = round(sum(test_gains.values()) / len(test_gains), 4)
    passed = mean >= min_mean_gain - 1e-9 and all(g > 0 for g in test_gains.values())
    level = {}
    if setting in LEAST_LEVEL:
        levels = seed_levels(runs_by_seed, setting)
        mean_level = round(sum(levels.values()) / len(levels), 4)
        level = {"levels": levels, "level": mean_level, "min_level": LEAST_LEVEL[setting]}
        passed = passed and mean_level >= LEAST_LEVEL[setting] - 1e-9
    collapse, verdict = {}, "passed" if passed else "failed"
    if setting in NO_COLLAPSE:
        strategy = gate_strategy(setting)
        repeats = {str(seed): runs_by_seed[seed][f"trained-{strategy}"].get("behaviour", {}).get("repeat_after_wrong")
                   for seed in gate_seeds(setting)}
        collapsed = [seed for seed, repeat in repeats.items() if repeat is not None and repeat >= COLLAPSE - 1e-9]
        collapse = {"repeat_after_wrong": repeats, "collapsed_seeds": collapsed}
        if passed and collapsed:
            verdict = "passed by the rule, collapsed: not sent to gate 2"
    return {"test_gains": test_gains, "test_gain": mean, "min_test_gain": min_mean_gain, **level, **collapse,
            "rule": rule_text(setting), "verdict": verdict}


def start_decision(runs_by_seed: dict[int, dict], setting: str) -> dict:
    """A setting's start runs (START_STOP): its start's own test accuracy averaged over LATE's test steps and the
    development seeds; 'stop' (the setting is not trained) at or above START_STOP's bound, 'train' below it,
    'pending' until every seed's run is in."""
    bound = START_STOP[setting]
    seeds = ", ".join(str(s) for s in gate_seeds(setting))
    rule = ("the start's own mean test accuracy over test steps {}-{} and seeds {} >= {:.3f}: not trained"
            .format(*LATE[setting], seeds, bound))
    levels = seed_levels(runs_by_seed, setting)
    if levels is None:
        return {"verdict": "pending", "rule": rule}
    level = round(sum(levels.values()) / len(levels), 4)
    return {"levels": levels, "level": level, "max_level": bound, "rule": rule,
            "verdict": "stop: not trained" if level >= bound - 1e-9 else "train"}


def rule_text(setting: str) -> str:
    seeds = ", ".join(str(s) for s in gate_seeds(setting))
    what = "test gain" if setting not in LATE else "test gain over test steps {}-{}".format(*LATE[setting])
    level = (f"; the adapter's own mean accuracy there >= {LEAST_LEVEL[setting]:.3f}"
             if setting in LEAST_LEVEL else "")
    return f"mean {what} over seeds {seeds} >= +{RULES[setting][1]:.3f}, each > 0{level}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", required=True, choices=sorted(RULES, key=int),
                        help="the setting whose adapter the runs evaluated (its pre-registered rule)")
    parser.add_argument("--folder", type=Path, required=True, action="append",
                        help="the evaluate stage's output folder (once per seed)")
    parser.add_argument("--start", action="store_true",
                        help="the folders hold the setting's start runs (START_STOP), its start as `trained`")
    args = parser.parse_args()
    if args.start and args.setting not in START_STOP:
        parser.error(f"--start: setting {args.setting} has no start runs (settings: {', '.join(START_STOP)})")
    results = read_results()
    gates = results.setdefault("gate_e", {})
    strategy = gate_strategy(args.setting)
    name = f"{args.setting}-start" if args.start else args.setting
    for folder in args.folder:
        row = seed_row(folder)
        config = json.loads(next((folder / "runs").glob(f"*-{strategy}/config.json")).read_text())
        seed = config["icrl_eval"]["seed"]
        key = entry_key(args.setting, seed).replace(args.setting, name, 1)
        gates[key] = {"seed": seed, "strategy": strategy, **row}
    seeds = gate_seeds(args.setting)
    own = {key: gate for key, gate in gates.items() if key.split("@")[0] == name}
    if args.start:
        decided = start_decision({g["seed"]: g["runs"] for g in own.values()}, args.setting)
        for gate in own.values():
            gate["decision"] = decided
            print(f"setting {args.setting}'s start (seed {gate['seed']}): {decided}")
        write_results(results)
        return
    several = seeds_decision({g["seed"]: g["runs"] for g in own.values()}, args.setting) if len(seeds) > 1 else None
    for gate in own.values():
        if gate["seed"] not in seeds:  # beside another setting's gate, not this setting's rule
            measured = gains(gate["runs"], strategy, LATE.get(args.setting))
            gate["decision"] = {"verdict": "reported, not a rule"}
            if measured is not None:
                gate["decision"]["train_gain"], gate["decision"]["test_gain"] = measured
        else:
            gate["decision"] = several or decision(gate["runs"], args.setting)
        print(f"setting {args.setting} gate E (seed {gate['seed']}): {gate['decision']}")
    write_results(results)


if __name__ == "__main__":
    main()

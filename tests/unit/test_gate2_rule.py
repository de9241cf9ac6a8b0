"""Issue 26's pre-registered gate-2 rule (experiments/icrl_stream_rl/collect_gate2.py): for naive or explorative,
RL minus bootstrap at the last test step positive on all three seeds and a mean of at least 0.05."""

from __future__ import annotations

import importlib.util

import pytest

from tests.conftest import ROOT

_spec = importlib.util.spec_from_file_location("collect_gate2",
                                               ROOT / "experiments" / "icrl_stream_rl" / "collect_gate2.py")
collect_gate2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(collect_gate2)


def _seeds(differences: dict[str, tuple[float, float]]) -> dict:
    """seed -> (RL - bootstrap on explorative, on naive), as the runs of one evaluate-stage output."""
    def runs(explorative: float, naive: float) -> dict:
        curve = lambda value: {"test_accuracy": {"0": 0.2, "999": value}}
        return {"trained-explorative": curve(0.4 + explorative), "start-explorative": curve(0.4),
                "trained-naive": curve(0.2 + naive), "start-naive": curve(0.2)}
    return {seed: {"runs": runs(*pair)} for seed, pair in differences.items()}


def test_every_seed_positive_and_a_mean_of_five_points_passes():
    out = collect_gate2.decision(_seeds({"100": (0.06, 0.0), "101": (0.05, 0.01), "102": (0.07, -0.02)}))
    assert out["explorative"]["verdict"] == "passed" and out["explorative"]["mean"] == 0.06
    assert out["naive"]["verdict"] == "failed" and out["gate2"] == "passed"  # one strategy is enough


def test_a_small_mean_fails_and_missing_seeds_are_pending_unless_one_is_not_positive():
    assert collect_gate2.decision(_seeds({"100": (0.02, 0.01), "101": (0.03, 0.02),
                                          "102": (0.04, 0.03)}))["gate2"] == "failed"
    pending = collect_gate2.decision(_seeds({"100": (0.10, 0.10)}))
    assert pending["explorative"]["verdict"] == pending["gate2"] == "pending"
    early = collect_gate2.decision(_seeds({"100": (0.0, -0.05)}))  # zero is not positive
    assert early["explorative"]["verdict"] == early["naive"]["verdict"] == early["gate2"] == "failed"


def test_stream_behaviour_separates_a_copier_from_a_reader(tmp_path):
    """A copier repeats its last answer whatever the reward; a reader changes it after a 0 and keeps it after a 1."""
    import json

    def steps(rows):
        path = tmp_path / "steps.jsonl"
        path.write_text("".join(json.dumps({"gold": g, "prediction": p, "reward": int(g == p)}) + "\n" for g, p in rows))
        return collect_gate2.stream_behaviour(path)

    copier = steps([("a", "a"), ("b", "a"), ("b", "a"), ("a", "a")])
    assert copier["repeat_after_wrong"] == copier["repeat_after_right"] == 1.0
    assert copier["answers"] == {"a": 4, "b": 0} and copier["right_per_gold"] == {"a": [2, 2], "b": [0, 2]}
    reader = steps([("b", "a"), ("b", "b"), ("b", "b"), ("a", "b"), ("a", "a")])
    assert reader["repeat_after_wrong"] == 0.0 and reader["repeat_after_right"] == 1.0


def test_gate_e_needs_three_points_of_stream_reward_and_no_loss_of_test_accuracy():
    """Setting 15's gate E (collect_gate_e.py, addendum 19) on the development seed."""
    import sys

    sys.path.insert(0, str(ROOT / "experiments" / "icrl_stream_rl"))
    spec = importlib.util.spec_from_file_location("collect_gate_e",
                                                  ROOT / "experiments" / "icrl_stream_rl" / "collect_gate_e.py")
    gate_e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gate_e)

    def runs(train: float, test: float) -> dict:
        return {"trained-explorative": {"train_accuracy": 0.30 + train, "test_accuracy": {"0": 0.2, "499": 0.4 + test}},
                "start-explorative": {"train_accuracy": 0.30, "test_accuracy": {"0": 0.2, "499": 0.4}}}

    assert gate_e.decision(runs(0.03, 0.0))["verdict"] == "passed"
    assert gate_e.decision(runs(0.05, -0.005))["verdict"] == "failed"
    assert gate_e.decision(runs(0.029, 0.10))["verdict"] == "failed"
    assert gate_e.decision({"start-explorative": runs(0, 0)["start-explorative"]})["verdict"] == "pending"

    # setting 16's gate E16 (addendum 29): five points of test accuracy at the last step, the stream reward not a term
    assert gate_e.decision(runs(-0.05, 0.05), "16")["verdict"] == "passed"
    assert gate_e.decision(runs(0.10, 0.049), "16")["verdict"] == "failed"
    # setting 17's gate E17 (addendum 31): setting 16's +0.095 on the same seed plus three points
    assert gate_e.decision(runs(0.0, 0.125), "17")["verdict"] == "passed"
    assert gate_e.decision(runs(0.10, 0.12), "17")["verdict"] == "failed"
    # setting 18's gate N18 (addendum 32): ten points of naive test accuracy at the last step
    naive = {name.replace("explorative", "naive"): run for name, run in runs(0.0, 0.10).items()}
    assert gate_e.decision(naive, "18")["verdict"] == "passed"
    naive["trained-naive"]["test_accuracy"]["499"] -= 0.001
    assert gate_e.decision(naive, "18")["verdict"] == "failed"
    assert gate_e.decision(runs(0.0, 0.50), "18")["verdict"] == "pending"  # explorative runs do not count
    # setting 19's gate E19 (addendum 33): ten points of explorative test accuracy at the last step
    assert gate_e.decision(runs(-0.05, 0.10), "19")["verdict"] == "passed"
    assert gate_e.decision(runs(0.10, 0.095), "19")["verdict"] == "failed"
    # setting 20's gate E20 (addendum 35): the same ten points
    assert gate_e.decision(runs(0.0, 0.10), "20")["verdict"] == "passed"
    assert gate_e.decision(runs(0.10, 0.095), "20")["verdict"] == "failed"
    # setting 21's gate E21 (addendum 36): seeds 7 and 8, each gain positive and a mean of at least 0.075
    two = lambda g7, g8: gate_e.seeds_decision({7: runs(0.0, g7), 8: runs(0.0, g8)}, "21")
    assert two(0.10, 0.05)["verdict"] == "passed" and two(0.10, 0.05)["test_gains"] == {"7": 0.1, "8": 0.05}
    assert two(0.15, 0.0)["verdict"] == "failed"  # the mean is there, seed 8's gain is not positive
    assert two(0.08, 0.065)["verdict"] == "failed"  # both positive, mean 0.0725
    assert gate_e.seeds_decision({7: runs(0.0, 0.3)}, "21")["verdict"] == "pending"
    early = gate_e.seeds_decision({7: runs(0.0, -0.04)}, "24")  # a seed not positive decides before the other
    assert early["verdict"] == "failed" and early["not_run"] == [8] and early["test_gains"] == {"7": -0.04}
    assert gate_e.entry_key("21", 7) == "21" and gate_e.entry_key("21", 8) == "21@8"
    assert gate_e.entry_key("16", 8) == "16@8"  # setting 16's adapter beside gate E21: reported, no rule
    # setting 22's gate E22 (addendum 38): gate E21's rule
    assert gate_e.seeds_decision({7: runs(0.0, 0.07), 8: runs(0.0, 0.08)}, "22")["verdict"] == "passed"
    assert gate_e.seeds_decision({7: runs(0.0, 0.07), 8: runs(0.0, 0.055)}, "22")["verdict"] == "failed"
    assert gate_e.entry_key("22", 8) == "22@8"
    # setting 26's gate E26 (addendum 44): each seed's gain averaged over test steps 499, 749, 999; mean >= 0.08

    def late(gains_by_step: dict) -> dict:
        steps = {"0": 0.2, "249": 0.3, "499": 0.4, "749": 0.45, "999": 0.45}
        return {"trained-explorative": {"train_accuracy": 0.3, "test_accuracy": {
                    k: v + gains_by_step.get(k, 0.0) for k, v in steps.items()}},
                "start-explorative": {"train_accuracy": 0.3, "test_accuracy": steps}}

    # seed 7: (0.09 + 0.06 + 0.09) / 3 = 0.08; seed 8: (0.12 + 0.06 + 0.06) / 3 = 0.08 -> passes at 0.08
    seven, eight = late({"249": 0.5, "499": 0.09, "749": 0.06, "999": 0.09}), late({"499": 0.12, "749": 0.06,
                                                                                      "999": 0.06})
    d = gate_e.seeds_decision({7: seven, 8: eight}, "26")
    assert d["verdict"] == "passed" and d["test_gains"] == {"7": 0.08, "8": 0.08}  # step 249 does not count
    assert "test steps 499-999" in d["rule"]
    # a large step-999 gain does not carry a small late mean; a negative seed fails whatever the mean
    assert gate_e.seeds_decision({7: late({"999": 0.2}), 8: eight}, "26")["verdict"] == "failed"  # 0.0667, 0.08
    assert gate_e.seeds_decision({7: late({"499": 0.5}), 8: late({"999": -0.03})}, "26")["verdict"] == "failed"
    with pytest.raises(ValueError, match="before test step 999"):
        gate_e.late_gain({"test_accuracy": {"499": 0.5}}, {"test_accuracy": {"499": 0.4}}, 499, 999)
    # setting 27's gate E27 (addendum 45): gate E26's rule against a weaker start, and the RL adapter's own late
    # accuracy averaged over the seeds at least 0.400 (seven's late steps 0.49, 0.51, 0.54; eight's 0.52, 0.51, 0.51)
    d = gate_e.seeds_decision({7: seven, 8: eight}, "27")
    assert d["verdict"] == "passed" and d["level"] == pytest.approx(0.5133) and d["min_level"] == 0.4
    assert "own mean accuracy there >= 0.400" in d["rule"]

    def lower(runs_of_seed: dict, by: float) -> dict:  # both adapters `by` lower at every test step
        return {name: {**run, "test_accuracy": {k: v - by for k, v in run["test_accuracy"].items()}}
                for name, run in runs_of_seed.items()}

    low = gate_e.seeds_decision({7: lower(seven, 0.12), 8: lower(eight, 0.12)}, "27")  # gains kept, level 0.393
    assert low["verdict"] == "failed" and low["test_gains"] == {"7": 0.08, "8": 0.08}
    assert gate_e.seeds_decision({7: lower(seven, 0.11), 8: lower(eight, 0.11)}, "27")["verdict"] == "passed"
    # setting 27's start runs: the 25-step bootstrap is the runs' `trained` adapter; at or above a late mean of 0.390
    # over both seeds it is not weaker than H32's and setting 27 is not trained
    stop = gate_e.start_decision({7: seven, 8: eight}, "27")
    assert stop["verdict"] == "stop: not trained" and stop["levels"] == {"7": 0.5133, "8": 0.5133}
    go = gate_e.start_decision({7: lower(seven, 0.13), 8: lower(eight, 0.13)}, "27")
    assert go["verdict"] == "train" and go["level"] == pytest.approx(0.3833)
    assert gate_e.start_decision({7: seven}, "27")["verdict"] == "pending"
    # setting 28's gate E28 (addendum 46): gate E26's rule against the H32 bootstrap, no level term
    assert gate_e.seeds_decision({7: seven, 8: eight}, "28")["verdict"] == "passed"
    assert gate_e.seeds_decision({7: lower(seven, 0.3), 8: lower(eight, 0.3)}, "28")["verdict"] == "passed"
    assert gate_e.seeds_decision({7: late({"999": 0.2}), 8: eight}, "28")["verdict"] == "failed"
    assert "level" not in gate_e.seeds_decision({7: seven, 8: eight}, "28")
    # setting 29's gate N29 (addendum 47): naive runs, the late mean gain, each seed positive, mean >= 0.10

    def naive(runs_of_seed: dict) -> dict:
        return {name.replace("explorative", "naive"): run for name, run in runs_of_seed.items()}

    assert gate_e.gate_strategy("29") == "naive"
    assert gate_e.seeds_decision({7: naive(seven), 8: naive(eight)}, "29")["verdict"] == "failed"  # 0.08 < 0.10
    ten = late({"499": 0.1, "749": 0.1, "999": 0.1})
    assert gate_e.seeds_decision({7: naive(ten), 8: naive(ten)}, "29")["verdict"] == "passed"
    assert gate_e.seeds_decision({7: ten, 8: ten}, "29")["verdict"] == "pending"  # explorative runs do not count
    assert gate_e.seeds_decision({7: naive(late({"999": 0.5})), 8: naive(late({"999": -0.01}))},
                                 "29")["verdict"] == "failed"
    # settings 30-32's gates N30, N31, N32 (addenda 50-52): gate N29's rule
    for setting in ("30", "31", "32", "33"):
        assert gate_e.gate_strategy(setting) == "naive"
        assert gate_e.seeds_decision({7: naive(seven), 8: naive(eight)}, setting)["verdict"] == "failed"
        assert gate_e.seeds_decision({7: naive(ten), 8: naive(ten)}, setting)["verdict"] == "passed"

    # settings 32 and 33 (addendum 54): a rule pass with a collapsed trained run does not go to gate 2
    def repeating(runs_of_seed: dict, repeat_after_wrong: float) -> dict:
        runs_of_seed = naive(runs_of_seed)
        trained = {**runs_of_seed["trained-naive"], "behaviour": {"repeat_after_wrong": repeat_after_wrong}}
        return {**runs_of_seed, "trained-naive": trained}

    collapsed = gate_e.seeds_decision({7: repeating(ten, 1.0), 8: repeating(ten, 0.5)}, "32")
    assert collapsed["verdict"] == "passed by the rule, collapsed: not sent to gate 2"
    assert collapsed["collapsed_seeds"] == ["7"]
    assert gate_e.seeds_decision({7: repeating(ten, 0.94), 8: repeating(ten, 0.5)}, "33")["verdict"] == "passed"
    assert gate_e.seeds_decision({7: repeating(seven, 1.0), 8: repeating(eight, 1.0)}, "32")["verdict"] == "failed"
    assert gate_e.seeds_decision({7: repeating(ten, 1.0), 8: repeating(ten, 1.0)}, "31")["verdict"] == "passed"


def test_a_seed_run_in_parts_is_one_seed():
    explorative = {"runs": {"trained-explorative": {"test_accuracy": {"999": 0.5}}}, "seconds": 100.0,
                   "forgetting_drop": 0.01}
    naive = {"runs": {"trained-naive": {"test_accuracy": {"999": 0.2}}}, "seconds": 50.0, "forgetting_drop": 0.01}
    merged = collect_gate2.merge_parts(explorative, naive)
    assert set(merged["runs"]) == {"trained-explorative", "trained-naive"}
    assert merged["seconds"] == 150.0 and merged["forgetting_drop"] == 0.01


def test_a_part_collected_in_a_later_session_joins_the_kept_seed():
    """The kept explorative part of a seed stays when its naive part is collected alone (first while its base run
    is still going, then again finished): runs replaced by name, each part's seconds counted once."""
    kept = {"runs": {"trained-explorative": {"test_accuracy": {"999": 0.5}}}, "seconds": 100.0, "forgetting_drop": 0.01}
    running = {"runs": {"start-naive": {}, "trained-naive": {"test_accuracy": {"999": 0.2}}}}
    first = collect_gate2.merge_parts(kept, running)
    assert set(first["runs"]) == {"trained-explorative", "start-naive", "trained-naive"}
    assert first["seconds"] == 100.0 and first["part_seconds"] == {"explorative": 100.0}
    finished = {"runs": {"start-naive": {}, "trained-naive": {}, "base-naive": {}}, "part_seconds": {"naive": 50.0},
                "forgetting_drop": 0.02}
    again = collect_gate2.merge_parts(first, finished)
    assert set(again["runs"]) == {"trained-explorative", "start-naive", "trained-naive", "base-naive"}
    assert again["seconds"] == 150.0 and again["forgetting_drop"] == 0.02
    assert collect_gate2.merge_parts(again, finished)["seconds"] == 150.0  # collected twice: counted once


def _experiment_script(name: str):
    """experiments/icrl_stream_rl/NAME.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / "icrl_stream_rl" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_learnability():
    return _experiment_script("check_learnability")


def test_learnability_check_needs_the_switch_contrast_and_the_reward_gain_at_iteration_60():
    """Addendum 48's check L48: after 60 iterations, switch after wrong - switch after right >= 0.30 and the
    validation reward at least iteration 0's + 0.10; pending before iteration 60."""
    check = _check_learnability()

    def record(step, reward, wrong, right):
        return {"step": step, "val_reward": reward, "val_switch_after_wrong": wrong, "val_switch_after_right": right}

    start = record(0, 0.50, 0.10, 0.10)
    assert check.decision([start, record(60, 0.60, 0.50, 0.20)])["verdict"] == "passed"
    assert check.decision([start, record(60, 0.59, 0.90, 0.05)])["verdict"] == "failed"  # reward short
    assert check.decision([start, record(60, 0.90, 0.50, 0.21)])["verdict"] == "failed"  # contrast short
    assert check.decision([start, record(50, 0.90, 0.90, 0.00)])["verdict"] == "pending"


def test_check_l50_is_decided_by_the_reward_gain_alone_and_the_earlier_checks_keep_their_rule():
    """Addendum 53's check L50 draws queries independently, where switching after "wrong" earns nothing: the
    validation reward at iteration 60 at least iteration 0's + 0.10 passes whatever the switch rates; L48 and L49
    keep the switch-contrast term. The curve carries the streams' first- and second-half reward when logged."""
    check = _check_learnability()

    def record(step, reward, wrong, right):
        return {"step": step, "val_reward": reward, "val_switch_after_wrong": wrong, "val_switch_after_right": right,
                "val_reward_first_half": reward - 0.1, "val_reward_second_half": reward + 0.1}

    runs = [record(0, 0.50, 0.10, 0.10), record(60, 0.62, 0.20, 0.20)]
    result = check.check_decision("l50", runs)
    assert result["verdict"] == "passed" and result["rule"] == "reward gain >= +0.1 at iteration 60"
    assert result["curve"][1]["reward_second_half"] == 0.72
    assert check.check_decision("L49", runs)["verdict"] == "failed"  # contrast 0 < 0.30
    assert check.check_decision("l50", [runs[0], record(60, 0.59, 0.9, 0.0)])["verdict"] == "failed"


def test_learnability_training_blocks_average_per_ten_iterations_and_skip_missing_switch_rates():
    """check_learnability.py's training record: a block's switch rate leaves out iterations that had none (NaN)."""
    check = _check_learnability()
    history = [{"step": i + 1, "mean_reward": 0.5, "switch_after_wrong": float("nan") if i == 0 else 0.2,
                "switch_after_right": 0.1, "kl": 1.0, "entropy": 0.3, "redrawn_groups": 1.0, "uniform_groups": 0.0}
               for i in range(12)]
    blocks = check.training_blocks(history)
    assert [b["iterations"] for b in blocks] == [[1, 10], [11, 12]]
    assert blocks[0]["switch_after_wrong"] == 0.2 and blocks[0]["redrawn_groups"] == 10
    assert blocks[1]["redrawn_groups"] == 2 and blocks[1]["mean_reward"] == 0.5


def _ceiling():
    return _experiment_script("class_verdict_ceiling")


def test_class_verdict_ceiling_categories_and_the_readings_of_checks_l51_and_l52():
    """Addendum 58: a step's category is the verdict on the latest past query of its class; L51's outcome is
    "ceiling" below 0.60 with gold labels, "reading gap" when verdicts give 0.10 less, else "already read".
    Addendum 59: L52 passes when the trained adapter's verdict p(gold) is at least the start's + 0.10."""
    from icrl_core.icrl_eval import EpisodeRecord

    ceiling = _ceiling()
    records = [EpisodeRecord(0, "q0", "A", "A", 1, 1), EpisodeRecord(1, "q1", "B", "A", 0, 0),
               EpisodeRecord(2, "q2", "A", "B", 0, 0), EpisodeRecord(3, "q3", "B", "B", 1, 1)]
    assert [ceiling.category(records, t) for t in range(4)] == ["none", "none", "right", "wrong"]

    def model(gold, verdict):
        return {"gold": {"late": {"p_gold": gold}}, "verdict": {"late": {"p_gold": verdict}}}

    outcomes = [ceiling.verdict({"m": model(g, v)}, "m")["outcome"] for g, v in ((0.59, 0.9), (0.8, 0.69),
                                                                                 (0.8, 0.70))]
    assert outcomes == ["ceiling", "reading gap", "already read"]
    results = {"start": model(0.9, 0.55), "trained": model(0.9, 0.65), "short": model(0.9, 0.6499)}
    assert ceiling.reading_check(results, "trained", "start")["verdict"] == "passed"  # exactly +0.10
    assert ceiling.reading_check(results, "short", "start")["verdict"] == "failed"


def test_named_pairs_split_at_the_first_equals_and_name_the_expected_form_on_a_bad_item():
    """The experiment scripts' NAME=ADAPTER arguments: a value may hold '='; a missing side is a user error."""
    from icrl_core.errors import UserError

    named_pairs = _experiment_script("named_args").named_pairs
    assert named_pairs(["start=base", "rl=a=b/adapter"]) == [("start", "base"), ("rl", "a=b/adapter")]
    for bad in ("base", "=base", "start="):
        with pytest.raises(UserError, match="expected RUN_DIR=ADAPTER"):
            named_pairs([bad], "RUN_DIR=ADAPTER")


def test_check_l53_streams_are_trec_coarse_label_pairs_from_its_train_split(tasks_dir):
    """Addendum 60's check L53: L51's probe with trec_verdict_probe.yaml and --split train draws 2-label streams of
    trec_coarse's own label names, every query from the train split (the test split the gates read untouched);
    trec_verdict_probe_six.yaml makes every stream six-label."""
    from icrl_core.task_data import load_task
    from tasks.settings import load_config, with_overrides

    ceiling = _ceiling()
    here = ROOT / "experiments" / "icrl_stream_rl"
    task = load_task("trec_coarse", tasks_dir)
    train, test = {e.text for e in task.train}, {e.text for e in task.test}
    six = ["trec_verdict_probe.yaml", "trec_verdict_probe_six.yaml"]
    for extra, labels in ((["trec_verdict_probe.yaml"], {2}), (six, {6})):
        config = load_config([ROOT / layer for layer in ceiling.LAYERS] + [here / name for name in extra])
        config = with_overrides(config, {"data.tasks_dir": str(tasks_dir)})
        streams = ceiling.stream_tasks(config, 8, "train")
        assert {s.name for s in streams} == {"trec_coarse"} and {len(s.labels) for s in streams} == labels
        assert all(set(s.labels) <= set(task.labels) for s in streams)
        texts = {q.text for s in streams for q in s.queries}
        assert texts <= train and not texts & (test - train)

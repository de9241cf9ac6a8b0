"""How much of an explorative run's test accuracy is lost to sampling the test answers (a post-hoc diagnostic).

The harness answers each test query by sampling the label trie at `test_temperature` (1.0 in the protocol), so a
test accuracy is one draw of

    expected_accuracy = mean_q p(gold_q | context, q)          (q over the test queries)

while the model's decision, were it taken greedily, scores

    argmax_accuracy = mean_q 1[argmax_y p(y | context, q) = gold_q]

For each run folder (config.json, steps.jsonl, tests.jsonl) and each test step, the step's context is rebuilt from
the log (the strategy's `context` indices, queries restored from the task's training stream) and every test
query's label distribution is read from the run's model (`label_distribution`, temperature test_temperature). The
logged (sampled) accuracy is reported beside both, with the split by whether a test query's gold label has an
episode in the context (absent_share, the expected accuracy on each part) and the mean probability the model puts on
labels the context lacks (mass_on_absent_labels). Reported, not a gate: it decides nothing (REPORT.md#label-closure).

    .venv/bin/python experiments/icrl_stream_rl/test_sharpness.py RUN=ADAPTER [RUN=ADAPTER ...] [--steps 999] \
        [--output F]          # ADAPTER: a PEFT adapter folder, or 'base'

Run from the project root (data.tasks_dir of the run's config is relative to it).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from named_args import named_pairs

from icrl_core.errors import UserError
from icrl_core.io import atomic_write_json, read_user_text


def sharpness_row(p_gold: list[float], argmax_right: list[bool], sampled_accuracy: float,
                  gold_absent: list[bool], p_absent: list[float]) -> dict:
    """One test step's three accuracies (module docstring) from each test query's p(gold) and argmax verdict, and
    the split by whether the query's gold label has an episode in the context: the expected accuracy on each part,
    the share of queries whose label is absent, and the mean probability put on labels absent from the context."""
    if not p_gold or not len(p_gold) == len(argmax_right) == len(gold_absent) == len(p_absent):
        raise UserError(f"{len(p_gold)} p(gold) values for {len(argmax_right)} argmax verdicts")
    absent = [p for p, a in zip(p_gold, gold_absent) if a]
    present = [p for p, a in zip(p_gold, gold_absent) if not a]
    return {"sampled_accuracy": sampled_accuracy, "expected_accuracy": float(np.mean(p_gold)),
            "argmax_accuracy": float(np.mean(argmax_right)), "queries": len(p_gold),
            "absent_share": len(absent) / len(p_gold),
            "expected_accuracy_absent": float(np.mean(absent)) if absent else None,
            "expected_accuracy_present": float(np.mean(present)) if present else None,
            "mass_on_absent_labels": float(np.mean(p_absent))}


def run_sharpness(run: Path, adapter: str, steps: set[int] | None) -> dict:
    from icrl_core.icrl_eval import Predictor, history_from_events, label_distribution, render_context, show_for
    from tasks.icrl_eval import load_eval_policy, load_eval_task
    from tasks.settings import validate_config, with_overrides

    saved = json.loads(read_user_text(run / "config.json", "run config"))
    config = validate_config(saved)
    config = with_overrides(config, {"model.init_adapter": None if adapter == "base" else adapter})
    cfg = config.icrl_eval
    task = load_eval_task(config)
    train = task.training_stream(cfg.train_k, cfg.training_seed)
    test = task.test_set(cfg.test_k, cfg.test_seed)
    events = [json.loads(line) for line in read_user_text(run / "steps.jsonl", "step log").splitlines() if line]
    tests = {t["step"]: t for t in (json.loads(line) for line in
                                     read_user_text(run / "tests.jsonl", "test log").splitlines() if line)}
    history = [replace(r, query=train[i].text) for i, r in enumerate(history_from_events(events))]
    policy = load_eval_policy(config)
    predictor = Predictor(policy, policy.tokens, task.template, task.labels, None, cfg.temperature)
    show = show_for(cfg)
    rows = {}
    for step in sorted(tests):
        if steps is not None and step not in steps:
            continue
        context = events[step]["context"]
        context_ids, user_open = render_context(policy.tokens, task.template, [history[i] for i in context], show)
        in_context = {history[i].prediction for i in context} | {history[i].gold for i in context
                                                                 if show.answer == "gold"}
        absent_labels = [k for k, label in enumerate(task.labels) if label not in in_context]
        p_gold, argmax_right, p_absent = [], [], []
        for example in test:
            p = label_distribution(predictor, context_ids, user_open, example.text, cfg.test_temperature)
            gold = task.labels.index(example.label)
            p_gold.append(float(p[gold]))
            argmax_right.append(int(np.argmax(p)) == gold)
            p_absent.append(float(p[absent_labels].sum()) if absent_labels else 0.0)
        gold_absent = [e.label not in in_context for e in test]
        rows[str(step)] = {**sharpness_row(p_gold, argmax_right, tests[step]["accuracy"], gold_absent, p_absent),
                           "context_episodes": len(context)}
        print(f"{run} step {step}: {rows[str(step)]}", flush=True)
    return {"run": str(run), "adapter": adapter, "steps": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="RUN_DIR=ADAPTER (ADAPTER: an adapter folder or 'base')")
    parser.add_argument("--steps", type=int, nargs="*", help="test steps to read (default: all)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    try:
        pairs = [(Path(run), adapter) for run, adapter in named_pairs(args.runs, "RUN_DIR=ADAPTER")]
        results = [run_sharpness(run, adapter, set(args.steps) if args.steps else None) for run, adapter in pairs]
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.output:
        atomic_write_json(args.output, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

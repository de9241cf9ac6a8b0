"""What `icrl demo` says at the end: did training make a better in-context RL learner on a rule it never saw, at
what cost in general ability, and what was registered. Plain sentences from the evaluate and promote stages'
records (artifacts/evaluate/metrics.json, metrics/promote.json), written to metrics/demo.json as well, so the
README's demo block is generated from a measured run (scripts/results_tables.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tasks.settings import PipelineConfig

DEMO_METRICS = Path("metrics/demo.json")


def demo_headline(config: PipelineConfig, evaluation: dict, promotion: dict) -> dict:
    """The few numbers the summary states (also the README's demo row)."""
    eval_cfg = config.icrl_eval
    headline = {
        "task": f"{eval_cfg.task} (task seed {eval_cfg.task_seed}, a rule never trained on)"
        if eval_cfg.task_seed is not None else eval_cfg.task,
        "strategy": config.evaluate.strategies[0], "step": eval_cfg.train_k - 1,
        "test_queries": eval_cfg.test_k, "seed": eval_cfg.seed, "dtype": config.model.dtype,
        "base": evaluation["base_final_test_accuracy"], "trained": evaluation["trained_final_test_accuracy"],
        "gain": evaluation["gain"],
        "version": promotion.get("version"), "alias": promotion.get("alias"),
        "eligible": evaluation.get("eligible"),
    }
    if "start_final_test_accuracy" in evaluation:  # evaluate.start_adapter: the adapter RL started from
        headline.update(start=evaluation["start_final_test_accuracy"], start_adapter=evaluation["start_adapter"])
    if "forgetting_base_accuracy" in evaluation:
        headline.update(general_questions=config.evaluate.forgetting_questions,
                        base_general=evaluation["forgetting_base_accuracy"],
                        trained_general=evaluation["forgetting_trained_accuracy"],
                        general_drop=evaluation["forgetting_drop"],
                        max_forgetting=config.evaluate.max_forgetting)
    return headline


def summary_lines(headline: dict, registered_model: str) -> list[str]:
    """The demo's closing sentences: the measured gain and forgetting, then a verdict that says plainly whether
    the demo showed the skill."""
    lines = [f"In-context RL on {headline['task']}, {headline['strategy']}, test accuracy on "
             f"{headline['test_queries']} queries after step {headline['step']} (seed {headline['seed']}, "
             f"{headline['dtype']}): base {headline['base']:.3f} -> trained {headline['trained']:.3f} "
             f"({headline['gain']:+.3f})."]
    if "start" in headline:  # which stage carries the gain: the supervised bootstrap or the RL after it
        rl_gain = headline["trained"] - headline["start"]
        lines.append(f"The adapter RL started from ({headline['start_adapter']}) scores {headline['start']:.3f}: "
                     f"the RL stage {'added' if rl_gain > 0 else 'did not add'} to it ({rl_gain:+.3f}).")
    kept = True
    if "base_general" in headline:
        kept = headline["general_drop"] <= headline["max_forgetting"]
        lines.append(f"General-ability check ({headline['general_questions']} questions answered greedily): base "
                     f"{headline['base_general']:.3f} -> trained {headline['trained_general']:.3f} "
                     f"({headline['trained_general'] - headline['base_general']:+.3f}; the gate allows a drop of "
                     f"{headline['max_forgetting']:.2f}).")
    if headline["gain"] > 0 and kept:
        lines.append("The trained policy learns the unseen rule from rewards in its context better than the base "
                     "model, and kept its general ability on this check.")
    elif headline["gain"] > 0:
        lines.append("The trained policy learns the unseen rule from rewards in its context better than the base "
                     "model, but lost general ability beyond the gate's limit.")
    else:
        lines.append("At the demo's budget the trained policy is NOT a better in-context RL learner than the base "
                     "model on the unseen rule: the demo shows the pipeline running end to end, not the skill "
                     "(the skill experiment: experiments/icrl_skill/REPORT.md).")
    if headline.get("version") is not None:
        gates = "passed" if headline.get("eligible") else "did not pass"
        lines.append(f"Registered {registered_model} version {headline['version']} as '{headline['alias']}' "
                     f"(it {gates} the promotion gates).")
    return lines


def write_demo_summary(config: PipelineConfig, root: Path = Path(".")) -> list[str]:
    """Read the evaluate and promote records under `root`, write metrics/demo.json, return the lines to print."""
    from icrl_core.io import atomic_write_json

    evaluation = json.loads((root / config.evaluate.output_dir / "metrics.json").read_text())
    promote_file = root / "metrics" / "promote.json"
    promotion = json.loads(promote_file.read_text()) if promote_file.exists() else {}
    headline = demo_headline(config, evaluation, promotion)
    lines = summary_lines(headline, config.tracking.registered_model)
    atomic_write_json(root / DEMO_METRICS, {"headline": headline, "printed": lines})
    return lines

"""One in-context RL protocol run, timed, for the benchmarks that compare ways of running it
(bench/icrl_eval_speed.py, bench/inference_engine.py): rates per phase, tokens, predictions and test curves."""

from __future__ import annotations

import time


def harness_run(predictor, task, cfg, max_examples: int) -> dict:
    """Run the protocol with `predictor`. Steps up to `max_examples` are the growing phase (the context still
    grows), the later ones the full phase (naive: the window slides); test predictions are keyed by step."""
    from icrl_core.icrl_eval import EvaluationEvent, StepEvent, run_protocol

    steps, tests = [], []
    started = time.perf_counter()
    for event in run_protocol(predictor, task, cfg, max_examples):
        if isinstance(event, StepEvent):
            steps.append(event.to_json())
        elif isinstance(event, EvaluationEvent):
            tests.append(event.to_json())
    wall = time.perf_counter() - started

    def phase(rows):
        seconds = sum(r["seconds"] for r in rows)
        return {"steps": len(rows), "seconds": round(seconds, 2),
                "steps_per_s": round(len(rows) / seconds, 4) if seconds else None,
                "tokens_computed_per_step": round(sum(r["tokens_computed"] for r in rows) / len(rows), 1)
                if rows else None}

    every = phase(steps)
    return {"max_examples": max_examples, "steps_per_s": every["steps_per_s"], "train_seconds": every["seconds"],
            "tokens_computed_per_step": every["tokens_computed_per_step"],
            "prompt_tokens_per_step": round(sum(s["prompt_tokens"] for s in steps) / len(steps), 1),
            "mean_context_episodes": round(sum(len(s["context"]) for s in steps) / len(steps), 1),
            "growing_phase": phase([s for s in steps if s["step"] <= max_examples]),
            "full_phase": phase([s for s in steps if s["step"] > max_examples]),
            "test_seconds": round(sum(t["seconds"] for t in tests), 2),
            "test_queries": sum(len(t["predictions"]) for t in tests),
            "test_tokens_computed": sum(t["tokens_computed"] for t in tests),
            "wall_seconds": round(wall, 2),
            "predictions": [s["prediction"] for s in steps],
            "test_curve": {t["step"]: t["accuracy"] for t in tests},
            "test_predictions": {t["step"]: t["predictions"] for t in tests}}

"""Benchmark: the in-context RL protocol with key/value reuse vs recomputing every prompt (same seeds).

Runs naive, explorative and approximate for 200 steps on banking77 with SmolLM2-135M (fp32), once with prefix
reuse (PrefixCache + tree-packed candidate scoring) and once with `reuse_cache=false`: every prompt computed
from scratch, every test query on its own (what the paper's code does without a GPU server's prefix cache).
Asserts that both make the same predictions (training steps and tests), and writes steps/s, tokens computed
per step, test-evaluation time and peak RSS to bench/results/icrl_eval_speed.json.

Naive is also split into its two phases: while the context grows (steps < max_examples) reuse feeds only the
new episode; once it holds max_examples episodes it slides (the oldest leaves every step), every position
changes, and reuse can only recompute it like the baseline does.

Each (strategy, mode) runs in its own subprocess, so peak RSS (ru_maxrss, model included) is per run.

    .venv/bin/python bench/icrl_eval_speed.py                     # everything, 2048-token window (~20 min)
    .venv/bin/python bench/icrl_eval_speed.py --steps 50          # quicker
    .venv/bin/python bench/icrl_eval_speed.py --one naive reuse   # one run, JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness_timing import harness_run

STRATEGIES = ("naive", "explorative", "approximate")
MODES = ("reuse", "recompute")


def one_run(strategy: str, mode: str, args) -> dict:
    import torch

    from icrl_core.config import EvalConfig
    from icrl_core.icrl_eval import Predictor, max_context_examples, show_for
    from icrl_core.kernels import PrefixCache
    from icrl_core.model import load_policy
    from icrl_core.task_data import load_task

    torch.set_num_threads(args.threads)
    policy = load_policy(args.model, dtype="float32")
    task = load_task(args.task, args.tasks_dir)
    cfg = EvalConfig(task=args.task, strategy=strategy, train_k=args.steps, test_every=10**9, test_k=args.test_k,
                     seed=100, training_seed=100, test_seed=100, reuse_cache=(mode == "reuse"))
    window = args.context_window or policy.context_window
    max_examples = max_context_examples(task, policy.tokens, show_for(cfg), window)
    capacity = cfg.max_contexts + 1 if strategy == "approximate" else 2
    predictor = Predictor(policy, policy.tokens, task.template, task.labels,
                          PrefixCache(policy, capacity=capacity, reuse=cfg.reuse_cache), cfg.temperature)
    run = harness_run(predictor, task, cfg, max_examples)
    return {"strategy": strategy, "mode": mode, "expand": predictor.expand, "steps": len(run["predictions"]), **run,
            "test_predictions": list(run["test_predictions"].values()),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--test-k", type=int, default=8, help="test queries at step 0 and at the last step")
    parser.add_argument("--task", default="banking77")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tasks-dir", default=str(ROOT.parent / "shared" / "data" / "icrl-tasks"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (1 is fastest on a busy "
                        "2-core machine)")
    parser.add_argument("--context-window", type=int, default=2048,
                        help="context window in tokens that caps the in-context episodes (0: the model's own, 8192 "
                        "for SmolLM2, where the recompute baseline alone takes about an hour on 2 cores)")
    parser.add_argument("--sequential", action="store_true",
                        help="run reuse and recompute one after the other instead of side by side")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--one", nargs=2, metavar=("STRATEGY", "MODE"), help="run one configuration, print JSON")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "icrl_eval_speed.json"))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one[0], args.one[1], args)))
        return

    load_before = os.getloadavg()
    runs = []
    for strategy in args.strategies:
        # The two modes of one strategy run side by side (one thread each on a 2-core machine), so both see
        # the same machine load; --sequential runs them one after the other.
        procs = {}
        for mode in MODES:
            cmd = [sys.executable, __file__, "--one", strategy, mode, "--steps", str(args.steps), "--test-k",
                   str(args.test_k), "--task", args.task, "--model", args.model, "--tasks-dir", args.tasks_dir,
                   "--threads", str(args.threads), "--context-window", str(args.context_window)]
            print(f"running {strategy} / {mode} ...", flush=True)
            procs[mode] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            if args.sequential:
                procs[mode].wait()
        for mode, proc in procs.items():
            stdout, stderr = proc.communicate()
            if proc.returncode != 0:
                sys.exit(f"{strategy}/{mode} failed:\n{stderr[-3000:]}")
            result = json.loads(stdout.strip().splitlines()[-1])
            runs.append(result)
            print(f"  {strategy}/{mode}: {result['steps_per_s']:.3f} steps/s, "
                  f"{result['tokens_computed_per_step']:.0f} tokens/step, peak RSS {result['peak_rss_mb']:.0f} MB, "
                  f"{result['wall_seconds']:.0f}s", flush=True)

    summary, identical = {}, True
    for strategy in args.strategies:
        reuse = next(r for r in runs if r["strategy"] == strategy and r["mode"] == "reuse")
        recompute = next(r for r in runs if r["strategy"] == strategy and r["mode"] == "recompute")
        same = (reuse["predictions"] == recompute["predictions"]
                and reuse["test_predictions"] == recompute["test_predictions"])
        identical &= same
        summary[strategy] = {
            "identical_predictions": same,
            "speedup_steps_per_s": round(reuse["steps_per_s"] / recompute["steps_per_s"], 2),
            "token_reduction": round(recompute["tokens_computed_per_step"] / reuse["tokens_computed_per_step"], 2),
            "test_eval_speedup": round(recompute["test_seconds"] / reuse["test_seconds"], 2)
            if reuse["test_seconds"] else None,
        }
        for part in ("growing_phase", "full_phase"):
            if reuse[part]["steps"] and recompute[part]["steps_per_s"]:
                summary[strategy][f"{part}_speedup"] = round(reuse[part]["steps_per_s"]
                                                             / recompute[part]["steps_per_s"], 2)
    result = {
        "benchmark": "icrl_eval_speed", "task": args.task, "model": args.model, "dtype": "float32",
        "steps": args.steps, "test_k": args.test_k, "threads": args.threads, "context_window": args.context_window,
        "modes_side_by_side": not args.sequential,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_before": load_before,
                    "load_avg_after": os.getloadavg(),
                    "note": "shared 2-core machine; other jobs were running (see load averages)"},
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if k not in ("predictions", "test_predictions")} for r in runs],
    }
    from icrl_core.io import atomic_write_json

    atomic_write_json(args.output, result)
    print(f"\n{'strategy':<12} {'reuse steps/s':>14} {'recompute':>10} {'speedup':>8} {'tokens/step':>18} "
          f"{'same preds':>10}")
    for strategy in args.strategies:
        r = next(x for x in runs if x["strategy"] == strategy and x["mode"] == "reuse")
        c = next(x for x in runs if x["strategy"] == strategy and x["mode"] == "recompute")
        print(f"{strategy:<12} {r['steps_per_s']:>14.3f} {c['steps_per_s']:>10.3f} "
              f"{summary[strategy]['speedup_steps_per_s']:>7.1f}x "
              f"{r['tokens_computed_per_step']:>8.0f} vs {c['tokens_computed_per_step']:>7.0f} "
              f"{summary[strategy]['identical_predictions']!s:>10}")
    print(f"wrote {args.output}")
    assert identical, "reuse and recompute made different predictions"


if __name__ == "__main__":
    main()

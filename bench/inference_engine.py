"""Benchmark: the evaluation harness on the inference engine vs a recompute-every-step port of the paper's protocol.

Issue 30's acceptance, measured side by side on this machine (trec_coarse, SmolLM2-135M fp32, 2048-token window):

1. single stream (one torch thread per run, the runs of a part side by side so they see the same load):
   * explorative: the torch engine (exact: prefix reuse + tree-packed candidates) vs the port (`reuse=False`:
     every prompt computed from scratch, every query on its own), same seed/cap/steps;
   * naive: the port, the engine on the paper's sliding window (exact), and the engine on the block-eviction
     variant (`icrl_eval.evict_episodes`, a different protocol), whose per-step prediction agreement and
     test-accuracy curve vs the exact protocol are reported. Steps are split into the growing phase (context
     not yet full) and the full phase, whose rate is stationary: the 1000-step rate is projected from it.
   * the faster modes that change numerics, beside them in the same run: the engine in bfloat16 (explorative;
     naive with block eviction), with their per-step prediction agreement with the exact fp32 run.
2. aggregate (all cores): the same evaluation runs (explorative, several seeds) through the evaluate stage's code
   (`tasks.evaluate.run_evaluations`): today's pool (one single-threaded process per core) vs one engine serving
   them as streams (threads), exact and with fused passes (`inference.fuse_streams`), and with `--aggregate-vllm`
   as streams of one vLLM engine (`inference.backend=vllm`, the vllm extra); steps summed over the runs per wall
   second (wall clock, start-up included; and steady: each run's rate from its own step seconds, times the runs
   going at once), and each mode's prediction agreement with the pool's.

3. vllm (`--parts vllm`, run with a python that has the vllm extra: `make setup-vllm`): the same harness run
   (explorative, same seed/cap/steps) on the vllm engine and on the torch engine in this process, one after the
   other with the same thread count: steps/s, per-step prediction agreement, test accuracy; and the label trie
   scored after a long context for every test query by both engines: log-prob difference and argmax agreement.
   vLLM's start-up is timed separately (not in steps/s).

    .venv/bin/python bench/inference_engine.py --quick     # a few minutes: short runs
    .venv/bin/python bench/inference_engine.py             # the full bench (~1 h on a busy 2-core machine)
    .venv/bin/python bench/inference_engine.py --parts vllm --quick   # vllm vs torch only

Writes bench/results/inference_engine.json (`--parts vllm` alone: bench/results/inference_engine_vllm.json;
`--parts aggregate` alone: bench/results/inference_engine_aggregate.json), the machine's load averages before and
after each part included.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from itertools import chain
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.harness_timing import harness_run

TASKS_DIR = str(ROOT.parent / "shared" / "data" / "icrl-tasks")


# ---------------------------------------------------------------------------------------------------------------
# One single-stream run (in its own process)


def one_run(spec: dict) -> dict:
    import torch

    from icrl_core.config import EvalConfig
    from icrl_core.icrl_eval import Predictor, max_context_examples, show_for
    from icrl_core.inference.torch_backend import TorchEngine
    from icrl_core.model import load_policy
    from icrl_core.task_data import load_task

    torch.set_num_threads(1)
    policy = load_policy("smollm2-135m", dtype=spec.get("dtype", "float32"))
    task = load_task(spec["task"], TASKS_DIR)
    cfg = EvalConfig(task=spec["task"], strategy=spec["strategy"], train_k=spec["steps"],
                     test_every=spec["test_every"], test_k=spec["test_k"], seed=100, training_seed=100,
                     test_seed=100, evict_episodes=spec["evict"])
    max_examples = max_context_examples(task, policy.tokens, show_for(cfg), 2048)
    engine = TorchEngine(policy, reuse=spec["mode"] != "recompute")
    predictor = Predictor(policy, policy.tokens, task.template, task.labels, None, cfg.temperature, engine=engine)
    return {**spec, **harness_run(predictor, task, cfg, max_examples)}


def side_by_side(specs: list[dict]) -> tuple[list[dict], dict]:
    """Run the specs at once, each in its own process with one torch thread; (results, load averages)."""
    load_before = os.getloadavg()
    procs = []
    for spec in specs:
        procs.append(subprocess.Popen([sys.executable, __file__, "--one", json.dumps(spec)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))
    results = []
    for spec, proc in zip(specs, procs):
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            sys.exit(f"{spec} failed:\n{stderr[-3000:]}")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results, {"before": load_before, "after": os.getloadavg()}


def agreement(a: list, b: list) -> float:
    return round(sum(x == y for x, y in zip(a, b)) / max(1, min(len(a), len(b))), 4)


def test_agreement(a: dict, b: dict) -> dict:
    """Per shared evaluation step, the share of test queries both answered alike (on the common prefix)."""
    out = {}
    for step in sorted(set(a) & set(b), key=int):
        n = min(len(a[step]), len(b[step]))
        out[str(step)] = round(sum(x == y for x, y in zip(a[step][:n], b[step][:n])) / n, 4)
    return out


def rate(run: dict, phase: str | None = None) -> float:
    return run[phase]["steps_per_s"] if phase else run["steps_per_s"]


def projected_rate(run: dict, steps: int) -> float:
    """Steps/s over `steps` steps from the measured growing phase and the stationary full-phase rate."""
    grow, full = run["growing_phase"], run["full_phase"]
    seconds = grow["seconds"] + (steps - grow["steps"]) / full["steps_per_s"]
    return round(steps / seconds, 4)


def single_stream(args) -> dict:
    out: dict = {}
    print(f"explorative: engine vs port, {args.explorative_steps} steps ...", flush=True)
    common = {"task": args.task, "strategy": "explorative", "steps": args.explorative_steps, "evict": 1}
    runs, load = side_by_side([{**common, "mode": "engine", "test_every": 10**9, "test_k": args.test_k},
                               {**common, "mode": "recompute", "test_every": 10**9, "test_k": args.test_k},
                               {**common, "mode": "engine", "dtype": "bfloat16", "test_every": 10**9,
                                "test_k": args.test_k}])
    engine, port, bf16 = runs
    out["explorative"] = {
        "engine": "torch", "mode": "exact", "load_avg": load,
        "engine_steps_per_s": rate(engine), "port_steps_per_s": rate(port),
        "speedup": round(rate(engine) / rate(port), 2),
        "identical_predictions": engine["predictions"] == port["predictions"],
        "tokens_per_step": {"engine": engine["tokens_computed_per_step"], "port": port["tokens_computed_per_step"]},
        "bf16": {"engine": "torch", "mode": "bfloat16 weights and activations (changes numerics)",
                 "steps_per_s": rate(bf16), "speedup": round(rate(bf16) / rate(port), 2),
                 "step_prediction_agreement_with_exact": agreement(bf16["predictions"], engine["predictions"])},
        "runs": [_strip(r) for r in runs]}
    print(json.dumps({k: v for k, v in out["explorative"].items() if k != "runs"}), flush=True)

    print(f"naive: port, exact engine, block eviction (k={args.evict}), {args.naive_steps} steps ...", flush=True)
    common = {"task": args.task, "strategy": "naive", "steps": args.naive_steps, "test_every": args.test_every}
    runs, load = side_by_side([{**common, "mode": "recompute", "evict": 1, "test_k": args.port_test_k},
                               {**common, "mode": "engine", "evict": 1, "test_k": args.test_k},
                               {**common, "mode": "engine", "evict": args.evict, "test_k": args.test_k},
                               {**common, "mode": "engine", "evict": args.evict, "test_k": args.test_k,
                                "dtype": "bfloat16"}])
    port, exact, block, block_bf16 = runs
    naive = {"load_avg": load, "max_examples": exact["max_examples"], "port": _rates(port, args),
             "exact": {"engine": "torch", "mode": "exact (sliding window, the paper's protocol)", **_rates(exact, args),
                       "identical_predictions_to_port": exact["predictions"] == port["predictions"]},
             "block_eviction": {**_against_exact(block, exact, f"protocol variant: evict_episodes={args.evict}", args),
                                "exact_test_accuracy_curve": exact["test_curve"]},
             "block_eviction_bf16": _against_exact(
                 block_bf16, exact, f"protocol variant evict_episodes={args.evict}, bfloat16 (changes numerics)", args),
             "runs": [_strip(r) for r in runs]}
    for name in ("exact", "block_eviction", "block_eviction_bf16"):
        entry = naive[name]
        entry["speedup"] = round(entry["steps_per_s"] / naive["port"]["steps_per_s"], 2)
        entry["full_phase_speedup"] = round(entry["full_phase_steps_per_s"] / naive["port"]["full_phase_steps_per_s"], 2)
        entry["projected_1000_step_speedup"] = round(entry["projected_1000_steps_per_s"]
                                                     / naive["port"]["projected_1000_steps_per_s"], 2)
    out["naive"] = naive
    print(json.dumps({k: v for k, v in naive.items() if k != "runs"}), flush=True)
    return out


def _against_exact(run: dict, exact: dict, mode: str, args) -> dict:
    """A faster naive mode's rates, and its per-step and test agreement with the exact run (and its curve)."""
    return {"engine": "torch", "mode": mode, **_rates(run, args),
            "step_prediction_agreement_with_exact": agreement(run["predictions"], exact["predictions"]),
            "test_accuracy_curve": run["test_curve"],
            "test_prediction_agreement_with_exact": test_agreement(run["test_predictions"], exact["test_predictions"])}


def _rates(run: dict, args) -> dict:
    return {"steps_per_s": rate(run), "growing_phase_steps_per_s": rate(run, "growing_phase"),
            "full_phase_steps_per_s": rate(run, "full_phase"),
            "projected_1000_steps_per_s": projected_rate(run, 1000),
            "tokens_per_step": run["tokens_computed_per_step"],
            "full_phase_tokens_per_step": run["full_phase"]["tokens_computed_per_step"]}


def _strip(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("predictions", "test_predictions")}


# ---------------------------------------------------------------------------------------------------------------
# Aggregate throughput through the evaluate stage's scheduling


def steady_rate(run_dirs: list[Path], at_once: int) -> float:
    """Steps per second summed over `at_once` concurrent runs, each run's rate from its own step and test seconds
    (steps.jsonl, tests.jsonl): the rate once the runs are going, model loads and engine start-up excluded (a long
    run's rate; the wall-clock rate of a short bench counts them)."""
    from tasks.icrl_eval import read_jsonl

    rates = []
    for run_dir in run_dirs:
        steps, _ = read_jsonl(run_dir / "steps.jsonl")
        tests, _ = read_jsonl(run_dir / "tests.jsonl")
        rates.append(len(steps) / sum(event["seconds"] for event in steps + tests))
    return sum(rates) / len(rates) * at_once


def aggregate(args) -> dict:
    from tasks.evaluate import run_evaluations
    from tasks.settings import load_config

    modes = [("pool", {"inference.streams": 1}, 2),
             ("streams", {"inference.streams": args.streams, "inference.fuse_streams": False}, 1),
             ("fused", {"inference.streams": args.streams, "inference.fuse_streams": True}, 1)]
    if args.aggregate_vllm:  # the streams' requests batched by one vLLM engine (the vllm extra)
        modes.append(("vllm", {"inference.backend": "vllm", "inference.streams": args.streams}, 1))
    out: dict = {"runs": args.streams, "steps_per_run": args.aggregate_steps, "strategy": "explorative",
                 "seeds": list(range(100, 100 + args.streams))}
    predictions = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, overrides, workers in modes:
            configs = [load_config(None, [
                "model.spec=smollm2-135m", "model.dtype=float32", "tracking.enabled=false",
                f"data.tasks_dir={TASKS_DIR}", f"icrl_eval.task={args.task}", "icrl_eval.strategy=explorative",
                f"icrl_eval.train_k={args.aggregate_steps}", "icrl_eval.test_every=1000000",
                f"icrl_eval.test_k={args.test_k}", "icrl_eval.context_window=2048", f"icrl_eval.seed={seed}",
                f"icrl_eval.run_name={name}-{seed}", f"icrl_eval.output_dir={folder}/{name}"]
                + [f"{k}={v}" for k, v in overrides.items()], environ={}) for seed in out["seeds"]]
            print(f"aggregate: {name} ({len(configs)} runs) ...", flush=True)
            load_before = os.getloadavg()
            started = time.perf_counter()
            results = run_evaluations(configs, workers=workers)
            wall = time.perf_counter() - started
            steps = sum(r["steps"] for r in results)
            predictions[name] = [[json.loads(line)["prediction"] for line in
                                  (Path(r["run_dir"]) / "steps.jsonl").read_text().splitlines()] for r in results]
            at_once = min(len(configs), workers if name == "pool" else args.streams)
            out[name] = {"wall_seconds": round(wall, 1), "steps": steps,
                         "aggregate_steps_per_s": round(steps / wall, 4),
                         "steady_steps_per_s": round(steady_rate([Path(r["run_dir"]) for r in results], at_once), 4),
                         "load_avg": {"before": load_before, "after": os.getloadavg()},
                         "settings": {**overrides, "evaluate.workers": workers}}
            print(f"  {json.dumps(out[name])}", flush=True)
    for name in [m[0] for m in modes[1:]]:
        out[name]["speedup_vs_pool"] = round(out[name]["aggregate_steps_per_s"] / out["pool"]["aggregate_steps_per_s"], 2)
        out[name]["steady_speedup_vs_pool"] = round(out[name]["steady_steps_per_s"] / out["pool"]["steady_steps_per_s"],
                                                    2)
        out[name]["step_prediction_agreement_with_pool"] = agreement(list(chain.from_iterable(predictions[name])),
                                                                     list(chain.from_iterable(predictions["pool"])))
    out["streams"]["mode"] = "exact (threads, per-stream caches, one copy of the weights)"
    out["fused"]["mode"] = "fused ragged passes (float rounding may differ from exact)"
    if "vllm" in out:
        out["vllm"]["mode"] = "one vLLM engine, the streams' requests batched (prefix caching; not bit-identical)"
    return out


# ---------------------------------------------------------------------------------------------------------------
# vllm vs torch (same process, one after the other)


def vllm_vs_torch(args) -> dict:
    import numpy as np
    import torch

    from icrl_core.config import EvalConfig
    from icrl_core.icrl_eval import (
        EpisodeRecord,
        Predictor,
        max_context_examples,
        render_context,
        render_query,
        show_for,
    )
    from icrl_core.inference.base import walk_scores
    from icrl_core.inference.torch_backend import TorchEngine
    from icrl_core.inference.vllm_backend import VllmEngine
    from icrl_core.model import SMOLLM2, load_policy, resolve_spec
    from icrl_core.task_data import load_task

    torch.set_num_threads(args.threads)
    policy = load_policy(SMOLLM2, dtype="float32")
    task = load_task(args.task, TASKS_DIR)
    cfg = EvalConfig(task=args.task, strategy="explorative", train_k=args.vllm_steps, test_every=args.test_every,
                     test_k=args.test_k, seed=100, training_seed=100, test_seed=100)
    max_examples = max_context_examples(task, policy.tokens, show_for(cfg), 2048)
    load_before = os.getloadavg()
    started = time.perf_counter()
    vllm = VllmEngine(resolve_spec(SMOLLM2)[1], max_model_len=4096, kv_cache_bytes=512 << 20, lora=False,
                      threads=args.threads)
    startup = time.perf_counter() - started
    engines = {"torch": TorchEngine(policy), "vllm": vllm}
    out: dict = {"threads": args.threads, "strategy": "explorative", "steps": args.vllm_steps, "seed": 100,
                 "vllm_startup_seconds": round(startup, 1), "engines": {}}
    try:
        # 1. the harness, same seed/cap/steps on each engine
        runs = {}
        for name, engine in engines.items():
            print(f"vllm part: harness on {name}, {args.vllm_steps} steps ...", flush=True)
            predictor = Predictor(policy if name == "torch" else None, policy.tokens, task.template, task.labels,
                                  None, cfg.temperature, engine=engine)
            runs[name] = harness_run(predictor, task, cfg, max_examples)
            out["engines"][name] = {"mode": "exact" if engine.exact else "not bit-identical (fp32, other kernels)",
                                    **{k: v for k, v in runs[name].items()
                                       if k not in ("predictions", "test_predictions")}}
            print(f"  {name}: {runs[name]['steps_per_s']} steps/s", flush=True)
        out["speedup_vllm_vs_torch"] = round(runs["vllm"]["steps_per_s"] / runs["torch"]["steps_per_s"], 2)
        out["step_prediction_agreement"] = agreement(runs["vllm"]["predictions"], runs["torch"]["predictions"])
        out["test_prediction_agreement"] = test_agreement(runs["vllm"]["test_predictions"],
                                                          runs["torch"]["test_predictions"])
        # 2. the label trie after a full context, every test query, scored by both engines
        history = [EpisodeRecord(i, e.text, e.label, e.label, 1, 1) for i, e in
                   enumerate(task.training_stream(max_examples, 100))]
        context, user_open = render_context(policy.tokens, task.template, history, show_for(cfg))
        predictor = Predictor(policy, policy.tokens, task.template, task.labels, None, 1.0, engine=engines["torch"])
        requests = [predictor.request(context, render_query(policy.tokens, task.template, e.text, user_open))
                    for e in task.test_set(args.test_k, 100)]
        scores = {}
        for name, engine in engines.items():
            started = time.perf_counter()
            scored = engine.trie_logprobs(requests)
            scores[name] = [{n: v - np.logaddexp.reduce(v) for n, v in s.items()} for s in scored]
            out[f"trie_scoring_seconds_{name}"] = round(time.perf_counter() - started, 2)
        trie = predictor.trie
        greedy = {name: [trie.label_of_leaf[walk_scores(trie, s, lambda node, v: int(np.argmax(v)))]
                         for s in scored_] for name, scored_ in scores.items()}
        out["trie_scoring"] = {
            "queries": len(requests), "context_tokens": len(context), "context_episodes": len(history),
            "max_child_logprob_difference": float(max(np.max(np.abs(a[n] - b[n])) for a, b in
                                                      zip(scores["vllm"], scores["torch"]) for n in a)),
            "argmax_label_agreement": agreement(greedy["vllm"], greedy["torch"])}
        print(json.dumps({k: v for k, v in out.items() if k != "engines"}), flush=True)
    finally:
        vllm.close()
    out["load_avg"] = {"before": load_before, "after": os.getloadavg()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs (development)")
    parser.add_argument("--task", default="trec_coarse")
    parser.add_argument("--explorative-steps", type=int, default=200)
    parser.add_argument("--naive-steps", type=int, default=80,
                        help="naive steps (the port's full-phase steps cost ~10 s each on a busy core)")
    parser.add_argument("--evict", type=int, default=14, help="evict_episodes of the block-eviction variant")
    parser.add_argument("--test-every", type=int, default=25)
    parser.add_argument("--test-k", type=int, default=24)
    parser.add_argument("--port-test-k", type=int, default=2, help="test queries of the port (each recomputes "
                        "the whole prompt; its test predictions are not compared)")
    parser.add_argument("--aggregate-steps", type=int, default=100)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--aggregate-vllm", action="store_true", help="aggregate part: also the runs as streams of "
                        "one vLLM engine (needs the vllm extra)")
    parser.add_argument("--vllm-steps", type=int, default=100, help="harness steps per engine (--parts vllm)")
    parser.add_argument("--threads", type=int, default=2, help="torch/vLLM threads (--parts vllm)")
    parser.add_argument("--parts", nargs="+", default=["single", "aggregate"], choices=["single", "aggregate", "vllm"],
                        help="vllm: needs the vllm extra; not part of the default run")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--output", help="default: bench/results/inference_engine.json "
                        "(inference_engine_vllm.json / inference_engine_aggregate.json for --parts vllm / aggregate "
                        "alone)")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(json.loads(args.one))))
        return
    if args.quick:
        args.explorative_steps, args.naive_steps, args.aggregate_steps, args.vllm_steps = 40, 40, 20, 30
        args.test_every, args.test_k = 10, 8
    result = {"benchmark": "inference_engine", "task": args.task, "model": "smollm2-135m", "dtype": "float32",
              "context_window": 2048, "quick": args.quick,
              "threads_per_run": args.threads if args.parts == ["vllm"] else 1,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "note": "shared 2-core machine, other engineers' jobs running (see load averages)"},
              "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if "single" in args.parts:
        result["single_stream"] = single_stream(args)
    if "aggregate" in args.parts:
        result["aggregate"] = aggregate(args)
    if "vllm" in args.parts:
        result["vllm"] = vllm_vs_torch(args)
    if args.output is None:
        # a part run alone gets its own file, so it does not replace the others' results
        name = {("vllm",): "inference_engine_vllm.json", ("aggregate",): "inference_engine_aggregate.json"}.get(
            tuple(args.parts), "inference_engine.json")
        args.output = str(ROOT / "bench" / "results" / name)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    from icrl_core.io import atomic_write_json

    atomic_write_json(args.output, result)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

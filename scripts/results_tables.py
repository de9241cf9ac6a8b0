"""Result tables of the README and docs, generated from the JSON files the runs and benchmarks wrote.

    python scripts/results_tables.py            # rewrite every generated block in place
    python scripts/results_tables.py --check    # exit 1 if a block is stale (a test runs this)

A generated block sits between `<!-- generated:NAME -->` and `<!-- /generated:NAME -->` in a Markdown file; its
content is replaced by `BLOCKS[NAME]()`. Numbers live in the JSON files (bench/results/*.json, the experiments'
results.json, docs/results/*.json), never typed into the Markdown, so tables cannot drift from what was measured.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "experiments" / "icrl_skill" / "REPORT.md", ROOT / "docs" / "BENCHMARKS.md",
             ROOT / "docs" / "REPRODUCIBILITY.md", ROOT / "experiments" / "stream_rl_synthetic" / "REPORT.md",
             ROOT / "docs" / "ASYNC.md",
             ROOT / "experiments" / "icrl_stream_rl" / "REPORT.md", ROOT / "experiments" / "code_rl" / "README.md",
             ROOT / "docs" / "SANDBOX.md", ROOT / "experiments" / "critic" / "README.md"]
BLOCK = re.compile(r"(<!-- generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated:(?P=name) -->)", re.DOTALL)


def _json(relative: str) -> dict:
    return json.loads((ROOT / relative).read_text(encoding="utf-8"))


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _signed(value: float, digits: int = 3) -> str:
    return f"{value:+.{digits}f}"


def _signed_mean(value: float) -> str:
    """A mean of gains measured in steps of 0.005 (two seeds, 200 queries): four decimals where the fourth is
    not 0 (+0.0625, -0.0075), three otherwise, so it is not rounded to a number no seed gives."""
    text = f"{value:+.4f}"
    return text.removesuffix("0")


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------------
# The in-context RL skill experiment (experiments/icrl_skill/results.json)


def _runs(results: dict, model: str, strategy: str) -> dict[int, dict]:
    return {run["seed"]: run for run in results["runs"] if run["model"] == model and run["strategy"] == strategy}


def _final(run: dict) -> float:
    return run["test_accuracy"]["999"]


def skill_headline() -> str:
    """Step-999 test accuracy per model and strategy over the seeds, and the gain over the model's zero-shot."""
    results = _json("experiments/icrl_skill/results.json")
    rows = []
    for model in ("base", "trained"):
        zero = _runs(results, model, "zero_shot")
        for strategy in ("zero_shot", "naive", "explorative"):
            runs = _runs(results, model, strategy)
            if not runs:
                continue
            finals = [_final(runs[s]) for s in sorted(runs)]
            gains = [_final(runs[s]) - _final(zero[s]) for s in sorted(runs) if s in zero]
            rows.append([model, strategy.replace("_", "-"), ", ".join(str(s) for s in sorted(runs)),
                         " / ".join(_fmt(f) for f in finals), _fmt(statistics.mean(finals)),
                         "-" if strategy == "zero_shot" else _signed(statistics.mean(gains))])
    return _table(["model", "strategy", "seeds", "test accuracy at step 999 (per seed)", "mean",
                   "mean gain over own zero-shot"], rows)


def skill_curves() -> str:
    """Every run's test accuracy at each test step."""
    results = _json("experiments/icrl_skill/results.json")
    steps = [str(s) for s in results["test_steps"]]
    rows = []
    for run in results["runs"]:
        acc = run["test_accuracy"]
        rows.append([run["model"], run["strategy"].replace("_", "-"), str(run["seed"])]
                    + [_fmt(acc.get(s)) for s in steps]
                    + [_fmt(run.get("train_accuracy")), str(run.get("regret", "-"))])
    return _table(["model", "strategy", "seed", *(f"step {s}" for s in steps), "train accuracy", "regret"], rows)


def skill_forgetting() -> str:
    f = _json("experiments/icrl_skill/results.json")["forgetting"]
    low, high = f["probe_change_ci95"]
    return _table(["measure", "base", "trained", "change"], [
        [f"forgetting probe ({f['probe_items']} multiple-choice items)", _fmt(f["probe_base"]),
         _fmt(f["probe_trained"]), f"{f['probe_change'] * 100:+.1f} points (95% CI {low * 100:+.1f}..{high * 100:+.1f})"],
        [f"greedy general questions ({f['greedy_questions']})", _fmt(f["greedy_base"]), _fmt(f["greedy_trained"]),
         f"{(f['greedy_trained'] - f['greedy_base']) * 100:+.1f} points"],
    ])


def skill_feedback_probe() -> str:
    p = _json("experiments/icrl_skill/results.json")["feedback_probe"]
    return _table([f"p(`{p['target']}`)", *p["columns"]],
                  [[model, *(_fmt(v) for v in p[model])] for model in ("base", "trained")])


def _last(run: dict | None) -> float | None:
    return None if run is None else run["test_accuracy"][max(run["test_accuracy"], key=int)]


def _difference(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None else _signed(a - b)


def skill_recipe_rl() -> str:
    """The recipe's end-to-end run (collect_recipe.py --recipe): per strategy, the base model, the bootstrap and the
    RL adapter at the last test step, the RL adapter's curve, and the promotion outcome."""
    entry = _json("experiments/icrl_skill/results.json").get("recipe_rl")
    if not entry:
        return "Not collected yet: the end-to-end run has not finished.\n"
    rows = []
    for strategy in ("explorative", "naive", "zero_shot"):
        runs = {m: entry["runs"].get(f"{m}-{strategy}") for m in ("base", "start", "trained")}
        if runs["trained"] is None:
            continue
        acc = runs["trained"]["test_accuracy"]
        rows.append([strategy.replace("_", "-"), *(_fmt(_last(r)) if r else "" for r in runs.values()),
                     _difference(_last(runs["trained"]), _last(runs["start"])),
                     " / ".join(_fmt(acc[step]) for step in sorted(acc, key=int))])
    notes = []
    if "forgetting_probe_change" in entry:
        notes.append(f"forgetting probe, RL adapter - base: {entry['forgetting_probe_change'] * 100:+.1f} points")
    if "feedback_effect_n1_trained" in entry:
        notes.append("feedback probe, p(target | 1 marked right) - p(target | 1 marked wrong): RL adapter "
                     f"{_signed(entry['feedback_effect_n1_trained'])}, base {_signed(entry['feedback_effect_n1_base'])}")
    if "promote" in entry:
        notes.append(f"promote: alias `{entry['promote'].get('alias')}` (eligible: {entry['promote'].get('eligible')})")
    if "wall_minutes" in entry:
        parts = ", ".join(f"{stage} {minutes:g}" for stage, minutes in entry["stage_minutes"].items())
        notes.append(f"wall time {entry['wall_minutes']:g} minutes ({parts})")
    return (_table(["strategy", "base", "bootstrap (start)", "RL adapter", "RL - bootstrap",
                    "RL adapter at each test step"], rows)
            + ("\n" + "\n".join(f"- {n}" for n in notes) + "\n" if notes else ""))


def _paired_difference(accuracy: dict, paired: dict, first: str, second: str) -> str:
    """accuracy[first] - accuracy[second], with the paired standard error when the pair was collected."""
    text = _difference(accuracy[first], accuracy[second])
    pair = paired.get(f"{first}-{second}")
    return f"{text} ± {pair['standard_error']:.3f}" if text and pair else text


def skill_final_tests() -> str:
    """The final tests of addendum 39 (collect_recipe.py --final): per task, each model's explorative and
    zero-shot accuracy at the last test step, the explorative differences between models (with the paired standard
    error on the same test queries once both runs are collected), each model's explorative gain over its own
    zero-shot; then every run's test curve, its accuracy on its own training stream (the rewards it earned) and its
    minutes."""
    finals = _json("experiments/icrl_skill/results.json").get("final_tests", {})
    models = ("base", "start", "trained")
    rows, curves = [], []
    for task, entry in finals.items():
        explorative = {m: _last(entry["runs"].get(f"{m}-explorative")) for m in models}
        zero_shot = {m: _last(entry["runs"].get(f"{m}-zero_shot")) for m in models}
        paired = entry.get("paired", {}).get("explorative", {})
        rows.append([task, *(_fmt(v) for v in explorative.values()), *(_fmt(v) for v in zero_shot.values()),
                     *(_paired_difference(explorative, paired, first, second)
                       for first, second in (("trained", "start"), ("start", "base"), ("trained", "base"))),
                     " / ".join(_difference(explorative[m], zero_shot[m]) or "-" for m in models)])
        for name, run in sorted(entry["runs"].items()):
            curve = run["test_accuracy"]
            minutes = entry.get("run_minutes", {}).get(name)
            curves.append([task, name.replace("trained-", "RL-").replace("start-", "bootstrap-"),
                           " / ".join(_fmt(curve[step]) for step in sorted(curve, key=int)),
                           _fmt(run.get("train_accuracy")), "-" if minutes is None else f"{minutes:g}"])
    if not rows:
        return "No final test is collected yet.\n"
    return (_table(["task", "explorative: base", "bootstrap", "RL adapter", "zero-shot: base", "bootstrap",
                    "RL adapter", "RL - bootstrap (explorative)", "bootstrap - base", "RL - base",
                    "explorative - own zero-shot: base / bootstrap / RL"], rows)
            + "\n± is the paired standard error of the difference on the same 200 test queries (test noise of one "
              "seed, not the spread between seeds).\n\n"
            + _table(["task", "run", "test accuracy at each test step", "accuracy on its 1000-step stream",
                      "minutes"], curves))


# --------------------------------------------------------------------------------------------------------------
# Benchmarks (bench/results/*.json)


def bench_eval_speed() -> str:
    """KV-cache reuse vs recomputing every prompt (bench/icrl_eval_speed.py)."""
    data = _json("bench/results/icrl_eval_speed.json")
    rows = []
    for strategy, s in data["summary"].items():
        rows.append([strategy, f"{s['speedup_steps_per_s']:.2f}x", f"{s['growing_phase_speedup']:.2f}x",
                     f"{s['full_phase_speedup']:.2f}x", f"{s['test_eval_speedup']:.2f}x",
                     "yes" if s["identical_predictions"] else "no"])
    note = (f"{data['task']}, {data['steps']} steps, {data['context_window']}-token window, {data['dtype']}, "
            f"{data['threads']} thread per run, measured {data['finished'][:10]}.")
    return _table(["strategy", "steps/s vs recompute", "while the context grows", "once it is full",
                   "test evaluation", "identical predictions"], rows) + "\n" + note + "\n"


def bench_ppo_vs_trl() -> str:
    """One policy-optimisation iteration against TRL (bench/ppo_step.py)."""
    data = _json("bench/results/ppo_step.json")
    rows = [[r["variant"], r["update"], _fmt(r["seconds"], 2), _fmt(r["tokens_per_second"], 1),
             f"{r['peak_rss_mb']:.0f}"] for r in data["results"]]
    ratio = data["ratio"]
    return (_table(["variant", "update", "s / iteration", "tokens/s", "peak RSS MB"], rows)
            + f"\nicrl / TRL: tokens/s x{ratio['tokens_per_second_icrl_over_trl']:.2f}, "
            f"peak RSS x{ratio['peak_rss_icrl_over_trl']:.2f}.\n\n" + bench_grpo_vs_trl())


def bench_grpo_vs_trl() -> str:
    """One GRPO iteration against TRL's GRPOTrainer (bench/grpo_step.py)."""
    data = _json("bench/results/grpo_step.json")
    rows = [[r["variant"], _fmt(r["seconds"], 2), str(r["generated_tokens"] + r["trained_tokens"]),
             _fmt(r["tokens_per_second"], 1), f"{r['peak_rss_mb']:.0f}"] for r in data["results"]]
    ratio = data["ratio"]
    return ("GRPO, one iteration (bench/grpo_step.py; method in docs/STREAMS.md):\n\n"
            + _table(["variant", "s / iteration", "tokens", "tokens/s", "peak RSS MB"], rows)
            + "".join(f"\n{name} / TRL GRPOTrainer: tokens/s x{ratio[f'tokens_per_second_icrl{suffix}_over_trl']:.2f}, "
                      f"peak RSS x{ratio[f'peak_rss_icrl{suffix}_over_trl']:.2f} (goal {ratio['goal']}: "
                      f"{'met' if ratio[f'goal_met{suffix}'] else 'missed'})."
                      for name, suffix in (("icrl", ""), ("icrl-causal (model.right_padding_mask=false)", "_causal"),
                                           ("icrl-shared (model.share_prefix=true)", "_shared"))
                      if f"goal_met{suffix}" in ratio)
            + f"\nMeasured {data['environment']['timestamp'][:10]}, {data['settings']['torch_threads']} torch thread "
            f"per side, load average {data['environment']['load_average_at_end'][0]:.1f} at the end on the "
            f"{data['environment']['cpu_count']} cores.\n")


def bench_async_rollouts() -> str:
    """Asynchronous vs synchronous stream rollouts on the 2 CPUs (bench/async_rollouts.py); a one-line note while
    bench/results/async_rollouts.json has not been written."""
    if not (ROOT / "bench/results/async_rollouts.json").exists():
        return ("Not measured yet: run `.venv/bin/python bench/async_rollouts.py` (writes "
                "`bench/results/async_rollouts.json`, then `python scripts/results_tables.py` fills this table).\n")
    data = _json("bench/results/async_rollouts.json")
    rows = []
    for side in ("sync", "async"):
        r = data["results"][side]
        load = f"{r['load_average_before'][0]:.1f} -> {r['load_average_after'][0]:.1f}"
        rows.append([side, str(len(r["iterations"])), f"{r['wall_seconds']:.0f}", f"{r['loop_seconds']:.0f}",
                     f"{r['trainer_wait_seconds']:.0f}", f"{r['update_seconds']:.0f}",
                     "-" if r["actor_rollout_seconds"] is None else f"{r['actor_rollout_seconds']:.0f}",
                     _fmt(r["mean_reward"]), _fmt(r["final_reward"]), load])
    ratio, settings = data["ratio"], data["settings"]
    return (_table(["side", "iterations", "wall s", "loop s", "rollout wait s", "update s", "actor rollout s",
                    "mean reward", "final reward", "load avg"], rows)
            + f"\nsync / async: wall x{ratio['wall_sync_over_async']:.2f}, loop x{ratio['loop_sync_over_async']:.2f}; "
            f"the actor's rollouts took x{ratio['rollout_actor_over_sync']:.2f} the synchronous rollouts' time and "
            f"the trainer's updates x{ratio['update_async_over_sync']:.2f} the synchronous updates'. "
            f"{settings['model']} {settings['dtype']}, {settings['objective']}, {settings['groups']} groups x "
            f"{settings['group_size']} streams x {settings['steps']} steps per iteration, max_async_level "
            f"{settings['level']}, {settings['actors']} actor; measured {data['environment']['timestamp'][:10]}.\n")


def bench_inference_engine() -> str:
    """The harness on the inference engine vs a recompute-every-step port of the paper's protocol, the faster modes
    that change numerics, and aggregate throughput (bench/inference_engine.py; issue 30's acceptance)."""
    if not (ROOT / "bench/results/inference_engine.json").exists():
        return ("Not measured yet: run `.venv/bin/python bench/inference_engine.py` (writes "
                "`bench/results/inference_engine.json`, then `python scripts/results_tables.py` fills this table).\n")
    data = _json("bench/results/inference_engine.json")
    rows = []
    single = data.get("single_stream")
    if single:
        e = single["explorative"]
        rows.append(["explorative", "torch", "exact (fp32)", _fmt(e["engine_steps_per_s"], 3),
                     f"{e['speedup']:.2f}x", "identical" if e["identical_predictions"] else "differ", ">= 3x"])
        if "bf16" in e:
            b = e["bf16"]
            rows.append(["explorative", "torch", b["mode"], _fmt(b["steps_per_s"], 3), f"{b['speedup']:.2f}x",
                         f"{b['step_prediction_agreement_with_exact']:.3f}", ">= 3x"])
        n = single["naive"]
        for name in ("exact", "block_eviction", "block_eviction_bf16"):
            if name not in n:
                continue
            r = n[name]
            agree = ("identical" if r.get("identical_predictions_to_port") else "differ") if name == "exact" else \
                f"{r['step_prediction_agreement_with_exact']:.3f}"
            rows.append(["naive (projected to 1000 steps)", r["engine"], r["mode"],
                         _fmt(r["projected_1000_steps_per_s"], 3), f"{r['projected_1000_step_speedup']:.2f}x", agree,
                         ">= 3x"])
    agg, agg_note = data.get("aggregate"), ""
    agg_file = ROOT / "bench/results/inference_engine_aggregate.json"
    if agg is None and agg_file.exists():  # `--parts aggregate` run on its own
        agg_data = json.loads(agg_file.read_text(encoding="utf-8"))
        agg = agg_data["aggregate"]
        agg_note = (f" Aggregate rows: {agg['steps_per_run']} steps per run, seeds {agg['seeds'][0]}-{agg['seeds'][-1]}, "
                    f"{'quick runs, ' if agg_data['quick'] else ''}measured {agg_data['finished'][:10]} "
                    f"(`--parts aggregate{' --aggregate-vllm' if 'vllm' in agg else ''}`; each mode's wall time from "
                    f"its start to its last run's end, model loads and engine start-up included), load average "
                    f"{agg['pool']['load_avg']['before'][0]:.1f} before it.")
    if agg:
        for name in [n for n in ("streams", "fused", "vllm") if n in agg]:
            r = agg[name]
            rows.append([f"aggregate, {agg['runs']} explorative runs", "vllm" if name == "vllm" else "torch", r["mode"],
                         _fmt(r["aggregate_steps_per_s"], 3), f"{r['speedup_vs_pool']:.2f}x (vs the pool"
                         + (f"; steady {r['steady_speedup_vs_pool']:.2f}x" if "steady_speedup_vs_pool" in r else "")
                         + ")",
                         f"{r['step_prediction_agreement_with_pool']:.3f} (with the pool)", ">= 3x"])
    steps = ""
    if single:
        steps = (f"explorative {single['explorative']['runs'][0]['steps']} steps, naive "
                 f"{single['naive']['runs'][0]['steps']} ({single['naive']['max_examples']} while the window fills), ")
    vllm_file = ROOT / "bench/results/inference_engine_vllm.json"
    note = ""
    if vllm_file.exists():
        v = json.loads(vllm_file.read_text(encoding="utf-8"))["vllm"]
        note = (f" vLLM vs the torch engine (`--parts vllm`, {v['strategy']}, {v['steps']} steps, one after the other, "
                f"not side by side): {v['speedup_vllm_vs_torch']:.2f}x, per-step prediction agreement "
                f"{v['step_prediction_agreement']:.3f}.")
    return (_table(["measure", "engine", "mode", "steps/s", "vs the port", "prediction agreement", "target"], rows)
            + f"\n{data['task']}, {data['context_window']}-token window, {steps}one torch thread per run, the runs of a "
            f"part side by side; {'quick runs, ' if data['quick'] else ''}measured {data['finished'][:10]}.{note}"
            f"{agg_note}\n")



def bench_compute_ceiling() -> str:
    """How close the exact naive step is to the core's matrix-multiply rate (bench/compute_ceiling.py)."""
    if not (ROOT / "bench/results/compute_ceiling.json").exists():
        return ("Not measured yet: run `.venv/bin/python bench/compute_ceiling.py` (writes "
                "`bench/results/compute_ceiling.json`, then `python scripts/results_tables.py` fills this table).\n")
    data = _json("bench/results/compute_ceiling.json")
    rows = [[name, f"{r['matmul']['gflop_per_s']:.0f}", f"{r['forward_gflop']:.0f}", f"{r['forward_seconds']:.2f}",
             f"{r['utilization']:.0%}", f"{r['fastest_step_seconds']:.2f}", f"{r['ceiling_vs_float32_recompute']:.2f}x",
             f"{r['two_naive_runs_on_all_cores_lower_bound_min']:.0f}"]
            for name, r in data["dtypes"].items()]
    machine = data["machine"]
    return (_table(["dtype", "matmul GFLOP/s (1 thread)", "GFLOP per full-window step", "step seconds (recompute)",
                    "of the matmul rate", "fastest exact step at the matmul rate (s)",
                    "ceiling of any exact method vs recomputing in float32",
                    f"two naive runs' {data['full_window_steps']} full-window steps, all cores, at the matmul rate "
                    "(min)"], rows)
            + f"\n{data['tokens_per_step']} window tokens per step (the port's full-phase mean), one torch thread, "
            f"{machine['cpu']}, {machine['cpus']} cores, load average {machine['load_avg_before'][0]:.1f} before; "
            f"{'quick, ' if data['quick'] else ''}measured {data['finished'][:10]}.\n")

def bench_stream_rollouts() -> str:
    """Who decodes stream rollouts: the policy's own cache, the torch engine, vLLM (bench/stream_rollouts.py)."""
    if not (ROOT / "bench/results/stream_rollouts.json").exists():
        return ("Not measured yet: run `.venv/bin/python bench/stream_rollouts.py` on an idle machine (writes "
                "`bench/results/stream_rollouts.json`, then `python scripts/results_tables.py` fills this table).\n")
    data = _json("bench/results/stream_rollouts.json")
    names = {"policy": "policy (its own KV cache, the default)", "torch": "torch engine (exact)", "vllm": "vLLM"}
    rows = []
    for way, r in data["ways"].items():
        if "skipped" in r:
            rows.append([names[way], "-", "-", "-", "-", r["skipped"]])
            continue
        agree = "-" if r["answer_agreement_with_policy"] is None else \
            f"{r['answer_agreement_with_policy']:.3f} ({r['steps_compared']} steps)"
        rows.append([names[way], _fmt(r["seconds_per_group"], 2), _fmt(r["decisions_per_s"], 2),
                     f"{r.get('speedup_vs_policy', 1.0):.2f}x", f"{r['startup_seconds']:.0f} s", agree])
    return (_table(["ppo.stream.engine", "s / group", "decisions/s", "vs policy", "start-up", "answers as the policy's"],
                   rows)
            + f"\n{data['streams']} streams x {data['steps']} steps per group, {data['rounds']} timed groups after a "
            f"warm-up, {data['task']}, SmolLM2-135M {data['dtype']}, {data['threads']} torch threads, one way after "
            f"the other; load average {data['machine']['load_avg_before'][0]:.1f} before; "
            f"{'quick run, ' if data['quick'] else ''}measured {data['finished'][:10]}.\n")

def bench_stream_update() -> str:
    """The explorative-view update pass, activations stored vs recomputed (bench/stream_update.py)."""
    if not (ROOT / "bench/results/stream_update.json").exists():
        return ("Not measured yet: run `.venv/bin/python bench/stream_update.py` on an idle machine (writes "
                "`bench/results/stream_update.json`, then `python scripts/results_tables.py` fills this table).\n")
    data = _json("bench/results/stream_update.json")
    names = {"stored": "activations stored (default)", "recompute": "model.gradient_checkpointing: true"}
    rows = [[names[r["variant"]], str(r["rows"]), f"{r['real_tokens']} ({r['padded_tokens']} padded)",
             _fmt(r["forward_seconds"], 1), _fmt(r["backward_seconds"], 1), f"{r['saved_for_backward_mb']:.0f}",
             f"{r['peak_rss_mb']:.0f}"] for r in data["results"]]
    ratio, agree, first = data["ratio"], data["agreement"], data["results"][0]
    return (_table(["update pass", "rows", "tokens", "forward s", "backward s", "kept for backward MB",
                    "peak RSS MB"], rows)
            + f"\n{first['streams']} explorative streams x {first['steps']} steps of banking77 (2-6 labels, p_keep "
            f"0.5), {first['model']} fp32, LoRA r=16, {first['threads']} torch threads, each side in its own "
            f"process; recompute / stored: {ratio['saved_for_backward_recompute_over_stored']:.2f}x kept for "
            f"backward, {ratio['peak_rss_recompute_over_stored']:.2f}x peak RSS, "
            f"{ratio['seconds_recompute_over_stored']:.2f}x seconds; the sides' log-probs differ by at most "
            f"{agree['max_abs_logp_difference']:.1e}, their LoRA gradients by "
            f"{agree['max_relative_gradient_difference']:.1e} (relative); measured {data['measured']}.\n")


# --------------------------------------------------------------------------------------------------------------
# The demo (docs/results/demo.json: what `icrl demo` wrote to metrics/demo.json on a measured run)


def _demo() -> dict | None:
    """docs/results/demo.json, or None while no demo run of the current recipe has been measured."""
    return _json("docs/results/demo.json") if (ROOT / "docs/results/demo.json").exists() else None


def demo_summary() -> str:
    demo = _demo()
    if demo is None:
        return ("No measured run of the current demo recipe is recorded yet (`docs/results/demo.json`): `make demo` "
                "prints each stage's headline numbers, then base vs trained in-context RL accuracy on the held-out "
                "rule and the general-ability check, and writes them to `metrics/demo.json`.\n")
    return ("```\n" + "\n".join(demo["printed"]) + "\n```\n\n"
            + f"Measured {demo['measured']} at `{demo['commit'][:7]}`, {demo['machine']}: "
            f"{demo['wall_minutes']:.1f} minutes ({demo['load']}); `model.dtype` pinned to float32.\n")


# --------------------------------------------------------------------------------------------------------------
# The README's headline


def _distillation_headline() -> list[str] | None:
    """Issue 29's context distillation as a headline row, once every seed has both students' naive runs."""
    measured = _json("experiments/icrl_stream_rl/results.json").get("context_distillation") or {}
    seeds = measured.get("seeds") or {}
    finals = {arm: [_final(arms[arm]["runs"]["trained-naive"]) for arms in seeds.values() if arm in arms]
              for arm in ("plain", "distill")}
    if len(seeds) < 3 or any(len(values) != len(seeds) for values in finals.values()):
        return None
    forgetting = measured["students"]["distill"]["forgetting"]["probe_1509_items"]["change"]
    plain, distill = statistics.mean(finals["plain"]), statistics.mean(finals["distill"])
    return [f"[context distillation](experiments/icrl_stream_rl/REPORT.md#distillation-parts), held-out TREC "
            f"coarse, naive, step 999 ({len(seeds)} seeds): plain vs distilled student", _fmt(plain),
            _fmt(distill), f"{distill - plain:+.3f}, {measured['decision']['verdict']}; forgetting "
            f"{forgetting * 100:+.1f} points"]


def readme_headline() -> str:
    skill = _json("experiments/icrl_skill/results.json")
    demo = (_demo() or {}).get("headline")
    speed = _json("bench/results/icrl_eval_speed.json")["summary"]
    trl = _json("bench/results/ppo_step.json")["ratio"]
    grpo = _json("bench/results/grpo_step.json")["ratio"]

    def mean_final(model: str, strategy: str) -> tuple[float, int]:
        runs = _runs(skill, model, strategy)
        return statistics.mean(_final(r) for r in runs.values()), len(runs)

    base_x, n_x = mean_final("base", "explorative")
    trained_x, _ = mean_final("trained", "explorative")
    gain = statistics.mean(_final(r) - _final(_runs(skill, "trained", "zero_shot")[s])
                           for s, r in _runs(skill, "trained", "explorative").items())
    base_n, n_n = mean_final("base", "naive")
    trained_n, _ = mean_final("trained", "naive")
    forgetting = skill["forgetting"]
    rows = [
        [f"in-context RL on held-out TREC coarse, explorative, step 999 (mean of {n_x} seeds)", _fmt(base_x),
         _fmt(trained_x), f"{gain:+.3f} over the trained model's own zero-shot"],
        [f"in-context RL on held-out TREC coarse, naive, step 999 ({n_n} seed)", _fmt(base_n), _fmt(trained_n),
         "both collapse onto one label"],
        [f"forgetting probe ({forgetting['probe_items']} multiple-choice items)", _fmt(forgetting["probe_base"]),
         _fmt(forgetting["probe_trained"]), f"{forgetting['probe_change'] * 100:+.1f} points (limit 2)"],
    ]
    if demo:
        rows.append([f"demo: {demo['task']}, step {demo['step']}", _fmt(demo["base"]), _fmt(demo["trained"]),
                     f"{demo['trained'] - demo['base']:+.3f}; general-ability check {_fmt(demo['base_general'])} -> "
                     f"{_fmt(demo['trained_general'])}"])
    code_path = ROOT / "experiments/code_rl/results.json"
    if code_path.exists():
        code = _json("experiments/code_rl/results.json")
        base_code = code["evaluations"]["base"]["greedy"]["overall"]["pass_at_1"]
        for name, training in code["trainings"].items():
            found = code["evaluations"].get(name)
            if not (training and found):
                continue
            rows.append([f"[code tasks](experiments/code_rl/README.md), held-out pass@1: "
                         f"{name.split('-')[0].upper()}, {training['iterations']} steps ({'>= ' if training.get('wall_partial') else ''}{training['wall_seconds'] / 60:.0f} min), "
                         f"seed {name.split('-')[1]}",
                         _fmt(base_code), _fmt(found["greedy"]["overall"]["pass_at_1"]),
                         "improves" if code["decisions"][name]["improves_held_out_pass_at_1"] else "within noise"])
    critic_path = ROOT / "experiments/critic/results_run2.json"
    if critic_path.exists():
        run2 = _json("experiments/critic/results_run2.json")
        critic = run2["critic"]
        rows.append([f"[in-context critic](experiments/critic/README.md) on keyword_map ({critic['step']:.0f} steps, "
                     f"{run2['critic']['wall_seconds'] / 60:.0f} min; AUC {critic['val_auc']:.2f}): reward, "
                     f"{critic['q_samples_per_prompt']:.0f} samples per held-out prompt, plain vs Q-weighted",
                     _fmt(critic["plain_sampling_reward"]), _fmt(critic["q_weighted_reward"]),
                     f"{critic['q_minus_plain']:+.3f} [{critic['q_minus_plain_low']:+.3f}, "
                     f"{critic['q_minus_plain_high']:+.3f}]"])
    distilled = _distillation_headline()
    if distilled:
        rows.append(distilled)
    speed_line = (f"Speed: exact KV-cache reuse runs explorative in-context RL at {speed['explorative']['speedup_steps_per_s']:.2f}x "
                  f"and naive at {speed['naive']['speedup_steps_per_s']:.2f}x the steps/s of recomputing every prompt "
                  f"(identical predictions); one policy-optimisation iteration runs at "
                  f"{trl['tokens_per_second_icrl_over_trl']:.2f}x TRL's tokens/s with {trl['peak_rss_icrl_over_trl']:.2f}x "
                  f"its peak memory (PPO), and one GRPO iteration at {grpo['tokens_per_second_icrl_over_trl']:.2f}x "
                  f"TRL GRPOTrainer's tokens/s with {grpo['peak_rss_icrl_over_trl']:.2f}x its peak memory"
                  + (f" ({grpo['tokens_per_second_icrl_shared_over_trl']:.2f}x and "
                     f"{grpo['peak_rss_icrl_shared_over_trl']:.2f}x with `model.share_prefix`)."
                     if "tokens_per_second_icrl_shared_over_trl" in grpo else "."))
    async_path = ROOT / "bench/results/async_rollouts.json"
    if async_path.exists():
        sides = _json("bench/results/async_rollouts.json")["results"]
        sync, async_ = sides["sync"], sides["async"]
        speed_line += (f" [Async stream rollouts](docs/ASYNC.md) (Ray actors) vs sync, same seeds and "
                       f"budget: wall {async_['wall_seconds']:.0f} s vs {sync['wall_seconds']:.0f} s "
                       f"(x{sync['wall_seconds'] / async_['wall_seconds']:.2f} faster), final reward "
                       f"{_fmt(async_['final_reward'])} vs {_fmt(sync['final_reward'])}.")
    return _table(["measure", "base SmolLM2-135M", "trained", "note"], rows) + "\n" + speed_line + "\n"


def timings() -> str:
    data = _json("docs/results/timings.json")
    rows = [[t["what"], f"{t['minutes']:.1f} min", t["result"], t["date"], f"`{t['commit']}`", t["load"], t["cpu"]]
            for t in data["timings"]]
    return _table(["command", "wall time", "result", "date", "commit", "load", "CPU"], rows)


# --------------------------------------------------------------------------------------------------------------
# Short stream-RL runs on the synthetic task (experiments/stream_rl_synthetic/results.json)


def stream_rl_synthetic() -> str:
    results = _json("experiments/stream_rl_synthetic/results.json")
    rows = [[r["objective"], str(r["seed"]), _fmt(r["initial_val_reward"]), _fmt(r["final_val_reward"]),
             _signed(r["change"]), f"{r['initial_val_switch_after_wrong']:.2f} -> {r['final_val_switch_after_wrong']:.2f}",
             f"{r['wall_seconds'] / 60:.1f}"] for r in results["runs"]]
    table = _table(["objective", "seed", "validation stream reward, iteration 0", "after 10", "change",
                    "switch after a wrong answer", "wall min"], rows)
    verdicts = []
    for kind, d in results["decisions"].items():
        what = "validation preference accuracy" if kind == "dpo" else "mean stream reward"
        held = d.get("raises_val_preference_accuracy", d.get("raises_mean_stream_reward"))
        verdicts.append(f"{kind.upper()}: {d['positive_seeds']} of {d['seeds']} seeds positive, mean change "
                        f"{_signed(d['mean_change'])}: "
                        + (f"raises {what} (the pre-registered rule)." if held
                           else "not shown (the pre-registered rule needs 2 of 3 seeds positive and a positive "
                                "mean)."))
    text = table
    if results.get("dpo_runs"):
        text += "\n" + _table(["DPO seed", "validation preference accuracy before", "after", "change", "wall min"],
                              [[str(r["seed"]), _fmt(r["val_preference_accuracy_before"]),
                                _fmt(r["val_preference_accuracy_after"]), _signed(r["change"]),
                                f"{r['wall_seconds'] / 60:.1f}"] for r in results["dpo_runs"]])
    return text + "\n" + "\n".join(f"- {v}" for v in verdicts) + "\n"


def stream_rl_gate() -> str:
    """Gate 1 of experiments/icrl_stream_rl: the feedback probe of each setting's RL adapter beside the bootstrap."""
    results = _json("experiments/icrl_stream_rl/results.json")
    contexts = ("n0", "n1_wrong", "n1_right", "n4_wrong", "n4_right")
    boot = results["bootstrap_probe"]
    def gold(probe: dict) -> str:  # p(gold label): no context -> after 1 attempt marked wrong
        return f"{probe['p_gold']['n0']:.3f} -> {probe['p_gold']['n1_wrong']:.3f}"

    def verdict(s: dict) -> str:  # gate 1's, or the probe check's that replaced it (settings 29-31)
        if "check_p" in s:
            return (f"check P (>= {s['check_p']['least_effect']:+.2f}) "
                    f"{'passed' if s['check_p']['passed'] else 'failed'}")
        return "passed" if s["gate1_passed"] else "failed"

    rows = [["bootstrap (start)", *(_fmt(boot["p_target"][c]) for c in contexts), gold(boot), "", "", ""]]
    loss_names = {"dpo": "DPO", "contrast": "contrast loss", "rank": "rank loss", "rank_contrast": "rank + contrast loss"}
    for name, s in results["settings"].items():  # in setting order (collect.py writes them so)
        v = s["validation_training_tasks"]
        label = f"{s['iterations']} iterations" + (f" {s['lineage']}" if s.get("lineage") else "")
        if "val_couple_accuracy" in v:  # settings 4-10 (PREREGISTERED.md addenda 4, 5, 7-10)
            loss = s.get("hindsight_loss", "dpo" if name == "4" else "contrast")  # recorded from setting 9 on
            label += f", {loss_names[loss]} on hindsight couples"
        stream = (f"{v['val_reward'][0]:.2f} -> {v['val_reward'][1]:.2f}; switch {v['val_switch_after_wrong'][0]:.2f}"
                  f" -> {v['val_switch_after_wrong'][1]:.2f}")
        if "val_couple_accuracy" in v:  # 0 for a feedback-blind policy
            stream += f"; couples both right {v['val_couple_accuracy'][0]:.2f} -> {v['val_couple_accuracy'][1]:.2f}"
        if "val_hindsight_margin" in v:  # mean contrast m per couple (beta 1)
            stream += f"; contrast m {v['val_hindsight_margin'][0]:.2f} -> {v['val_hindsight_margin'][1]:.2f}"
        gap = _signed(s["gate1_gap"])
        if "gap_ci95" in s["probe"]:  # 95% paired bootstrap interval over the probe's queries
            gap += " [" + ", ".join(_signed(x) for x in s["probe"]["gap_ci95"]) + "]"
        rows.append([f"setting {name} ({label})", *(_fmt(s["probe"]["p_target"][c]) for c in contexts),
                     gold(s["probe"]), gap, verdict(s), stream])
    return (_table([f"p(`{boot['target']}`) on {boot['task']}", "no context", "1 attempt marked wrong",
                    "1 marked right", "4 marked wrong", "4 marked right",
                    "p(gold): no context -> 1 marked wrong", "right - wrong (n=1)",
                    f"gate 1 (>= {results['gate1_margin']})", "validation streams of the training tasks: reward"],
                   rows)
            + f"\n{boot['queries']} queries, seed {boot['seed']}, {boot['dtype']}; [interval]: 95% paired bootstrap "
            "over the queries (settings 4-8 rerun with per-query numbers: same means; settings 1-3 stored only means).\n")


def stream_rl_ablation() -> str:
    """The objective ablation of experiments/icrl_stream_rl (addendum 15): each arm's gate-1 probe, its validation
    streams on the training tasks over its iterations, and its compute."""
    results = _json("experiments/icrl_stream_rl/results.json")
    arms = results.get("ablation", {})
    if not arms:
        return "No arm has finished yet.\n"
    names = {"ppo": "PPO", "grpo": "GRPO", "rloo": "RLOO", "dpo_rank": "DPO-rank"}
    rows = []
    for arm, a in arms.items():
        p, gap = a["probe"], _signed(a["gate1_gap"])
        gap4 = _signed(p["p_target"]["n4_right"] - p["p_target"]["n4_wrong"])
        if "gap_ci95" in p:
            gap += " [" + ", ".join(_signed(x) for x in p["gap_ci95"]) + "]"
        if "gap4_ci95" in p:
            gap4 += " [" + ", ".join(_signed(x) for x in p["gap4_ci95"]) + "]"
        reward = ", ".join(f"{r['val_reward']:.2f}" for r in a["validation_training_tasks"])
        switch = ", ".join(f"{r['val_switch_after_wrong']:.2f}" for r in a["validation_training_tasks"])
        c = a["compute"]
        tokens = "-" if c["update_tokens"] is None else f"{c['update_tokens'] / 1e6:.2f} M"
        wall = "-" if c["loop_seconds"] is None else f"{c['loop_seconds'] / 60:.0f} min"
        rows.append([names.get(arm, arm), _fmt(p["p_target"]["n0"]), _fmt(p["p_gold"]["n0"]),
                     _fmt(p["p_target"]["n1_wrong"]), _fmt(p["p_target"]["n1_right"]), gap, gap4,
                     "passed" if a["gate1_passed"] else "failed", reward, switch, tokens, wall])
    first = next(iter(arms.values()))
    steps = ", ".join(str(r["iteration"]) for r in first["validation_training_tasks"])
    return (_table(["arm (50 iterations from the bootstrap)", f"p(`{first['probe']['target']}`): no context",
                    "p(gold): no context", "1 attempt marked wrong", "1 marked right", "right - wrong (n=1)",
                    "right - wrong (n=4)",
                    f"gate 1 (>= {results['gate1_margin']})", f"validation stream reward at iterations {steps}",
                    "switch rate after a wrong answer", "update forward tokens", "loop wall time"], rows)
            + f"\nProbe: {first['probe']['task']}, {first['probe']['queries']} queries, seed {first['probe']['seed']}, "
            f"{first['probe']['dtype']}; [interval]: 95% paired bootstrap over the queries. Validation: the training "
            "tasks' validation streams (the same draws at every evaluation). Wall time: the iterations' rollout and "
            "update seconds summed from the history (resumes excluded), on the 2 cores.\n")


def stream_rl_distillation() -> str:
    """Issue 29's context-distillation measurement (experiments/icrl_stream_rl, addendum 27): the two students
    (gate-1 probe beside the settings' recorded gaps, forgetting, training), then the naive test curves of the plain
    and the distilled student per seed, the bootstrap and the base model beside them, and the decision."""
    results = _json("experiments/icrl_stream_rl/results.json")
    measured = results.get("context_distillation")
    if not measured or not (measured.get("seeds") or measured.get("students")):
        return "Not run yet (pre-registered in addendum 27).\n"

    def curve(run: dict | None) -> str:
        if run is None:
            return "-"
        return " / ".join(f"{run['test_accuracy'][k]:.3f}" for k in sorted(run["test_accuracy"], key=int))

    def change(measure: dict | None) -> str:
        if measure is None:
            return "-"
        low, high = measure["ci95"]
        return (f"{measure['base']:.3f} -> {measure['trained']:.3f} "
                f"({measure['change'] * 100:+.1f} points [{low * 100:+.1f}, {high * 100:+.1f}])")

    out = ""
    setting_of = {"plain": "1", "distill": "2"}
    student_rows = []
    for arm, student in measured.get("students", {}).items():
        probe, forgetting = student.get("probe"), student.get("forgetting", {})
        training = student.get("training", {})
        recorded = results.get("settings", {}).get(setting_of.get(arm, ""), {}).get("gate1_gap")
        gap = None if probe is None else probe["p_target"]["n1_right"] - probe["p_target"]["n1_wrong"]
        validation = training.get("validation_training_tasks")
        seconds = training.get("compute", {}).get("loop_seconds")
        student_rows.append([
            f"{arm} (setting {setting_of.get(arm, '?')})",
            "-" if probe is None else f"{probe['p_target']['n1_wrong']:.3f} / {probe['p_target']['n1_right']:.3f}",
            "-" if gap is None else _signed(gap) + ("" if recorded is None else f" (setting: {_signed(recorded)})"),
            change(forgetting.get("probe_1509_items")), change(forgetting.get("greedy_197_questions")),
            "-" if not validation else (f"{validation[0]['val_reward']:.2f} -> {validation[-1]['val_reward']:.2f}; "
                                        f"switch {validation[0]['val_switch_after_wrong']:.2f} -> "
                                        f"{validation[-1]['val_switch_after_wrong']:.2f}"),
            "-" if seconds is None else f"{seconds / 60:.0f} min"])
    if student_rows:
        out += _table(["student", "p(`entity`) after 1 attempt marked wrong / right", "right - wrong (gate 1)",
                       "forgetting probe (1509 items)", "greedy check (197 questions)",
                       "validation streams of the training tasks: reward", "training wall"], student_rows)
    if not measured.get("seeds"):
        return out + "\nThe evaluation parts on held-out trec_coarse have not run yet.\n"
    rows = []
    for seed, arms in measured["seeds"].items():
        any_arm = next(iter(arms.values()))["runs"]
        rows.append([seed, curve(arms.get("plain", {}).get("runs", {}).get("trained-naive")),
                     curve(arms.get("distill", {}).get("runs", {}).get("trained-naive")),
                     curve(any_arm.get("start-naive")), curve(any_arm.get("base-naive")),
                     _signed(measured["decision"]["differences"][seed])
                     if seed in measured["decision"]["differences"] else "-"])
    d = measured["decision"]
    return (out + ("\n" if out else "")
            + _table(["seed", "plain student (naive, steps 0/249/499/749/999)", "distilled student",
                      "bootstrap", "base model", "distilled - plain at 999"], rows)
            + f"\nDecision (addendum 27: positive on all three seeds and mean >= 0.05): mean "
            f"{'-' if d['mean'] is None else _signed(d['mean'])}, **{d['verdict']}**.\n")


REPEATS_HEAD = "repeat after wrong base / start / RL (>= 0.95: collapsed)"


def _repeats(runs: dict) -> str:
    """Each run's repeat_after_wrong (icrl_core.icrl_eval.repeat_rates, recorded by collect_gate2.stream_behaviour):
    near 1.0 the run copied one answer whatever the reward, and its accuracy is that label's test share."""
    return " / ".join(_fmt((r or {}).get("behaviour", {}).get("repeat_after_wrong"), 2) for r in runs.values())


def stream_rl_gate2() -> str:
    """Gate 2 of experiments/icrl_stream_rl: held-out trec_coarse test accuracy of the RL adapter, the bootstrap it
    started from and the base model, per seed (collect_gate2.py), and the pre-registered decision."""
    results = _json("experiments/icrl_stream_rl/results.json").get("gate2", {})
    rows, notes = [], []
    for setting, gate in results.items():
        for seed, row in gate["seeds"].items():
            for strategy in ("explorative", "naive", "zero_shot"):
                runs = {m: row["runs"].get(f"{m}-{strategy}") for m in ("base", "start", "trained")}
                if runs["trained"] is None:
                    continue
                steps = sorted(runs["trained"]["test_accuracy"], key=int)
                curve = " / ".join(_fmt(runs["trained"]["test_accuracy"][s], 3) for s in steps)
                last = steps[-1]
                cells = [_fmt(r["test_accuracy"][last]) if r else "" for r in runs.values()]
                diff = (_signed(runs["trained"]["test_accuracy"][last] - runs["start"]["test_accuracy"][last])
                        if runs["start"] else "")
                rows.append([setting, seed, strategy.replace("_", "-"), *cells, diff, _repeats(runs), curve])
        for strategy in ("explorative", "naive"):
            d = gate["decision"][strategy]
            mean = _signed(d["mean"]) if d["mean"] is not None else "n/a"
            notes.append(f"setting {setting}, {strategy}: RL - bootstrap at the last step, mean of "
                         f"{len(d['differences'])} seed(s) {mean}: **{d['verdict']}**")
        notes.append(f"setting {setting}: gate 2 **{gate['decision']['gate2']}** (needs naive or explorative "
                     "positive on all three seeds and a mean of at least +0.05)")
    if not rows:
        return "No gate-2 run is collected yet.\n"
    return (_table(["setting", "seed", "strategy", "base", "bootstrap (start)", "RL adapter", "RL - bootstrap",
                    REPEATS_HEAD, "RL adapter's test accuracy at each test step"], rows)
            + "\n" + "\n".join(f"- {n}" for n in notes) + "\n")


def stream_rl_gate_e() -> str:
    """The development gates of experiments/icrl_stream_rl (collect_gate_e.py): test accuracy on trec_coarse in the
    gate's strategy (explorative; naive for gate N18) at the development seed of the RL adapter, the bootstrap it
    started from and the base model, and each setting's pre-registered rule."""
    results = _json("experiments/icrl_stream_rl/results.json").get("gate_e", {})
    rows = []
    for setting, gate in results.items():
        strategy = gate.get("strategy", "explorative")
        runs = {m: gate["runs"].get(f"{m}-{strategy}") for m in ("base", "start", "trained")}
        curves = []
        for run in runs.values():
            steps = sorted(run["test_accuracy"], key=int) if run else []
            curves.append(" / ".join(_fmt(run["test_accuracy"][s], 3) for s in steps) if run else "not run yet")
        reward = " / ".join(_fmt(r["train_accuracy"], 3) if r else "-" for r in runs.values())
        d = gate["decision"]
        rule = d.get("rule") or (f"test gain >= {_signed(d['min_test_gain'])}" if "min_test_gain" in d
                                 else "stream reward gain >= +0.03 and test gain >= 0")  # setting 15's, before 16's
        trained, start = runs["trained"], runs["start"]
        gains, late = "", "-"
        if trained and start:  # this seed's own gains (a several-seed rule decides on their mean, below)
            test = trained["test_accuracy"][max(trained["test_accuracy"], key=int)]
            test -= start["test_accuracy"][max(start["test_accuracy"], key=int)]
            gains = f"{_signed(test)} (stream reward {_signed(trained['train_accuracy'] - start['train_accuracy'])})"
            late = _late_mean_gain(trained["test_accuracy"], start["test_accuracy"])
        if "not_run" in d:  # decided by a seed that is not positive before the others ran
            detail = f" (seed {', '.join(map(str, d['not_run']))} not run yet)"
        else:
            parts = [f"mean {_signed_mean(d['test_gain'])}"] if "test_gains" in d else []
            if "level" in d:  # a rule on the adapter's own late accuracy (setting 27's start and gate E27)
                parts.append(f"own late accuracy {_fmt(d['level'], 3)}")
            detail = f" ({'; '.join(parts)})" if parts else ""
        verdict = f"{rule}: **{d['verdict']}**{detail}" if not d["verdict"].startswith("reported") else d["verdict"]
        rows.append([setting.split("@")[0], str(gate["seed"]), strategy, *curves, reward, _repeats(runs), gains,
                     verdict, late])
    if not rows:
        return "No gate-E run is collected yet.\n"
    return (_table(["setting", "seed", "strategy", "base (test accuracy at each test step)", "bootstrap (start)",
                    "RL adapter", "training-stream reward base / start / RL", REPEATS_HEAD,
                    "RL - bootstrap at the last step",
                    "rule", "RL - bootstrap, mean over test steps 499-999"], rows)
            + "\nThe last column was first read after setting 25's gate had run (post hoc for settings 15-25): one test "
              "step's gain moves by up to 0.1 between adjacent steps of a run, the mean over the late steps less. "
              "Setting 26's rule uses it (addendum 44, fixed before its runs). Rows `27-start`: setting 27's start, "
              "the 25-step bootstrap, in the RL-adapter column and the H32 bootstrap as its start (addendum 45).\n")


def stream_rl_label_coverage() -> str:
    """experiments/icrl_stream_rl/label_coverage.py's records: per model and development seed, the share of test
    queries whose gold label the test step's context lacks and the accuracy on them and on the rest."""
    records = _json("experiments/icrl_stream_rl/results.json").get("label_coverage", {})
    if not records:
        return "No label-coverage record yet.\n"
    rows = []
    for name, record in records.items():
        for seed, steps in record["runs"].items():
            rows.append([name, seed, *(" / ".join(_fmt(steps[s][key], 2) for s in sorted(steps, key=int))
                                       for key in ("absent_share", "accuracy_absent", "accuracy_present"))])
        pooled = record["pooled"]
        rows.append([name, "pooled", "", *(f"{pooled[p]['right']} / {pooled[p]['queries']}"
                                          for p in ("absent", "present"))])
    return _table(["model", "seed", "share of test queries whose label the context lacks (steps 499 / 749 / 999)",
                   "accuracy on them", "accuracy on the others"], rows)


def _late_mean_gain(trained: dict, start: dict, first: int = 499, last: int = 999) -> str:
    """The RL adapter's test-accuracy gain over the bootstrap averaged over the test steps first..last that both
    runs measured ("-" for a run that stopped before `last`, e.g. setting 15's 500-step gate)."""
    steps = [s for s in trained if first <= int(s) <= last and s in start]
    if str(last) not in steps:
        return "-"
    return _signed(sum(trained[s] - start[s] for s in steps) / len(steps))


def stream_rl_learnability() -> str:
    """Addendum 6 of experiments/icrl_stream_rl: the hindsight-couple contrast on fixed couples (learnability.json)."""
    data = _json("experiments/icrl_stream_rl/learnability.json")
    rows = []
    for run in data["runs"]:
        for row in run["history"]:
            if "train" not in row:
                continue
            t, v = row["train"], row["val"]
            rows.append([f"{run['learning_rate']:g}", str(row["step"]), _fmt(t["mean_contrast_m"], 2),
                         _fmt(t["share_m_positive"], 2), _fmt(t["pair_accuracy"], 2), _fmt(v["mean_contrast_m"], 2),
                         _fmt(v["share_m_positive"], 2), _fmt(v["pair_accuracy"], 2)])
    return (_table(["lr", "step", "training couples: mean m", "m > 0", "pairs preferred", "validation couples: mean m",
                    "m > 0", "pairs preferred"], rows)
            + f"\n{data['train_couples']} training couples (fixed), {data['val_couples']} validation couples; "
            f"{data['loss']} loss, beta {data['beta']}; a feedback-blind policy has m = 0 and prefers half the pairs.\n")


def code_rl() -> str:
    """The pre-registered short GRPO and DPO runs on the code tasks (experiments/code_rl/results.json)."""
    path = ROOT / "experiments/code_rl/results.json"
    if not path.exists():
        return "Not run yet: `experiments/code_rl/run.sh`, then `experiments/code_rl/collect.py`.\n"
    results = _json("experiments/code_rl/results.json")
    rows = []
    for name, found in results["evaluations"].items():
        if found is None:
            continue
        greedy, sampled = found["greedy"], found["sampled"]
        training = results["trainings"].get(name) or {}
        components = training.get("components", {})
        passed = components.get("task_accuracy") or components.get("reward/pass_fraction") or {}
        moved = (f"{passed['first_3']:.2f} -> {passed['last_3']:.2f}"
                 if passed.get("first_3") is not None and passed.get("last_3") is not None else "")
        wall = training.get("wall_seconds")
        decision = results["decisions"].get(name)
        rows.append([name, _fmt(greedy["overall"]["pass_at_1"]),
                     " / ".join(_fmt(greedy["levels"][f"level_{n}"]["pass_at_1"]) for n in (1, 2, 3)),
                     _fmt(sampled["overall"]["pass_at_1"]), _fmt(sampled["overall"].get("pass_at_4")), moved,
                     "" if wall is None else f"{'>= ' if training.get('wall_partial') else ''}{wall / 60:.0f}",
                     "" if decision is None else ("improves" if decision["improves_held_out_pass_at_1"]
                                                  else "not shown")])
    return _table(["model", "greedy pass@1 (66 held-out tasks)", "by level 1 / 2 / 3", "sampled pass@1 (T 0.8)",
                   "pass@4", "training pass rate, first 3 -> last 3 iterations", "training min",
                   "pre-registered decision (> +0.06 both)"], rows)


def bench_sandbox() -> str:
    """Sandboxed programs per second vs a bare subprocess (bench/sandbox.py)."""
    data = _json("bench/results/sandbox.json")
    rows = [[r["variant"], str(r["programs"]), f"{r['programs_per_s']:.1f}", f"{r['tests_per_s']:.1f}",
             "1.00x" if r["variant"] == "bare_subprocess" else f"{r['share_of_bare_throughput']:.2f}x"]
            for r in data["rows"]]
    load = f"{data['load_average_before'][0]:.1f} -> {data['load_average_after'][0]:.1f}"
    return (_table(["variant", "programs", "programs/s", "test executions/s", "vs bare subprocess"], rows)
            + f"\n{data['workers']} workers, {data['tests_per_program']:.0f} tests per program, goal "
            f"{data['goal_programs_per_s']} programs/s; load average {load}.\n")


def _with_interval(metrics: dict, key: str) -> str:
    """`value [low, high]` of a metric and its `_low` / `_high` bootstrap interval."""
    return f"{metrics[key]:.3f} [{metrics[key + '_low']:.3f}, {metrics[key + '_high']:.3f}]"


def _critic_data_summary(data: dict) -> str:
    """The critic_data line shared by the critic runs' tables (episodes source)."""
    return (f"Data: {data['trajectories']} sampled answers ({data['train_prompts']} train + {data['val_prompts']} "
            f"held-out prompts x 8), success rate {data['train_success_rate']:.3f} train / "
            f"{data['val_success_rate']:.3f} held-out, {data['val_mixed_prompts']} of {data['val_prompts']} held-out "
            "prompts with mixed outcomes")


def critic_first_run() -> str:
    """The in-context critic on SmolLM2-135M (experiments/critic/results.json)."""
    r = _json("experiments/critic/results.json")
    data, critic = r["critic_data"], r["critic"]
    rows = [
        ["held-out AUC of P(success), at an attempt's last token (95% bootstrap CI over prompts)",
         _with_interval(critic, "val_auc"), f"untrained {critic['val_auc_before']:.3f}; goal 0.7"],
        ["held-out AUC at an attempt's first token", f"{critic['val_auc_first_token']:.3f}", ""],
        ["calibration: ECE / Brier", f"{critic['val_ece']:.3f} / {critic['val_brier']:.3f}", ""],
        [f"best-of-{critic['candidates_per_prompt']:.0f}, reward of the pick (critic / random / majority vote / oracle)",
         f"{critic['best_of_n_reward']:.3f} / {critic['random_of_n_reward']:.3f} / {critic['consistency_reward']:.3f}"
         f" / {critic['oracle_reward']:.3f}", f"{critic['selection_prompts']:.0f} held-out prompts"],
    ]
    return (_table(["measure", "value", "note"], rows)
            + f"\n{_critic_data_summary(data)}. Wall time: critic_data {data['wall_seconds'] / 60:.1f} min, critic {critic['wall_seconds'] / 60:.1f} min "
            f"({critic['step']:.0f} steps), one torch thread, {r['machine_load']}; measured {r['measured']} at "
            f"`{r['commit'][:7]}`.\n")


def critic_run2() -> str:
    """The critic's pre-registered second run (experiments/critic/results_run2.json)."""
    path = ROOT / "experiments/critic/results_run2.json"
    if not path.exists():
        return "Not run yet: the commands in PREREGISTERED.md, then `experiments/critic/collect.py`.\n"
    r = _json("experiments/critic/results_run2.json")
    data, critic, rkl, rft, d = r["critic_data"], r["critic"], r["reverse_kl"], r["rft"], r["decisions"]

    def verdict(held: bool) -> str:
        return "yes" if held else "**no**"

    def interval(key: str) -> str:
        return f"{critic[key]:+.3f} [{critic[key + '_low']:+.3f}, {critic[key + '_high']:+.3f}]"

    n = critic["q_samples_per_prompt"]
    rows = [
        ["1. held-out AUC of P(success) at an attempt's last token (95% CI over prompts); goal >= 0.7",
         _with_interval(critic, "val_auc"),
         f"met: {verdict(d['auc_goal_met'])}; established (CI above 0.7): {verdict(d['auc_goal_established'])}"],
        [f"2. reward of {n:.0f} samples per prompt: Q-weighted / plain from the reference / min-p only (control)",
         f"{critic['q_weighted_reward']:.3f} / {critic['plain_sampling_reward']:.3f} / "
         f"{critic['min_p_sampling_reward']:.3f}",
         f"Q - plain {interval('q_minus_plain')}: beats plain {verdict(d['q_weighted_beats_plain'])}; "
         f"Q - min-p {interval('q_minus_min_p')}"],
        [f"3. policy reward on held-out prompts, before -> after {rkl['step']:.0f} steps: reverse-KL distillation / "
         "rejection fine-tuning", f"{rkl['val_reward_before']:.3f} -> {rkl['val_reward']:.3f} / "
         f"{rft['val_reward_before']:.3f} -> {rft['val_reward']:.3f}",
         f"reverse-KL raises it: {verdict(d['reverse_kl_raises_reward'])}; reverse-KL - RFT "
         f"{d['reverse_kl_vs_rft']:+.3f}"],
        [f"4. best-of-{critic['candidates_per_prompt']:.0f}: critic's pick / random / majority vote / oracle",
         f"{critic['best_of_n_reward']:.3f} / {critic['random_of_n_reward']:.3f} / "
         f"{critic['consistency_reward']:.3f} / {critic['oracle_reward']:.3f}",
         f"critic beats random: {verdict(d['best_of_n_beats_random'])}"],
        ["calibration: ECE / Brier; AUC at the first token", f"{critic['val_ece']:.3f} / {critic['val_brier']:.3f}; "
         f"{critic['val_auc_first_token']:.3f}", f"untrained AUC {critic['val_auc_before']:.3f}"],
    ]
    walls = [f"{name} {r[key]['wall_seconds'] / 60:.0f} min" for name, key in
             (("critic_data", "critic_data"), ("critic", "critic"), ("reverse-KL", "reverse_kl"), ("RFT", "rft"))
             if r[key].get("wall_seconds")]
    return (_table(["pre-registered measure (64 held-out prompts unless stated)", "value", "decision"], rows)
            + f"\n{_critic_data_summary(data)}; {critic['val_trajectories']:.0f} evaluated attempts for the AUC. "
            f"Seed {r['seed']}, one torch thread each, {r['machine_load']}: {', '.join(walls)}; at "
            f"`{r['commit'][:7]}`.\n")


def critic_code_run() -> str:
    """The critic's first run on code tasks (experiments/critic/results_code.json)."""
    path = ROOT / "experiments/critic/results_code.json"
    if not path.exists():
        return "Not run yet.\n"
    r = _json("experiments/critic/results_code.json")
    data, critic = r["critic_data"], r["critic"]
    rows = [
        ["held-out AUC of P(all tests pass) at a program's last token (95% CI over prompts)",
         _with_interval(critic, "val_auc"),
         f"untrained {critic['val_auc_before']:.3f}"],
        ["calibration: ECE / Brier", f"{critic['val_ece']:.3f} / {critic['val_brier']:.3f}", ""],
        [f"best-of-{critic['candidates_per_prompt']:.0f}, code reward of the pick (critic / random / oracle)",
         f"{critic['best_of_n_reward']:.3f} / {critic['random_of_n_reward']:.3f} / {critic['oracle_reward']:.3f}",
         f"{critic['selection_prompts']:.0f} held-out prompts"],
    ]
    return (_table(["measure", "value", "note"], rows)
            + f"\nData: {data['trajectories']} programs ({data['train_prompts']} train + {data['val_prompts']} held-out "
            f"tasks x 8, up to 160 tokens), all tests passed {data['train_success_rate']:.3f} train / "
            f"{data['val_success_rate']:.3f} held-out, mean reward {data['train_mean_reward']:.2f} / "
            f"{data['val_mean_reward']:.2f}, {data['val_mixed_prompts']} of {data['val_prompts']} held-out tasks with "
            f"mixed outcomes. Wall time: critic_data {data['wall_seconds'] / 60:.0f} min on {data['workers']} Ray "
            f"workers, critic {critic['wall_seconds'] / 60:.0f} min ({critic['step']:.0f} steps, 2 threads); at "
            f"`{r['commit'][:7]}`.\n")


BLOCKS: dict[str, Callable[[], str]] = {
    "skill-recipe-rl": skill_recipe_rl,
    "skill-final-tests": skill_final_tests,
    "critic-code-run": critic_code_run,
    "critic-run2": critic_run2,
    "critic-first-run": critic_first_run,
    "bench-sandbox": bench_sandbox,
    "code-rl": code_rl,
    "stream-rl-gate": stream_rl_gate,
    "stream-rl-ablation": stream_rl_ablation,
    "stream-rl-distillation": stream_rl_distillation,
    "bench-stream-rollouts": bench_stream_rollouts,
    "bench-stream-update": bench_stream_update,
    "stream-rl-learnability": stream_rl_learnability,
    "stream-rl-gate2": stream_rl_gate2,
    "stream-rl-gate-e": stream_rl_gate_e,
    "stream-rl-label-coverage": stream_rl_label_coverage,
    "stream-rl-synthetic": stream_rl_synthetic,
    "timings": timings,
    "demo-summary": demo_summary,
    "readme-headline": readme_headline,
    "skill-headline": skill_headline,
    "skill-curves": skill_curves,
    "skill-forgetting": skill_forgetting,
    "skill-feedback-probe": skill_feedback_probe,
    "bench-eval-speed": bench_eval_speed,
    "bench-inference-engine": bench_inference_engine,
    "bench-compute-ceiling": bench_compute_ceiling,
    "bench-ppo-vs-trl": bench_ppo_vs_trl,
    "bench-async-rollouts": bench_async_rollouts,
}


def render(text: str, source: Path) -> str:
    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in BLOCKS:
            raise SystemExit(f"{source}: unknown generated block '{name}' (known: {', '.join(BLOCKS)})")
        return match.group(1) + BLOCKS[name]() + match.group(4)

    return BLOCK.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated block is stale")
    args = parser.parse_args(argv)
    stale = []
    for document in DOCUMENTS:
        if not document.exists():
            continue
        text = document.read_text(encoding="utf-8")
        new = render(text, document)
        if new != text:
            stale.append(document.relative_to(ROOT))
            if not args.check:
                document.write_text(new, encoding="utf-8")
    if args.check and stale:
        print("stale generated tables in: " + ", ".join(map(str, stale))
              + " (run python scripts/results_tables.py)", file=sys.stderr)
        return 1
    print(("stale: " if args.check else "updated: ") + (", ".join(map(str, stale)) or "nothing"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

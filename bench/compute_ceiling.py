"""Benchmark: how close the exact naive in-context RL step already is to this CPU's arithmetic ceiling (issue 30).

Once naive in-context RL's window is full, the oldest episode leaves at every step; every later token attended to
it, so every hidden state after the system prompt changes and an exact step must recompute the whole window. The
question for issue 30's naive >= 3x target (exact, over the recompute-every-step port) and for `make experiment`
<= 90 minutes is then not which cache to use but how many floating-point operations a step needs and how fast
this core can do them. Measured in one process, one torch thread, on the model and window of the protocol:

1. the core's matrix-multiply rate (GFLOP/s): `torch.mm` on the shapes of the model's largest projections
   (the window's tokens x hidden -> the MLP's width), best of several repeats; in float32, and in bfloat16 where
   the CPU has AVX512-BF16 or AMX;
2. one full-window forward of SmolLM2-135M (the port's step: the whole window from scratch; logits for the last
   position only), best of several repeats, and its operation count from the model's shapes (projections
   2 * params * tokens, attention 2 * 2 * tokens^2 / 2 * hidden per layer, causal);
3. what follows: the forward's share of the matmul rate (utilization); the fastest a full-window step can be in
   each dtype (its operations at the matmul rate: no exact method computes fewer) and so the ceiling of any exact
   method over recomputing in float32 (the port); and the arithmetic lower bound of the skill experiment's two
   naive 1000-step runs (their full-window steps only) on all cores at the matmul rate.

    .venv/bin/python bench/compute_ceiling.py            # ~2 minutes on an idle machine
    .venv/bin/python bench/compute_ceiling.py --quick    # fewer repeats

Writes bench/results/compute_ceiling.json with the machine's CPU flags and load averages.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results" / "compute_ceiling.json"
ENGINE_RESULTS = ROOT / "bench" / "results" / "inference_engine.json"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: allocation, kernel choice
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def matmul_rate(tokens: int, hidden: int, width: int, dtype, repeats: int) -> dict:
    """GFLOP/s of (tokens x hidden) @ (hidden x width), 2 * tokens * hidden * width operations a product."""
    import torch

    a = torch.randn(tokens, hidden, dtype=dtype)
    b = torch.randn(hidden, width, dtype=dtype)
    products = 8

    def run():
        for _ in range(products):
            torch.mm(a, b)

    seconds = best_seconds(run, repeats) / products
    return {"shape": [tokens, hidden, width], "seconds": seconds,
            "gflop_per_s": round(2 * tokens * hidden * width / seconds / 1e9, 1)}


def forward_operations(config, tokens: int) -> dict:
    """Operations (multiply + add = 2) of one causal forward over `tokens` tokens, logits of the last one only."""
    hidden, width, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = hidden * hidden * 2 + hidden * kv * 2 + 3 * hidden * width  # q, o; k, v; gate, up, down
    projections = 2 * per_layer * layers * tokens
    attention = 2 * 2 * (tokens * (tokens + 1) // 2) * config.num_attention_heads * head_dim * layers
    head = 2 * hidden * config.vocab_size
    return {"projections": projections, "attention": attention, "lm_head": head,
            "total": projections + attention + head}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--tokens", type=int, default=None,
                        help="window tokens per full-window step (default: the port's full-phase mean in "
                             "bench/results/inference_engine.json, else 1228)")
    parser.add_argument("--steps", type=int, default=1000, help="steps of a naive run (the protocol's 1000)")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()

    import torch

    from icrl_core.model import load_base_model

    torch.set_num_threads(1)
    repeats = 2 if args.quick else 5
    tokens, growing = args.tokens, 28  # the protocol's cap of 28 episodes fills the window in 28 steps
    try:
        naive = json.loads(ENGINE_RESULTS.read_text())["single_stream"]["naive"]
        tokens = tokens or round(naive["port"]["full_phase_tokens_per_step"])
        growing = naive["max_examples"]
    except (OSError, KeyError, ValueError):
        tokens = tokens or 1228
    full_steps = args.steps - growing
    load_before = os.getloadavg()
    flags = cpu_flags()
    bf16_hardware = bool({"avx512_bf16", "amx_bf16"} & flags)

    model, _ = load_base_model("smollm2-135m", "float32", None, 0)
    model.eval()
    config = model.config
    operations = forward_operations(config, tokens)
    dtypes = {"float32": torch.float32, **({"bfloat16": torch.bfloat16} if bf16_hardware else {})}
    rows, float32_seconds = {}, None
    for name, dtype in dtypes.items():
        rate = matmul_rate(tokens, config.hidden_size, config.intermediate_size, dtype, repeats)
        model.to(dtype)
        ids = torch.randint(0, config.vocab_size, (1, tokens))

        def forward(ids=ids):
            with torch.inference_mode():
                model(input_ids=ids, use_cache=False, logits_to_keep=1)

        seconds = best_seconds(forward, repeats)
        float32_seconds = float32_seconds or seconds  # float32 is measured first: the port's dtype
        achieved = operations["total"] / seconds / 1e9
        utilization = achieved / rate["gflop_per_s"]
        fastest = operations["total"] / (rate["gflop_per_s"] * 1e9)
        cores = os.cpu_count() or 1
        naive_runs = 2  # base and trained model, the skill experiment's evaluate stage
        lower_bound_min = naive_runs * full_steps * fastest / cores / 60
        rows[name] = {
            "matmul": rate,
            "forward_seconds": round(seconds, 3),
            "forward_gflop": round(operations["total"] / 1e9, 1),
            "forward_gflop_per_s": round(achieved, 1),
            "utilization": round(utilization, 3),
            "fastest_step_seconds": round(fastest, 3),
            "ceiling_vs_float32_recompute": round(float32_seconds / fastest, 2),
            "two_naive_runs_on_all_cores_lower_bound_min": round(lower_bound_min, 1),
        }
        print(f"{name}: matmul {rate['gflop_per_s']} GFLOP/s; forward over {tokens} tokens {seconds:.3f} s "
              f"({achieved:.1f} GFLOP/s, {utilization:.0%} of the matmul rate); an exact step takes >= "
              f"{fastest:.2f} s, at most {float32_seconds / fastest:.2f}x faster than recomputing in float32; two naive "
              f"runs' {full_steps} full-window steps need >= {lower_bound_min:.0f} min on {cores} cores", flush=True)
    result = {
        "benchmark": "compute_ceiling", "quick": args.quick, "tokens_per_step": tokens, "steps": args.steps,
        "full_window_steps": full_steps, "operations_per_step": operations, "threads": 1, "dtypes": rows,
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "platform": platform.platform(),
                    "bf16_hardware": bf16_hardware, "load_avg_before": load_before,
                    "load_avg_after": os.getloadavg()},
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

"""Benchmark: who decodes the stream rollouts of stream RL (`ppo.stream.engine`, docs/STREAMS.md).

The same streams (one group per round: `--streams` streams of `--steps` queries of a few-way opaque-label banking77
task, 2-6 labels renamed per stream as in the skill experiment's ablation, temperature 1.0, seeded draws) decoded
by SmolLM2-135M-Instruct (fp32, LoRA r=16 on q,k,v,o with non-zero B, as a trained adapter) three ways, one after
the other in one process with the same torch threads:

* `policy`: the policy's own KV cache (`ppo.stream.engine: policy`, the default; the baseline);
* `torch`: the exact torch inference engine around the live policy (`ppo.stream.engine: inference`,
  `inference.backend: torch`);
* `vllm`: one vLLM engine on the base model serving the adapter saved as a version folder
  (`inference.backend: vllm`; needs the vllm extra, skipped without it). Its start-up is timed apart.

Reported per way: seconds per round (rollout only: the update always runs on the policy), decisions per second, and
the share of steps whose answer equals the policy's own (steps until the first answer that differs: after it the
two streams' contexts differ). Rounds use fresh draws; the first round of each way is a warm-up and not counted.

    .venv/bin/python bench/stream_rollouts.py                 # bench/results/stream_rollouts.json + table
    .venv/bin/python bench/stream_rollouts.py --quick         # a short check of the script

Run it on an idle machine: the ways run in turn, and a second job on the 2 cores changes every figure.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def agreement(reference, streams) -> tuple[int, int]:
    """(steps that answer as the reference does, steps compared): each stream until its context departs from the
    reference stream's (an earlier answer differed)."""
    agree = compared = 0
    for a, b in zip(reference, streams):
        for t, (x, y) in enumerate(zip(a.steps, b.steps)):
            if a.context_ids(t) != b.context_ids(t):
                break
            compared += 1
            agree += x.answer_ids == y.answer_ids
    return agree, compared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=4, help="streams per group (ppo.stream.group_size)")
    parser.add_argument("--steps", type=int, default=12, help="queries per stream (ppo.stream.steps)")
    parser.add_argument("--rounds", type=int, default=4, help="timed groups per way (after one warm-up group)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ways", nargs="+", default=["policy", "torch", "vllm"], choices=["policy", "torch", "vllm"])
    parser.add_argument("--quick", action="store_true", help="2 streams of 4 steps, 1 timed round")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "stream_rollouts.json"))
    args = parser.parse_args()
    if args.quick:
        args.streams, args.steps, args.rounds = 2, 4, 1

    import torch

    from icrl_core.config import DataConfig, LoraAdapter, ModelConfig, TaskSource
    from icrl_core.dataset_build import resolve_sources
    from icrl_core.inference.torch_backend import TorchEngine
    from icrl_core.io import atomic_write_json
    from icrl_core.model import policy_from_config, resolve_spec
    from icrl_core.stream_rl import RolloutEngine
    from icrl_core.streams import generate_streams, sample_stream_task, stream_rng

    torch.set_num_threads(args.threads)
    model = ModelConfig(spec="smollm2-135m", dtype="float32", adapter=LoraAdapter(rank=16, alpha=32))
    policy = policy_from_config(model, seed=0)
    with torch.no_grad():  # a trained-looking adapter (LoRA B starts at zero)
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02, generator=torch.Generator().manual_seed(len(name)))
    data = DataConfig(sources=[TaskSource(name="banking77_unsemantic")], labels_per_episode=6,
                      labels_per_episode_min=2, permute_labels=True)
    sources = resolve_sources(data, 0)
    tasks = [sample_stream_task(sources, data, args.steps, seed=0, key=f"bench-{r}") for r in range(args.rounds + 1)]

    def rngs(r: int):
        return [stream_rng(0, r, 0, g) for g in range(args.streams)]

    result = {"benchmark": "stream_rollouts", "model": "smollm2-135m", "dtype": "float32", "streams": args.streams,
              "steps": args.steps, "rounds": args.rounds, "threads": args.threads, "quick": args.quick,
              "task": "banking77_unsemantic, 2-6 labels renamed per stream, temperature 1.0",
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "load_avg_before": os.getloadavg()},
              "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "ways": {}}
    reference: dict[int, list] = {}
    with tempfile.TemporaryDirectory(prefix="icrl-bench-rollouts-") as scratch:
        for way in args.ways:
            startup = 0.0
            if way == "policy":
                rollouts = None
            elif way == "torch":
                rollouts = RolloutEngine(lambda p: TorchEngine(p, cache_entries=args.streams + 1))
            else:
                try:
                    from icrl_core.inference.vllm_backend import VllmEngine
                except ImportError as error:
                    result["ways"]["vllm"] = {"skipped": f"vllm not importable ({error})"}
                    continue
                began = time.perf_counter()
                engine = VllmEngine(resolve_spec(model.spec)[1], dtype="float32", max_lora_rank=16,
                                    kv_cache_bytes=1 << 30, threads=args.threads)
                startup = time.perf_counter() - began
                rollouts = RolloutEngine(lambda _p, e=engine: e, adapter_dir=Path(scratch) / "versions")
            seconds, decisions, agree, compared = 0.0, 0, 0, 0
            for r, task in enumerate(tasks):
                began = time.perf_counter()
                if rollouts is None:
                    streams = generate_streams(policy, task, rngs(r), 1.0, 0, 4096)
                else:
                    with rollouts.serving(policy) as (served, adapter):
                        streams = generate_streams(policy, task, rngs(r), 1.0, 0, 4096, None, served, adapter)
                elapsed = time.perf_counter() - began
                if way == "policy":
                    reference[r] = streams
                if r == 0:
                    continue  # warm-up
                seconds += elapsed
                decisions += sum(len(step.decisions) for s in streams for step in s.steps)
                if r in reference:
                    a, c = agreement(reference[r], streams)
                    agree, compared = agree + a, compared + c
            if rollouts is not None:
                rollouts.close()
            result["ways"][way] = {
                "seconds_per_group": round(seconds / args.rounds, 3), "decisions_per_s": round(decisions / seconds, 2),
                "startup_seconds": round(startup, 1),
                "answer_agreement_with_policy": round(agree / compared, 4) if compared else None,
                "steps_compared": compared}
            print(way, result["ways"][way], flush=True)
    base = result["ways"].get("policy", {}).get("seconds_per_group")
    for way, row in result["ways"].items():
        if base and "seconds_per_group" in row:
            row["speedup_vs_policy"] = round(base / row["seconds_per_group"], 2)
    result["machine"]["load_avg_after"] = os.getloadavg()
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    atomic_write_json(args.output, result)
    print(f"wrote {args.output}")


if __name__ == "__main__":  # vLLM's engine must start under this guard
    main()

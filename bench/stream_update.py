"""Benchmark: the update pass of explorative-view stream RL (`ppo.stream.context: explorative`, docs/STREAMS.md),
with the activations stored (the default) against `model.gradient_checkpointing` (each decoder layer recomputed in
the backward pass), on the same streams.

An explorative stream of T steps is T rows of the update pass (each step's own context), so a minibatch holds T
times a naive stream's context tokens: this is where the skill experiment's setting 15 ran out of memory. Both
sides roll out the same `--streams` streams (one group of banking77 with 2-6 labels, T `--steps`, p_keep 0.5,
temperature 2.0, seeded) with SmolLM2-135M-Instruct (fp32, LoRA r=16 on q,k,v,o), then time one forward pass with
gradients over all their rows (`streams.stream_outputs`) and its backward. Reported per side: seconds of the pass
and of the backward, the bytes autograd keeps for backward (a saved-tensors hook, weights excluded), peak RSS
(ru_maxrss of the side's own subprocess: rollout and model load included), real and padded row tokens.
The two sides' log-probs and LoRA gradients are compared too: they must agree to float rounding.

    .venv/bin/python bench/stream_update.py             # both sides, table + bench/results/stream_update.json
    .venv/bin/python bench/stream_update.py --model tiny --steps 6   # a quick check of the script

The stored side peaked at 4.6 GB on SmolLM2 with the defaults (2 streams x 12 steps; more streams or steps grow
it in proportion): run it on an otherwise idle machine (beside a training job, Ray's memory monitor may kill
that job's workers). "Kept for backward" counts every tensor autograd saves, views of one storage each time,
so it can exceed the process's peak RSS.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ppo_step import peak_rss_mb, run_variants

VARIANTS = ("stored", "recompute")


def run_variant(args) -> dict:
    import torch

    from icrl_core.config import DataConfig, ExplorativeStreamContext, LoraAdapter, ModelConfig, TaskSource
    from icrl_core.dataset_build import resolve_sources
    from icrl_core.model import policy_from_config
    from icrl_core.streams import collate_streams, generate_streams, sample_stream_task, stream_outputs, stream_rng

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = ModelConfig(spec=args.model, dtype="float32", adapter=LoraAdapter(rank=16, alpha=32),
                        gradient_checkpointing=args.variant == "recompute")
    policy = policy_from_config(model, seed=0)
    with torch.no_grad():  # a trained-looking adapter: LoRA B starts at zero, which would leave A without gradient
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02, generator=torch.Generator().manual_seed(len(name)))
    data = DataConfig(sources=[TaskSource(name="banking77")], labels_per_episode=6, labels_per_episode_min=2)
    task = sample_stream_task(resolve_sources(data, 0), data, args.steps, seed=0, key="bench-0")
    streams = generate_streams(policy, task, [stream_rng(0, 1, 0, g) for g in range(args.streams)], temperature=2.0,
                               context=ExplorativeStreamContext(p_keep=0.5))
    batch = collate_streams(streams, policy.tokenizer.pad_token_id)
    policy.train()
    weights = {p.untyped_storage().data_ptr() for p in policy.model.parameters()}
    saved: list[int] = []

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    started = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logp, _, _ = stream_outputs(policy, batch, 2.0, with_values=False)
    forward = time.perf_counter() - started
    started = time.perf_counter()
    logp.sum().backward()
    backward = time.perf_counter() - started
    grads = {n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    with tempfile.NamedTemporaryFile(suffix=".pt", delete=False, dir=args.scratch) as handle:
        torch.save({"logp": logp.detach(), "grads": grads}, handle.name)
    return {"variant": args.variant, "model": args.model, "streams": args.streams, "steps": args.steps,
            "rows": int(batch.input_ids.shape[0]), "padded_tokens": int(batch.input_ids.numel()),
            "real_tokens": int(batch.attention_mask.sum()), "forward_seconds": forward,
            "backward_seconds": backward, "saved_for_backward_mb": sum(saved) / 2**20,
            "peak_rss_mb": peak_rss_mb(), "threads": args.threads, "tensors": handle.name}


def agreement(paths: list[str]) -> dict:
    """Largest differences between the sides' log-probs and gradients (weights_only load)."""
    import torch

    first, second = (torch.load(path, weights_only=True) for path in paths)
    for path in paths:
        Path(path).unlink()
    grad_diff = max(float((first["grads"][n] - second["grads"][n]).abs().max() /
                          first["grads"][n].abs().max().clamp(min=1e-12)) for n in first["grads"])
    return {"max_abs_logp_difference": float((first["logp"] - second["logp"]).abs().max()),
            "max_relative_gradient_difference": grad_diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS, help="run one side, JSON on stdout")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--streams", type=int, default=2, help="streams in the pass (setting 15's minibatch: 2)")
    parser.add_argument("--steps", type=int, default=12, help="steps per stream (rows per stream)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--scratch", default=tempfile.gettempdir(), help="where the sides leave their tensors")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "stream_update.json")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    flags = ["--model", args.model, "--streams", str(args.streams), "--steps", str(args.steps),
             "--threads", str(args.threads), "--scratch", args.scratch]
    results = run_variants(__file__, VARIANTS, flags)
    if any("error" in r for r in results):
        sys.exit(f"a side failed: {results}")
    stored, recompute = results
    out = {"measured": time.strftime("%Y-%m-%d"), "results": results,
           "agreement": agreement([stored.pop("tensors"), recompute.pop("tensors")]),
           "ratio": {"saved_for_backward_recompute_over_stored":
                     recompute["saved_for_backward_mb"] / stored["saved_for_backward_mb"],
                     "peak_rss_recompute_over_stored": recompute["peak_rss_mb"] / stored["peak_rss_mb"],
                     "seconds_recompute_over_stored":
                     (recompute["forward_seconds"] + recompute["backward_seconds"])
                     / (stored["forward_seconds"] + stored["backward_seconds"])}}
    from icrl_core.io import atomic_write_json

    args.output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.output, out)
    print(f"{'side':<10} {'rows':>5} {'tokens':>7} {'padded':>7} {'fwd s':>7} {'bwd s':>7} {'kept MB':>8} {'peak RSS MB':>12}")
    for r in results:
        print(f"{r['variant']:<10} {r['rows']:>5} {r['real_tokens']:>7} {r['padded_tokens']:>7} "
              f"{r['forward_seconds']:>7.1f} {r['backward_seconds']:>7.1f} {r['saved_for_backward_mb']:>8.0f} "
              f"{r['peak_rss_mb']:>12.0f}")
    print(json.dumps(out["ratio"]), json.dumps(out["agreement"]))


if __name__ == "__main__":
    main()

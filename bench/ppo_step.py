"""Benchmark: one PPO iteration (rollout + update) of icrl vs TRL on CPU, same model, batch and lengths.

TRL 1.16 no longer ships a PPO trainer (trl.PPOTrainer was removed), so the comparison is its RLOO trainer, the
closest on-policy trainer it has (one clipped policy-gradient update per generation batch, KL to the reference
by disabling the LoRA adapter). Both sides use SmolLM2-135M-Instruct (fp32 by default) with LoRA r=8 on
q,k,v,o, the same 8 rollouts per iteration (4 keyword_map episode prompts x 2 samples: RLOO needs >= 2 per
prompt), the same max_new_tokens, temperature and KL coefficient, and one optimizer step per iteration
(icrl: ppo.epochs=1, one minibatch of 8). A second icrl row uses the demo update (more epochs/minibatches).

Each variant runs in its own subprocess, so peak RSS (ru_maxrss, model load included) is per variant. Each
does one warm-up iteration, then times the next. tokens/s = (prompt + generated tokens of the batch) / seconds
of the timed iteration.

    .venv/bin/python bench/ppo_step.py                 # all variants, table + bench/results/ppo_step.json
    .venv/bin/python bench/ppo_step.py --variant trl   # one variant, JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = ("icrl", "icrl_demo", "trl_rloo")


def prompts_and_episodes(n_prompts: int, max_new_tokens: int):
    """n_prompts keyword_map episodes (k=3, n=1) and their rendered ICRL prompts (ids and text)."""
    from icrl_core.chat import Tokens
    from icrl_core.model import load_base_model
    from icrl_core.rollout import EpisodeDialogue
    from tests.ppo_helpers import keyword_episodes

    _, tokenizer = load_base_model("smollm2-135m")
    tokens = Tokens(tokenizer)
    episodes = keyword_episodes(n_prompts, k=3, n=1, seed=123)
    ids = [EpisodeDialogue(ep, tokens, 2048, max_new_tokens).conv.ids for ep in episodes]
    return episodes, ids, [tokenizer.decode(i) for i in ids]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def trl_model(dtype: str):
    """(tokenizer, model) of SmolLM2-135M-Instruct as a transformers folder materialized by icrl (TRL's input)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from icrl_core.model import materialize_gguf, packaged_gguf

    folder = materialize_gguf(packaged_gguf())
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.padding_side = "left"
    return tokenizer, AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype))


def step_timer(step_times: list, counted: dict):
    """A TrainerCallback appending (seconds of the step, a copy of `counted`) to `step_times` at each step's end."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            step_times.append((time.perf_counter() - self.started, dict(counted)))

    return Timer()


def run_variants(script: str, variants, flags: list[str]) -> list[dict]:
    """Run `script --variant V *flags` for each variant in its own subprocess (a clean peak RSS each); their
    JSON results, or {"variant", "error"} for one that failed."""
    results = []
    for variant in variants:
        done = subprocess.run([sys.executable, script, "--variant", variant, *flags], capture_output=True,
                              text=True, cwd=ROOT, check=False)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            results.append({"variant": variant, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


def run_icrl(args, demo: bool) -> dict:
    import torch

    from icrl_core.config import LoraAdapter, PPOConfig
    from icrl_core.model import load_policy
    from icrl_core.ppo import iteration_generator, make_optimizer, ppo_step, zero_value_head

    episodes, _, _ = prompts_and_episodes(args.prompts, args.max_new_tokens)
    batch = [ep for ep in episodes for _ in range(args.samples)]
    policy = load_policy("smollm2-135m", args.dtype, LoraAdapter(rank=8, alpha=16), value_head=True)
    zero_value_head(policy)
    after_load = rss_mb()
    update = {"epochs": 2, "minibatch_size": 4} if demo else {"epochs": 1, "minibatch_size": len(batch)}
    cfg = PPOConfig(rollout_episodes=len(batch), batch_size=len(batch), max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, kl_beta=args.kl_beta, learning_rate=1e-5, **update)
    optimizer, scheduler = make_optimizer(policy, cfg)
    timings = []
    for step in (1, 2):
        torch.manual_seed(step)
        started = time.perf_counter()
        metrics = ppo_step(policy, optimizer, scheduler, batch, cfg, cfg.kl_beta, iteration_generator(0, step), 2048)
        timings.append((time.perf_counter() - started, metrics))
    seconds, metrics = timings[-1]
    generated = metrics["answer_tokens"] * len(batch)
    prompt_tokens = metrics["tokens"] - generated
    return {"variant": "icrl" + ("_demo" if demo else ""), "seconds": seconds,
            "rollout_seconds": metrics["rollout_seconds"], "update_seconds": metrics["update_seconds"],
            "prompt_tokens": prompt_tokens, "generated_tokens": generated,
            "tokens_per_second": (prompt_tokens + generated) / seconds, "peak_rss_mb": peak_rss_mb(),
            "rss_after_load_mb": after_load, "warmup_seconds": timings[0][0],
            "update": f"epochs={cfg.epochs}, minibatch={cfg.minibatch_size}"}


def run_trl(args) -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from trl import RLOOConfig, RLOOTrainer

    episodes, _, texts = prompts_and_episodes(args.prompts, args.max_new_tokens)
    tokenizer, model = trl_model(args.dtype)
    after_load = rss_mb()
    labels = [ep.queries[0].preferred_answer for ep in episodes]
    dataset = Dataset.from_list([{"prompt": t, "label": lb} for t, lb in zip(texts, labels)] * 4)
    counted = {"prompt": 0, "generated": 0}

    def exact_match(prompts, completions, completion_ids, label, **_):
        counted["prompt"] = sum(len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts)
        counted["generated"] = sum(len(c) for c in completion_ids)
        return [1.0 if c.strip() == lb else 0.0 for c, lb in zip(completions, label)]

    step_times: list[tuple[float, dict]] = []
    batch = args.prompts * args.samples
    config = RLOOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=args.samples,
        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_k=0, top_p=1.0,
        beta=args.kl_beta, num_iterations=1, learning_rate=1e-5, max_steps=2, logging_steps=1, save_strategy="no",
        report_to=[], seed=0, shuffle_dataset=False, dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=args.trl_gradient_checkpointing,
    )
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = RLOOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora,
                          callbacks=[step_timer(step_times, counted)])
    trainer.train()
    seconds, count = step_times[-1]
    return {"variant": "trl_rloo", "seconds": seconds, "prompt_tokens": count["prompt"],
            "generated_tokens": count["generated"],
            "tokens_per_second": (count["prompt"] + count["generated"]) / seconds, "peak_rss_mb": peak_rss_mb(),
            "rss_after_load_mb": after_load, "warmup_seconds": step_times[0][0],
            "update": "num_iterations=1, one minibatch" + (", grad ckpt" if args.trl_gradient_checkpointing else ""),
            "trl_version": __import__("trl").__version__}


def run_variant(args) -> dict:
    if args.variant == "trl_rloo":
        return run_trl(args)
    return run_icrl(args, demo=args.variant == "icrl_demo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS, help="Run one variant in this process (JSON on stdout).")
    parser.add_argument("--prompts", type=int, default=4, help="Distinct episode prompts per iteration.")
    parser.add_argument("--samples", type=int, default=2, help="Rollouts per prompt (RLOO needs >= 2).")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="Generated tokens per answer (at most).")
    parser.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature.")
    parser.add_argument("--kl-beta", type=float, default=0.05, help="KL coefficient (both sides).")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="Weight dtype.")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="Keep TRL's default gradient checkpointing (off here: icrl does not recompute "
                        "activations, so both sides do the same work).")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ppo_step.json",
                        help="Where the JSON results go.")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    flags = ["--prompts", str(args.prompts), "--samples", str(args.samples), "--max-new-tokens",
             str(args.max_new_tokens), "--temperature", str(args.temperature), "--kl-beta", str(args.kl_beta),
             "--dtype", args.dtype]
    if args.trl_gradient_checkpointing:
        flags.append("--trl-gradient-checkpointing")
    results = run_variants(__file__, VARIANTS, flags)
    by_name = {r["variant"]: r for r in results if "error" not in r}
    ratio = {}
    if "icrl" in by_name and "trl_rloo" in by_name:
        ratio = {"tokens_per_second_icrl_over_trl": by_name["icrl"]["tokens_per_second"] /
                 by_name["trl_rloo"]["tokens_per_second"],
                 "peak_rss_icrl_over_trl": by_name["icrl"]["peak_rss_mb"] / by_name["trl_rloo"]["peak_rss_mb"]}
    import platform

    import torch

    payload = {"settings": {"model": "smollm2-135m", "lora": "r=8, alpha=16, q,k,v,o", "dtype": args.dtype,
                            "rollouts": args.prompts * args.samples, "prompts": args.prompts,
                            "samples_per_prompt": args.samples, "max_new_tokens": args.max_new_tokens,
                            "temperature": args.temperature, "kl_beta": args.kl_beta,
                            "trl_gradient_checkpointing": args.trl_gradient_checkpointing,
                            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                            "load_average_at_end": os.getloadavg(), "platform": platform.platform(),
                            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")},
               "results": results, "ratio": ratio}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from icrl_core.io import atomic_write_json

    atomic_write_json(args.out, payload)
    print(f"{'variant':<11} {'update':<32} {'s/iter':>7} {'tokens':>7} {'tok/s':>7} {'peak RSS MB':>12}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<11} error: {r['error']}")
            continue
        print(f"{r['variant']:<11} {r['update']:<32} {r['seconds']:>7.2f} "
              f"{r['prompt_tokens'] + r['generated_tokens']:>7.0f} {r['tokens_per_second']:>7.1f} "
              f"{r['peak_rss_mb']:>12.0f}")
    if ratio:
        print(f"icrl / TRL: tokens/s x{ratio['tokens_per_second_icrl_over_trl']:.2f}, peak RSS "
              f"x{ratio['peak_rss_icrl_over_trl']:.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

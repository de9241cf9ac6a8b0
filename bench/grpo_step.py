"""Benchmark: one GRPO iteration (G completions per prompt + one optimizer step) of icrl vs TRL's GRPOTrainer.

What is compared. Both sides sample G free-text completions of at most --max-new-tokens tokens for each of the
same prompts (keyword_map episode prompts rendered by the PPO stage, `bench/ppo_step.py`), score them with the
same exact-match reward (`icrl_core.rollout.task_reward`), compute group-normalized advantages and take ONE
optimizer step on the clipped GRPO loss with a k3 KL term to the reference (the LoRA adapter disabled). Same
model (SmolLM2-135M-Instruct as `icrl model` materializes it, fp32), LoRA r=8 alpha=16 on q,k,v,o, temperature,
beta, clip range, learning rate, thread count.

- icrl: the token-mode rollout (`rollout.generate_rollouts`: all completions batched in one KV cache, sampling
  over the full vocabulary) and the group objective of stream mode (`objectives.grpo_advantages` per group,
  `grpo_loss` = sequence mean of the clipped surrogate, `k3_kl`), the update through `ppo.minibatch_epochs` like
  `stream_rl.stream_update`. The pipeline's GRPO runs on in-context RL streams (constrained decoding over a
  label trie, docs/STREAMS.md): that is a different rollout than TRL's free generation, so the benchmark uses
  the project's free-text generation with its GRPO loss; the stream pass is the same forward/backward.
- TRL: GRPOTrainer(num_generations=G, loss_type="grpo", scale_rewards="group", beta, epsilon, peft_config),
  gradient checkpointing off (icrl does not recompute activations).

Each side runs in its own subprocess (peak RSS = ru_maxrss, model load included). Each does one warm-up
iteration, then times the next. tokens/s = (generated tokens + trained tokens) / seconds of the timed
iteration, where generated = the completions' tokens and trained = prompt + completion tokens of every
sequence in the update (no padding), counted the same way on both sides.

    .venv/bin/python bench/grpo_step.py                 # both sides, table + bench/results/grpo_step.json
    .venv/bin/python bench/grpo_step.py --prompts 4 --group-size 8 --max-new-tokens 64   # bigger
    .venv/bin/python bench/grpo_step.py --variant trl   # one side, JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ppo_step import (
    peak_rss_mb,
    prompts_and_episodes,
    rss_mb,
    run_variants,
    step_timer,
    trl_model,
)

# icrl-causal: model.right_padding_mask=false; icrl-shared: model.share_prefix=true
VARIANTS = ("icrl", "icrl-causal", "icrl-shared", "trl")
ICRL_SIDES = (("icrl", ""), ("icrl-causal", "_causal"), ("icrl-shared", "_shared"))  # (variant, ratio key suffix)
LORA = {"rank": 8, "alpha": 16, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
LEARNING_RATE = 1e-5
CLIP = 0.2


def run_icrl(args) -> dict:
    import torch

    from icrl_core.config import LoraAdapter, PPOConfig
    from icrl_core.model import load_policy
    from icrl_core.objectives import GRPOObjective, grpo_advantages, grpo_loss, k3_kl, masked_mean, per_group
    from icrl_core.ppo import iteration_generator, make_optimizer, minibatch_epochs, policy_outputs, rollout_batch
    from icrl_core.rollout import Sampling, generate_rollouts, score_rollouts

    torch.set_num_threads(args.threads)
    episodes, _, _ = prompts_and_episodes(args.prompts, args.max_new_tokens)
    batch_episodes = [ep for ep in episodes for _ in range(args.group_size)]
    groups = torch.arange(len(episodes)).repeat_interleave(args.group_size)
    policy = load_policy("smollm2-135m", args.dtype, LoraAdapter(rank=LORA["rank"], alpha=LORA["alpha"],
                                                                  target_modules=LORA["targets"]),
                         right_padding_mask=args.variant != "icrl-causal",
                         share_prefix=args.variant == "icrl-shared")
    after_load = rss_mb()
    n = len(batch_episodes)
    # Update settings only (epochs, one minibatch, grad clipping); the loss below is the GRPO objective.
    cfg = PPOConfig(rollout_episodes=n, batch_size=n, minibatch_size=n, epochs=1,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature, kl_beta=args.beta,
                    learning_rate=LEARNING_RATE)
    objective = GRPOObjective(clip_low=CLIP, clip_high=CLIP)
    optimizer, scheduler = make_optimizer(policy, cfg)

    def iteration(step: int) -> dict:
        generator = iteration_generator(0, step)
        started = time.perf_counter()
        rollouts = generate_rollouts(policy, batch_episodes, Sampling(temperature=cfg.temperature),
                                     cfg.max_new_tokens, 2048, generator)
        score_rollouts(rollouts, cfg.reward)                                                # exact match
        rollout_seconds = time.perf_counter() - started
        batch = rollout_batch(rollouts, policy.tokenizer.pad_token_id)
        rewards = torch.tensor([sum(r.scores) for r in rollouts])[:, None]                # (B, 1): one step
        advantages = per_group(grpo_advantages, rewards, torch.ones_like(rewards, dtype=torch.bool), groups,
                               scale=objective.scale_advantages)                            # (B, 1)
        token_advantages = advantages * batch.action_mask                                   # (B, A)
        with torch.no_grad(), policy.reference():
            ref_logp, _, _ = policy_outputs(policy, batch, cfg.temperature, with_values=False)

        def minibatch_loss(index: torch.Tensor):
            part = batch.select(index)
            width, mask = part.action_mask.shape[1], part.action_mask
            logp, _, _ = policy_outputs(policy, part, cfg.temperature, with_values=False)
            # One epoch: pi_old is the sampling policy, its log-probs recorded at generation (as stream_rl).
            policy_loss = grpo_loss(logp, part.behaviour_logp, token_advantages[index, :width], mask,
                                    objective.clip_low, objective.clip_high)
            kl = masked_mean(k3_kl(logp, ref_logp[index, :width]), mask)
            loss = policy_loss + cfg.kl_beta * kl
            return loss, {"loss": loss.item(), "kl_k3": kl.item()}

        metrics = minibatch_epochs(policy, optimizer, n, cfg, generator, minibatch_loss, scheduler)
        seconds = time.perf_counter() - started
        generated = sum(len(a.token_ids) for r in rollouts for a in r.answers)
        trained = sum(len(r.ppo_ids()) for r in rollouts)
        return {"seconds": seconds, "rollout_seconds": rollout_seconds, "update_seconds": seconds - rollout_seconds,
                "generated_tokens": generated, "trained_tokens": trained,
                "mean_reward": float(rewards.mean()), "loss": metrics["loss"]}

    warmup = iteration(1)
    timed = iteration(2)
    return {"variant": args.variant, **timed,
            "tokens_per_second": (timed["generated_tokens"] + timed["trained_tokens"]) / timed["seconds"],
            "peak_rss_mb": peak_rss_mb(), "rss_after_load_mb": after_load, "warmup_seconds": warmup["seconds"],
            "load_average_at_end": os.getloadavg(),
            "torch_threads": torch.get_num_threads()}


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from icrl_core.rollout import task_reward

    torch.set_num_threads(args.threads)
    episodes, ids, texts = prompts_and_episodes(args.prompts, args.max_new_tokens)
    tokenizer, model = trl_model(args.dtype)
    after_load = rss_mb()
    # Same prompts in the same order at every step (shuffle off): step 1 (warm-up) and step 2 see the icrl batch.
    rows = [{"prompt": t, "episode": i} for i, t in enumerate(texts)]
    dataset = Dataset.from_list(rows * 4)
    prompt_lengths = {t: len(i) for t, i in zip(texts, ids)}
    counted: dict[str, float] = {}

    def exact_match(prompts, completions, completion_ids, episode, **_):
        lengths = [len(c) for c in completion_ids]
        counted.update(generated=sum(lengths),
                       trained=sum(prompt_lengths[p] + n for p, n in zip(prompts, lengths)))
        rewards = [task_reward(c, episodes[e].queries[0]) for c, e in zip(completions, episode)]
        counted["mean_reward"] = sum(rewards) / len(rewards)
        return rewards

    step_times: list[tuple[float, dict]] = []
    completions = args.prompts * args.group_size
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-bench-"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=completions, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=args.group_size, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_k=0, top_p=1.0, beta=args.beta, epsilon=CLIP, epsilon_high=CLIP,
        loss_type="grpo", scale_rewards="group", num_iterations=1, learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        max_steps=2, logging_steps=1, save_strategy="no", report_to=[], seed=0, shuffle_dataset=False,
        dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=False,
    )
    lora = LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["targets"], lora_dropout=0.0,
                      task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=lora,
                          callbacks=[step_timer(step_times, counted)])
    trainer.train()
    seconds, count = step_times[-1]
    return {"variant": "trl", "seconds": seconds, "generated_tokens": count["generated"],
            "trained_tokens": count["trained"], "mean_reward": count["mean_reward"],
            "tokens_per_second": (count["generated"] + count["trained"]) / seconds, "peak_rss_mb": peak_rss_mb(),
            "rss_after_load_mb": after_load, "warmup_seconds": step_times[0][0],
            "load_average_at_end": os.getloadavg(), "torch_threads": torch.get_num_threads(), "trl_version": __import__("trl").__version__}


NOTES = [
    ("Rollout: both sides free-generate up to max_new_tokens tokens per completion (stop at end of turn/EOS), "
     "G completions per prompt, full-vocabulary sampling at the same temperature (TRL top_k=0, top_p=1). The "
     "pipeline's own GRPO (ppo.mode: stream) rolls out in-context RL streams answered by constrained decoding over "
     "a label trie; TRL has no such rollout, so the icrl side here is the token-mode generation "
     "(rollout.generate_rollouts) with the stream-mode GRPO objective functions (objectives.grpo_advantages, "
     "grpo_loss, k3_kl) and update loop (ppo.minibatch_epochs)."),
    ("Loss: TRL loss_type='grpo' (per-sequence token mean, then batch mean), scale_rewards='group' (std unbiased, "
     "eps 1e-4), epsilon=epsilon_high=0.2, beta k3 KL to the adapter-disabled model: the same formulas as icrl's "
     "grpo_advantages/grpo_loss. One difference: TRL adds beta*KL per token inside the sequence mean, icrl adds "
     "beta * (token mean of KL over the batch) (as stream_rl does); identical work, slightly different weighting."),
    ("pi_old: one iteration per generation on both sides, so neither recomputes old log-probs (TRL uses the "
     "detached current log-probs, icrl the sampling log-probs recorded at generation); both run one reference "
     "forward (adapter disabled) and one training forward/backward over all G*prompts sequences."),
    "Optimizer: AdamW lr 1e-5 constant, weight decay 0, grad-norm clip 1.0 on both.",
    ("TRL gradient checkpointing is off (its default is on) so both sides keep activations; TRL generates with "
     "transformers generate() on the PEFT model, icrl with its own batched KV-cache loop."),
    ("icrl-shared: the icrl side with model.share_prefix=true: the G completions of a prompt prefill it once in "
     "generation, and the reference and training passes run each prompt once with its KV cache repeated to the G "
     "rows (gradients through the shared prompt add up over the group in autograd; equal to the full pass up to "
     "float rounding, tests/unit/test_model.py). TRL computes every completion's prompt separately. Tokens are "
     "counted the same way on every side (each sequence's prompt + completion), so this variant's tokens/s "
     "credits it with prompt tokens it computed once per group."),
    ("icrl-causal: the icrl side with model.right_padding_mask=false (right-padded training passes run causal "
     "attention without the padding mask: the same forward numbers at real positions, gradients equal up to float "
     "rounding); icrl: the pipeline's default (mask given)."),
    ("Completions are sampled, so lengths and rewards differ between sides; tokens/s normalizes by the tokens "
     "each side actually generated and trained on. CPU timings on a shared 2-core machine are noisy."),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS, help="Run one side in this process (JSON on stdout).")
    parser.add_argument("--prompts", type=int, default=2, help="Distinct prompts per iteration.")
    parser.add_argument("--group-size", type=int, default=4, help="Completions per prompt (G, >= 2).")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="Generated tokens per completion (at most).")
    parser.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature.")
    parser.add_argument("--beta", type=float, default=0.04, help="k3 KL coefficient (both sides).")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="Weight dtype.")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (both sides).")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "grpo_step.json",
                        help="Where the JSON results go.")
    args = parser.parse_args()
    if args.group_size < 2:
        parser.error("--group-size must be >= 2 (a group baseline needs two completions)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    results = run_variants(__file__, VARIANTS, [
        "--prompts", str(args.prompts), "--group-size", str(args.group_size), "--max-new-tokens",
        str(args.max_new_tokens), "--temperature", str(args.temperature), "--beta", str(args.beta), "--dtype",
        args.dtype, "--threads", str(args.threads)])
    by_name = {r["variant"]: r for r in results if "error" not in r}
    ratio = {}
    if "icrl" in by_name and "trl" in by_name:
        trl = by_name["trl"]
        ratio = {"goal": ">= 1.5x tokens/s, <= 0.7x peak RSS (issue 26)"}
        for name, suffix in ICRL_SIDES:
            if name in by_name:
                ratio[f"tokens_per_second_icrl{suffix}_over_trl"] = (by_name[name]["tokens_per_second"]
                                                                      / trl["tokens_per_second"])
                ratio[f"peak_rss_icrl{suffix}_over_trl"] = by_name[name]["peak_rss_mb"] / trl["peak_rss_mb"]
                ratio[f"goal_met{suffix}"] = (ratio[f"tokens_per_second_icrl{suffix}_over_trl"] >= 1.5
                                              and ratio[f"peak_rss_icrl{suffix}_over_trl"] <= 0.7)
    import platform

    import torch

    payload = {"settings": {"model": "smollm2-135m (HF folder materialized by icrl_core.model)",
                            "lora": f"r={LORA['rank']}, alpha={LORA['alpha']}, q,k,v,o", "dtype": args.dtype,
                            "prompts": args.prompts, "group_size": args.group_size,
                            "completions": args.prompts * args.group_size, "max_new_tokens": args.max_new_tokens,
                            "temperature": args.temperature, "beta": args.beta, "clip": CLIP,
                            "learning_rate": LEARNING_RATE, "optimizer_steps": 1, "torch_threads": args.threads,
                            "tokens_per_second": "(generated + trained tokens) / seconds of the timed iteration"},
               "environment": {"cpu_count": os.cpu_count(), "load_average_at_end": os.getloadavg(),
                               "platform": platform.platform(), "python": platform.python_version(),
                               "torch": torch.__version__, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")},
               "notes": NOTES, "results": results, "ratio": ratio}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    from icrl_core.io import atomic_write_json

    atomic_write_json(args.out, payload)
    print(f"{'side':<11} {'s/iter':>7} {'gen':>5} {'trained':>8} {'tok/s':>7} {'peak RSS MB':>12}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<11} error: {r['error']}")
            continue
        print(f"{r['variant']:<11} {r['seconds']:>7.2f} {r['generated_tokens']:>5.0f} {r['trained_tokens']:>8.0f} "
              f"{r['tokens_per_second']:>7.1f} {r['peak_rss_mb']:>12.0f}")
    for name, suffix in ICRL_SIDES:
        if f"goal_met{suffix}" in ratio:
            print(f"{name} / TRL: tokens/s x{ratio[f'tokens_per_second_icrl{suffix}_over_trl']:.2f}, "
                  f"peak RSS x{ratio[f'peak_rss_icrl{suffix}_over_trl']:.2f} (goal met: {ratio[f'goal_met{suffix}']})")
    print(f"wrote {args.out}")


def run_variant(args) -> dict:
    return run_trl(args) if args.variant == "trl" else run_icrl(args)


if __name__ == "__main__":
    main()

"""The PPO stage in stream mode (`ppo.mode: stream`): roll out in-context RL streams (icrl_core/streams.py) and
update the policy with the configured objective (`ppo.objective`, icrl_core/objectives.py).

One iteration:
  1. `ppo.stream.groups` groups, each a task drawn from the training pools (key: seed, step, group) and
     `group_size` streams of `steps` queries, decoded at ppo.temperature (draws seeded by seed, step, group, stream:
     a resumed run rolls out the same streams);
  2. one no-grad pass per chunk of streams for pi_old and, with the adapters disabled, pi_ref (and V(s_t) for ppo)
     (each skipped when not needed, `prepare_streams`);
  3. per-step advantages:
       ppo         r_t - beta * KL_t (KL_t = sum of the step's k1 decision KLs), GAE over steps, whitened
       group kinds R_t = discounted return of the stream (ppo.gamma), group baseline per step position
  4. `ppo.epochs` passes in minibatches of `ppo.minibatch_size` streams: one forward pass per minibatch gives
     every decision's constrained log-prob; loss = objective + (group kinds) kl_beta * mean k3 KL
     - entropy_beta * mean decision entropy (+ vf_coef * value loss for ppo).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from icrl_core.config import AdaptiveKL, DataConfig, PPOConfig
from icrl_core.distributed import mean_metrics, shard
from icrl_core.objectives import (
    aipo_loss,
    discounted_returns,
    distillation_rewards,
    dr_grpo_loss,
    grpo_advantages,
    grpo_loss,
    gspo_loss,
    k3_kl,
    masked_mean,
    opo_advantages,
    per_group,
    policy_gradient_loss,
    rloo_advantages,
    step_to_tokens,
    whiten,
)
from icrl_core.ppo import (
    approx_kl,
    clip_fraction,
    clipped_policy_loss,
    clipped_value_loss,
    explained_variance,
    gae_advantages,
    minibatch_epochs,
)
from icrl_core.streams import (
    Stream,
    StreamBatch,
    collate_streams,
    generate_streams,
    sample_stream_task,
    stream_outputs,
    stream_rng,
    teacher_logprobs,
)


def uses_critic(cfg: PPOConfig) -> bool:
    return cfg.objective.kind == "ppo" and cfg.value_head


def step_sums(token_values: torch.Tensor, action_step: torch.Tensor, action_mask: torch.Tensor, n_steps: int
              ) -> torch.Tensor:
    """sum over each step's decisions: out[b, t] = sum_a token_values[b, a] [action_step[b, a] == t].
    (B, A) -> (B, T)."""
    out = torch.zeros((token_values.shape[0], n_steps), dtype=token_values.dtype)
    return out.scatter_add(1, action_step, token_values * action_mask.to(token_values.dtype))


def group_step_advantages(cfg: PPOConfig, returns: torch.Tensor, step_mask: torch.Tensor, groups: torch.Tensor,
                          answer_actions: torch.Tensor) -> torch.Tensor:
    """Per-step advantages of a group objective from the streams' returns (B, T) (see icrl_core/objectives.py)."""
    kind = cfg.objective.kind
    if kind in ("grpo", "gspo"):
        return per_group(grpo_advantages, returns, step_mask, groups, scale=cfg.objective.scale_advantages)
    if kind in ("dr_grpo", "aipo"):
        return per_group(grpo_advantages, returns, step_mask, groups, scale=False)
    if kind == "rloo":
        return per_group(rloo_advantages, returns, step_mask, groups)
    if kind == "opo":
        return per_group(opo_advantages, returns, step_mask, groups, answer_actions)
    raise ValueError(f"no group advantages for objective {kind}")


@dataclass
class StreamPrepared:
    """Fixed quantities of one batch of streams (no gradients). Per decision (B, A): old_logp, ref_logp, kl (k1),
    advantages; per step (B, T): old_values, returns, step_advantages."""

    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    kl: torch.Tensor
    advantages: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    step_advantages: torch.Tensor


def needs_reference(cfg: PPOConfig, beta: float) -> bool:
    """The reference pass is skipped when nothing uses the KL: beta 0 and a fixed coefficient."""
    return beta > 0 or isinstance(cfg.kl_control, AdaptiveKL)


@torch.no_grad()
def prepare_streams(policy, batch: StreamBatch, cfg: PPOConfig, beta: float) -> StreamPrepared:
    """pi_old and pi_ref log-probs of every decision (and V(s_t) for ppo), then the per-step advantages.

    With one epoch pi_old is the policy that sampled the streams, so the behaviour log-probs recorded at
    generation serve as pi_old (they equal a recomputation to ~1e-5) and, without a critic, the pass is skipped;
    without a KL use (`needs_reference`) the reference pass is skipped and the KL reads 0."""
    policy.eval()
    critic = uses_critic(cfg)
    recompute = cfg.epochs > 1 or critic
    reference = needs_reference(cfg, beta)
    olds, refs, vals = [], [], []
    for start in range(0, len(batch), cfg.batch_size):
        part = batch.select(torch.arange(start, min(start + cfg.batch_size, len(batch))))
        logp, values = part.behaviour_logp * part.action_mask, None
        if recompute:
            logp, _, values = stream_outputs(policy, part, cfg.temperature, with_values=critic)
        ref_logp = logp
        if reference:
            with policy.reference():
                ref_logp, _, _ = stream_outputs(policy, part, cfg.temperature, with_values=False)
        olds.append(logp), refs.append(ref_logp)
        vals.append(values if values is not None else torch.zeros_like(part.rewards))
    n_actions = batch.action_mask.shape[1]

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([nn.functional.pad(p, (0, n_actions - p.shape[1])) for p in parts])

    old_logp, ref_logp, old_values = cat(olds), cat(refs), torch.cat(vals)
    mask, step_mask = batch.action_mask, batch.step_mask
    kl = (old_logp - ref_logp) * mask
    if cfg.objective.kind == "ppo":
        rewards = (batch.rewards - beta * step_sums(kl, batch.action_step, mask, step_mask.shape[1])) * step_mask
        step_advantages, returns = gae_advantages(rewards, old_values, step_mask, cfg.gamma, cfg.gae_lambda)
        if cfg.whiten_advantages:
            step_advantages = whiten(step_advantages, step_mask)
    else:
        returns = discounted_returns(batch.rewards, step_mask, cfg.gamma)
        step_advantages = group_step_advantages(cfg, returns, step_mask, batch.groups, batch.answer_actions)
    advantages = step_to_tokens(step_advantages, batch.action_step, mask)
    return StreamPrepared(old_logp, ref_logp, kl, advantages, old_values, returns, step_advantages)


def objective_loss(cfg: PPOConfig, logp: torch.Tensor, old_logp: torch.Tensor, behaviour_logp: torch.Tensor,
                   advantages: torch.Tensor, mask: torch.Tensor, normalizer: float) -> torch.Tensor:
    """The policy term of `cfg.objective` over decisions (B, A). `normalizer`: Dr.GRPO's constant."""
    objective = cfg.objective
    kind = objective.kind
    if kind == "ppo":
        return clipped_policy_loss(logp, old_logp, advantages, mask, cfg.clip_range)
    if kind == "grpo":
        return grpo_loss(logp, old_logp, advantages, mask, objective.clip_low, objective.clip_high)
    if kind == "rloo":
        return grpo_loss(logp, old_logp, advantages, mask, objective.clip_range, objective.clip_range)
    if kind == "dr_grpo":
        return dr_grpo_loss(logp, old_logp, advantages, mask, objective.clip_range, normalizer)
    if kind == "gspo":
        return gspo_loss(logp, old_logp, advantages, mask, objective.clip_low, objective.clip_high)
    if kind == "opo":
        return policy_gradient_loss(logp, old_logp, advantages, mask)
    if kind == "aipo":
        return aipo_loss(logp, behaviour_logp, advantages, mask, objective.delta)
    raise ValueError(f"unknown objective {kind}")


def stream_update(policy, optimizer: torch.optim.Optimizer, batch: StreamBatch, prepared: StreamPrepared,
                  cfg: PPOConfig, beta: float, generator: torch.Generator, scheduler=None,
                  outputs=stream_outputs) -> dict[str, float]:
    """`cfg.epochs` passes over the streams in shuffled minibatches of `cfg.minibatch_size`
    (`ppo.minibatch_epochs`), each minibatch one forward pass:

        loss = objective (+ kl_beta * mean k3 KL for group kinds) - entropy_beta * entropy (+ vf_coef * L_V)

    `outputs(policy, part, temperature, with_values)` -> (logp, entropy, values) of a minibatch's actions:
    stream_outputs for streams; code mode (icrl_core/code_rl.py) passes ppo.policy_outputs for its token
    batches (ppo.PPOBatch has the same select / action_mask / behaviour_logp)."""
    critic = uses_critic(cfg)
    kl_in_loss = cfg.objective.kind != "ppo" and beta > 0
    reference = needs_reference(cfg, beta)
    full_actions = batch.action_mask.shape[1]

    def minibatch_loss(index: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        part = batch.select(index)
        n_actions = part.action_mask.shape[1]
        old_logp = prepared.old_logp[index, :n_actions]
        mask = part.action_mask
        logp, entropy, values = outputs(policy, part, cfg.temperature, with_values=critic)
        policy_loss = objective_loss(cfg, logp, old_logp, part.behaviour_logp, prepared.advantages[index, :n_actions],
                                     mask, normalizer=float(len(index) * full_actions))
        entropy_mean = masked_mean(entropy, mask)
        loss = policy_loss - cfg.entropy_beta * entropy_mean
        kl_term = (masked_mean(k3_kl(logp, prepared.ref_logp[index, :n_actions]), mask) if reference
                   else torch.tensor(float("nan")))
        if kl_in_loss:
            loss = loss + beta * kl_term
        value_loss = torch.zeros(())
        if values is not None:
            value_loss = clipped_value_loss(values, prepared.old_values[index], prepared.returns[index],
                                            part.step_mask, cfg.value_clip)
            loss = loss + cfg.vf_coef * value_loss
        with torch.no_grad():
            metrics = {"loss": loss.item(), "policy_loss": policy_loss.item(), "value_loss": value_loss.item(),
                       "entropy": entropy_mean.item(), "kl_k3": kl_term.item(),
                       "approx_kl": approx_kl(logp, old_logp, mask).item(),
                       "clip_frac": clip_fraction(logp, old_logp, mask, cfg.clip_range).item()}
        return loss, metrics

    return minibatch_epochs(policy, optimizer, len(batch), cfg, generator, minibatch_loss, scheduler)


# --------------------------------------------------------------------------------------------------------------
# Rolling out and measuring streams


def roll_out(policy, sources, data: DataConfig, cfg: PPOConfig, seed: int, iteration: int, groups: Sequence[int],
             split: str, max_tokens: int) -> list[Stream]:
    """The streams of `groups` at `iteration` (0: validation): tasks keyed by (split, iteration, group), draws
    by (seed, iteration, group, stream)."""
    streams: list[Stream] = []
    for group in groups:
        task = sample_stream_task(sources, data, cfg.stream.steps, seed, f"{split}-{iteration}-{group}", split)
        rngs = [stream_rng(seed, iteration, group, g) for g in range(cfg.stream.group_size)]
        streams += generate_streams(policy, task, rngs, cfg.temperature, group, max_tokens)
    return streams


def stream_statistics(streams: Sequence[Stream]) -> dict[str, float]:
    """Mean reward over all steps and over each half of the streams (the second half above the first: the
    policy learns within a stream), the answers' mean probability, and how often an answer marked wrong is
    followed by a different label (a policy that copies its last answer whatever the feedback says: 0)."""
    rewards = [r for s in streams for r in s.rewards]
    half = len(streams[0].steps) // 2
    first = [r for s in streams for r in s.rewards[:half]]
    second = [r for s in streams for r in s.rewards[half:]]
    switches = [s.steps[t + 1].record.prediction != s.steps[t].record.prediction
                for s in streams for t in range(len(s.steps) - 1) if not s.steps[t].record.reward]
    probs = [float(torch.tensor(step.logp).exp()) for s in streams for step in s.steps]
    return {
        "mean_reward": sum(rewards) / len(rewards),
        "reward_first_half": sum(first) / max(len(first), 1),
        "reward_second_half": sum(second) / max(len(second), 1),
        "switch_after_wrong": sum(switches) / len(switches) if switches else float("nan"),
        "answer_prob": sum(probs) / len(probs),
    }


def evaluate_streams(policy, sources, data: DataConfig, cfg: PPOConfig, seed: int, max_tokens: int
                     ) -> dict[str, float]:
    """The validation groups (tasks from the validation pools, the same draws at every evaluation)."""
    if cfg.stream.eval_groups == 0:
        return {}
    streams = roll_out(policy, sources, data, cfg, seed, 0, range(cfg.stream.eval_groups), "val", max_tokens)
    stats = stream_statistics(streams)
    return {"val_accuracy": stats["mean_reward"], "val_reward": stats["mean_reward"],
            "val_reward_first_half": stats["reward_first_half"],
            "val_reward_second_half": stats["reward_second_half"],
            "val_switch_after_wrong": stats["switch_after_wrong"]}


def distilled(policy, streams: Sequence[Stream], batch: StreamBatch, cfg: PPOConfig
              ) -> tuple[StreamBatch, dict[str, float]]:
    """The batch with each step's reward replaced by the context-distillation reward (ppo.distill,
    `objectives.distillation_rewards`), and the mean log-probs of the answers under teacher and student."""
    distill = cfg.distill
    mask = batch.step_mask
    student = step_sums(batch.behaviour_logp, batch.action_step, batch.action_mask, mask.shape[1])
    teacher = (teacher_logprobs(policy, streams, cfg.temperature) if distill.teacher_tau > 0
               else torch.zeros_like(student))
    shaped = distillation_rewards(batch.rewards, teacher, student, mask, distill.adv_tau, distill.teacher_tau,
                                  distill.student_tau)
    metrics = {"teacher_logp": float(masked_mean(teacher, mask)) if distill.teacher_tau > 0 else float("nan"),
               "student_logp": float(masked_mean(student, mask)), "shaped_reward": float(masked_mean(shaped, mask))}
    return dataclasses.replace(batch, rewards=shaped), metrics


def stream_step(policy, optimizer, scheduler, sources, data: DataConfig, cfg: PPOConfig, beta: float, seed: int,
                step: int, generator: torch.Generator, max_tokens: int) -> dict[str, float]:
    """One iteration in stream mode: this worker's share of the groups rolled out, prepared, updated."""
    started = time.perf_counter()
    streams = roll_out(policy, sources, data, cfg, seed, step, shard(range(cfg.stream.groups)), "train",
                       max_tokens)
    rollout_seconds = time.perf_counter() - started
    batch = collate_streams(streams, policy.tokenizer.pad_token_id)
    task_rewards = batch.rewards
    distill_metrics = {}
    if cfg.distill.active:
        batch, distill_metrics = distilled(policy, streams, batch, cfg)
    prepared = prepare_streams(policy, batch, cfg, beta)
    metrics = stream_update(policy, optimizer, batch, prepared, cfg, beta, generator, scheduler)
    mask, step_mask = batch.action_mask, batch.step_mask
    unknown = float("nan") if not needs_reference(cfg, beta) else None  # no reference pass: no KL
    metrics.update({
        "kl": unknown if unknown is not None else float(prepared.kl.sum(1).mean()),
        "kl_per_token": unknown if unknown is not None else float(masked_mean(prepared.kl, mask)),
        "explained_variance": float(explained_variance(prepared.old_values, prepared.returns, step_mask))
        if uses_critic(cfg) else float("nan"),
        "return_mean": float(masked_mean(prepared.returns, step_mask)),
        "advantage_abs": float(masked_mean(prepared.step_advantages.abs(), step_mask)),
        "action_tokens": float(mask.sum()),
        "beta": beta,
        **stream_statistics(streams),
        "task_accuracy": float(masked_mean(task_rewards, step_mask)),
        **distill_metrics,
        "rollout_seconds": rollout_seconds,
        "update_seconds": time.perf_counter() - started - rollout_seconds,
        "tokens": float(batch.attention_mask.sum()),
    })
    metrics = mean_metrics(metrics)
    metrics["lr"] = optimizer.param_groups[0]["lr"]
    return metrics

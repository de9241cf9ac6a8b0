"""PPO for in-context RL episodes, written as small pure functions (CleanRL style).

Shapes: B episodes in a batch, T token positions of the padded episode sequences, A generated (action) tokens of
an episode (all of its answers, in order, left-aligned and right-padded to the batch maximum), V vocabulary size,
N = number of action tokens in the batch (the True entries of an action mask).

An episode is one trajectory. Its actions are the tokens the policy generated for its n queries; the tokens in
between (end of turn, feedback, the next query) are the environment's. The reward of a query's answer (its
score) arrives at the answer's last token; every action token also pays a KL penalty to the reference policy:

    r_t = score_t - beta * KL_t,   KL_t = log pi_old(a_t | s_t) - log pi_ref(a_t | s_t)     (k1 estimator)

Advantages come from GAE over the episode's action tokens with the value head's V(s_t); the policy loss is the
clipped surrogate, the value loss is clipped, and an entropy bonus keeps the policy from collapsing early.

Off-policy correction for epsilon-mixture exploration (see icrl_core/rollout.py): tokens were sampled from the
behaviour policy mu = (1 - eps) * pi_old + eps * q, not from pi_old. We use the *decoupled* PPO objective
(Hilton et al., 2021, "Batch size-invariance for policy optimization"): the trust-region ratio is taken against
pi_old (so clipping measures only how far this update moved the policy, never how far exploration was from the
policy), and each token's term is weighted by the detached importance weight w_t = pi_old(a_t) / mu(a_t). Because
mu >= (1 - eps) * pi_old, w_t <= 1 / (1 - eps): the weight is bounded without truncation. With eps = 0, w_t = 1
and this is plain PPO.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from icrl_core.config import AdaptiveKL, FixedKL, PPOConfig
from icrl_core.distributed import average_gradients, mean_metrics
from icrl_core.objectives import clipped_surrogate, masked_mean, masked_var, whiten

# --------------------------------------------------------------------------------------------------------------
# Per-token quantities


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[token]. logits (N, V), tokens (N,) -> (N,)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """H = -sum_v p_v log p_v with p = softmax(logits / temperature), computed as logsumexp(z) - sum_v p_v z_v.
    logits (N, V) -> (N,)."""
    z = logits.float() / temperature
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(-1)


def per_token_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 estimator of KL(pi || pi_ref) per token: KL_t = log pi(a_t) - log pi_ref(a_t).

    Unbiased for the per-sequence KL when a_t ~ pi (its expectation over pi is the exact KL); a single token's
    value can be negative. k1 is what Ziegler et al. (2019) and TRL's PPO put into the reward. Shapes (B, A)."""
    return logp - ref_logp


def shape_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """r_t = score_t - beta * KL_t on action tokens, 0 elsewhere.

    scores (B, A): a query's score sits at the last token of its answer, zeros elsewhere; kl, mask (B, A)."""
    return (scores - beta * kl) * mask.to(kl.dtype)


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                   lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016) over each row's action tokens.

        delta_t = r_t + gamma * V_{t+1} - V_t           (V_{t+1} = 0 after the last action: the episode ends)
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                              (the value target)

    rewards, values, mask: (B, A), each row's valid entries a left-aligned prefix. Returns (advantages, returns),
    both (B, A), zero where mask is False."""
    maskf = mask.to(rewards.dtype)
    values = values * maskf
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])
    n_actions = rewards.shape[1]
    for t in reversed(range(n_actions)):
        next_valid = maskf[:, t + 1] if t + 1 < n_actions else torch.zeros_like(last)
        next_value = values[:, t + 1] if t + 1 < n_actions else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value * next_valid - values[:, t]
        last = (delta + gamma * lam * next_valid * last) * maskf[:, t]
        advantages[:, t] = last
    returns = (advantages + values) * maskf
    return advantages, returns


def behaviour_weights(old_logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """Importance weight of the decoupled objective, w_t = pi_old(a_t) / mu(a_t) = exp(old - behaviour).

    mu = (1 - eps) pi_old + eps q >= (1 - eps) pi_old, so w_t <= 1 / (1 - eps). Detached (a constant)."""
    return torch.exp(old_logp - behaviour_logp).detach()


# --------------------------------------------------------------------------------------------------------------
# Losses


def clipped_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                        clip_range: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Clipped surrogate (Schulman et al., 2017), decoupled form:

        rho_t = pi(a_t) / pi_old(a_t) = exp(logp - old_logp)
        L     = -mean_t  w_t * min(rho_t * A_t, clip(rho_t, 1 - c, 1 + c) * A_t)

    w_t = behaviour_weights(...) (1 without exploration). All (B, A) or (N,); returns a scalar."""
    loss = clipped_surrogate(logp, old_logp, advantages, clip_range, clip_range)
    if weights is not None:
        loss = weights * loss
    return masked_mean(loss, mask)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                       clip_range: float) -> torch.Tensor:
    """Clipped value loss (as in OpenAI baselines' PPO2):

        V_clip = V_old + clip(V - V_old, -c, c)
        L_V    = 0.5 * mean_t max((V - R)^2, (V_clip - R)^2)

    All (B, A) or (N,); returns a scalar."""
    clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    loss = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * masked_mean(loss, mask)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean token entropy over action tokens; the loss subtracts entropy_beta times this."""
    return masked_mean(entropy, mask)


# --------------------------------------------------------------------------------------------------------------
# Diagnostics


def approx_kl(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi_old || pi) (Schulman, 2020): mean_t (rho_t - 1) - log rho_t, rho = pi / pi_old.
    Non-negative for every token; 0 when the policy did not move."""
    log_ratio = logp - old_logp
    return masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, mask)


def clip_fraction(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, clip_range: float) -> torch.Tensor:
    """Share of action tokens whose ratio left [1 - c, 1 + c]: mean_t 1[|rho_t - 1| > c]."""
    ratio = torch.exp(logp - old_logp)
    return masked_mean(((ratio - 1.0).abs() > clip_range).to(logp.dtype), mask)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the masked entries: 1 = perfect critic, 0 = no better than a constant,
    negative = worse. NaN when the returns do not vary."""
    var_returns = masked_var(returns, mask)
    if var_returns.item() == 0:
        return torch.tensor(float("nan"))
    return 1.0 - masked_var(returns - values, mask) / var_returns


# --------------------------------------------------------------------------------------------------------------
# KL coefficient control


def adaptive_kl_coefficient(beta: float, observed_kl: float, target: float, horizon: int, n_steps: int) -> float:
    """Ziegler et al. (2019), proportional controller on the log of beta:

        e        = clip(KL / target - 1, -0.2, 0.2)
        beta'    = beta * (1 + e * n_steps / horizon)

    observed_kl is the mean KL per episode of the batch (nats), n_steps the number of episodes in it."""
    error = min(max(observed_kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / horizon)


def next_kl_coefficient(control: FixedKL | AdaptiveKL, beta: float, observed_kl: float, n_steps: int) -> float:
    """The KL coefficient for the next iteration under `ppo.kl_control` (fixed: unchanged)."""
    if isinstance(control, AdaptiveKL):
        return adaptive_kl_coefficient(beta, observed_kl, control.target, control.horizon, n_steps)
    return beta


# --------------------------------------------------------------------------------------------------------------
# A rollout batch as tensors


@dataclass
class PPOBatch:
    """Rolled-out episodes, padded. input_ids, attention_mask, action_positions: (B, T) (action_positions is True
    where input_ids holds a generated token); behaviour_logp, scores, action_mask: (B, A)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_positions: torch.Tensor
    behaviour_logp: torch.Tensor
    scores: torch.Tensor
    action_mask: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, index: torch.Tensor) -> PPOBatch:
        """Rows `index`, trimmed to their longest sequence and action count."""
        t_max = int(self.attention_mask[index].sum(1).max())
        a_max = max(int(self.action_mask[index].sum(1).max()), 1)
        return PPOBatch(self.input_ids[index, :t_max], self.attention_mask[index, :t_max],
                        self.action_positions[index, :t_max], self.behaviour_logp[index, :a_max],
                        self.scores[index, :a_max], self.action_mask[index, :a_max])


def collate(sequences: Sequence[Sequence[int]], action_positions: Sequence[Sequence[int]],
            behaviour_logp: Sequence[Sequence[float]], scores: Sequence[Sequence[float]], pad_id: int) -> PPOBatch:
    """Right-pad episodes into a PPOBatch. action_positions[b] lists the indices of episode b's generated tokens
    in sequences[b] (increasing); behaviour_logp[b] and scores[b] have one entry per generated token."""
    batch, t_max = len(sequences), max(len(s) for s in sequences)
    a_max = max(max(len(p) for p in action_positions), 1)
    input_ids = torch.full((batch, t_max), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, t_max), dtype=torch.long)
    positions = torch.zeros((batch, t_max), dtype=torch.bool)
    mu = torch.zeros((batch, a_max))
    score = torch.zeros((batch, a_max))
    action_mask = torch.zeros((batch, a_max), dtype=torch.bool)
    for b, seq in enumerate(sequences):
        n = len(action_positions[b])
        if n and action_positions[b][0] < 1:
            raise ValueError("an action cannot be the first token of a sequence (nothing predicts it)")
        input_ids[b, :len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        attention[b, :len(seq)] = 1
        positions[b, list(action_positions[b])] = True
        mu[b, :n] = torch.tensor(list(behaviour_logp[b]), dtype=torch.float32)
        score[b, :n] = torch.tensor(list(scores[b]), dtype=torch.float32)
        action_mask[b, :n] = True
    return PPOBatch(input_ids, attention, positions, mu, score, action_mask)


def policy_outputs(policy, batch: PPOBatch, temperature: float, with_values: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One forward pass: (logp, entropy, values) of the action tokens, each (B, A) (zero where no action).

    The logits predicting token t sit at position t - 1, so the LM head runs only at positions whose next token
    is an action (`logits_at`), and V(s_t) is the value head at the same positions."""
    predicts_action = torch.zeros_like(batch.action_positions)
    predicts_action[:, :-1] = batch.action_positions[:, 1:]
    logits, values, _ = policy.forward(batch.input_ids, batch.attention_mask, logits_at=predicts_action,
                                       with_values=with_values)
    # The per-action results (N,) come back to the CPU, where the losses on them run (autograd carries the
    # gradient back to the device): the heavy pass runs on the policy's device, the PPO code is device-free.
    actions = batch.input_ids[batch.action_positions].to(logits.device)       # (N,)
    logp = torch.zeros(batch.action_mask.shape, dtype=torch.float32)
    entropy = torch.zeros(batch.action_mask.shape, dtype=torch.float32)
    logp = logp.masked_scatter(batch.action_mask, token_logprobs(logits, actions, temperature).cpu())
    entropy = entropy.masked_scatter(batch.action_mask, entropy_from_logits(logits, temperature).cpu())
    value = None
    if values is not None:
        value = torch.zeros(batch.action_mask.shape, dtype=torch.float32)
        value = value.masked_scatter(batch.action_mask, values[predicts_action.to(values.device)].float().cpu())
    return logp, entropy, value


# --------------------------------------------------------------------------------------------------------------
# The PPO iteration


@dataclass
class Prepared:
    """Fixed quantities of one rollout batch (no gradients). All (B, A)."""

    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    old_values: torch.Tensor
    kl: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    weights: torch.Tensor


def _chunks(n: int, size: int) -> Iterator[torch.Tensor]:
    for start in range(0, n, size):
        yield torch.arange(start, min(start + size, n))


@torch.no_grad()
def prepare(policy, batch: PPOBatch, cfg: PPOConfig, beta: float, chunk: int) -> Prepared:
    """pi_old log-probs and values, reference log-probs (`with policy.reference()`: LoRA disabled, no second
    model copy), the KL-shaped rewards, GAE advantages (whitened if configured) and returns."""
    policy.eval()
    old, ref, vals = [], [], []
    for index in _chunks(len(batch), chunk):
        part = batch.select(index)
        logp, _, value = policy_outputs(policy, part, cfg.temperature, with_values=cfg.value_head)
        with policy.reference():
            ref_logp, _, _ = policy_outputs(policy, part, cfg.temperature, with_values=False)
        old.append(logp), ref.append(ref_logp), vals.append(value if value is not None else torch.zeros_like(logp))
    a_max = batch.action_mask.shape[1]

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([nn.functional.pad(p, (0, a_max - p.shape[1])) for p in parts])

    old_logp, ref_logp, old_values = cat(old), cat(ref), cat(vals)
    mask = batch.action_mask
    kl = per_token_kl(old_logp, ref_logp) * mask
    rewards = shape_rewards(batch.scores, kl, mask, beta)
    advantages, returns = gae_advantages(rewards, old_values, mask, cfg.gamma, cfg.gae_lambda)
    if cfg.whiten_advantages:
        advantages = whiten(advantages, mask)
    weights = behaviour_weights(old_logp, batch.behaviour_logp) * mask
    return Prepared(old_logp, ref_logp, old_values, kl, rewards, advantages, returns, weights)


def ppo_epochs(policy, optimizer: torch.optim.Optimizer, batch: PPOBatch, prepared: Prepared, cfg: PPOConfig,
               generator: torch.Generator, scheduler=None, regularizer=None) -> dict[str, float]:
    """`cfg.epochs` passes over the batch in shuffled minibatches of `cfg.minibatch_size` episodes
    (`minibatch_epochs`):

        loss = policy_loss + vf_coef * value_loss - entropy_beta * entropy"""

    def minibatch_loss(index: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        part = batch.select(index)
        a_max = part.action_mask.shape[1]
        old_logp = prepared.old_logp[index, :a_max]
        advantages = prepared.advantages[index, :a_max]
        weights = prepared.weights[index, :a_max]
        mask = part.action_mask
        logp, entropy, values = policy_outputs(policy, part, cfg.temperature, with_values=cfg.value_head)
        policy_loss = clipped_policy_loss(logp, old_logp, advantages, mask, cfg.clip_range, weights)
        entropy_mean = entropy_bonus(entropy, mask)
        loss = policy_loss - cfg.entropy_beta * entropy_mean
        value_loss = torch.zeros(())
        if values is not None:
            value_loss = clipped_value_loss(values, prepared.old_values[index, :a_max],
                                            prepared.returns[index, :a_max], mask, cfg.value_clip)
            loss = loss + cfg.vf_coef * value_loss
        with torch.no_grad():
            metrics = {"loss": loss.item(), "policy_loss": policy_loss.item(), "value_loss": value_loss.item(),
                       "entropy": entropy_mean.item(), "approx_kl": approx_kl(logp, old_logp, mask).item(),
                       "clip_frac": clip_fraction(logp, old_logp, mask, cfg.clip_range).item()}
        return loss, metrics

    return minibatch_epochs(policy, optimizer, len(batch), cfg, generator, minibatch_loss, scheduler, regularizer)


def minibatch_epochs(policy, optimizer: torch.optim.Optimizer, n_items: int, cfg: PPOConfig,
                     generator: torch.Generator, minibatch_loss, scheduler=None, regularizer=None) -> dict[str, float]:
    """`cfg.epochs` passes over `n_items` rollouts in shuffled minibatches of `cfg.minibatch_size`:
    `minibatch_loss(index)` -> (loss, metrics) is backpropagated (divided by `grad_accum`), gradients are
    averaged across data-parallel workers and clipped to `max_grad_norm`, an optimizer step every `grad_accum`
    minibatches (and after the last of an epoch). `regularizer()`, if given, backpropagates a term of its own
    into each optimizer step's gradient just before it is averaged (the general-chat replay term,
    supervised.replay_step) and returns its metrics. Returns this worker's metrics averaged over minibatches
    (the regularizer's over optimizer steps)."""
    policy.train()
    params = policy.trainable_parameters()
    sums: dict[str, float] = {}
    extra: dict[str, float] = {}
    count = pending = updates = 0
    grad_norm = 0.0
    for _ in range(cfg.epochs):
        order = torch.randperm(n_items, generator=generator)
        minibatches = [order[i:i + cfg.minibatch_size] for i in range(0, n_items, cfg.minibatch_size)]
        for number, index in enumerate(minibatches):
            loss, metrics = minibatch_loss(index)
            (loss / cfg.grad_accum).backward()
            pending += 1
            if pending == cfg.grad_accum or number == len(minibatches) - 1:
                if regularizer is not None:
                    for key, value in regularizer().items():
                        extra[key] = extra.get(key, 0.0) + value
                    updates += 1
                average_gradients(params)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                pending = 0
            for key, value in {**metrics, "grad_norm": grad_norm}.items():
                sums[key] = sums.get(key, 0.0) + value
            count += 1
    if scheduler is not None:
        scheduler.step()
    policy.eval()
    return {**{k: v / max(count, 1) for k, v in sums.items()}, **{k: v / max(updates, 1) for k, v in extra.items()}}


def ppo_iteration(policy, optimizer: torch.optim.Optimizer, batch: PPOBatch, cfg: PPOConfig, beta: float,
                  generator: torch.Generator, scheduler=None, regularizer=None) -> dict[str, float]:
    """One PPO update on a rollout batch: prepare (old/ref log-probs, values, shaped rewards, GAE), then
    `ppo_epochs`. Returns the update metrics plus batch statistics (KL per episode, explained variance, ...)."""
    prepared = prepare(policy, batch, cfg, beta, chunk=cfg.batch_size)
    mask = batch.action_mask
    metrics = ppo_epochs(policy, optimizer, batch, prepared, cfg, generator, scheduler, regularizer)
    episode_kl = (prepared.kl * mask).sum(1)
    metrics.update({
        "kl": float(episode_kl.mean()),
        "kl_per_token": float(masked_mean(prepared.kl, mask)),
        "explained_variance": float(explained_variance(prepared.old_values, prepared.returns, mask))
        if cfg.value_head else math.nan,
        "value_mean": float(masked_mean(prepared.old_values, mask)),
        "return_mean": float(masked_mean(prepared.returns, mask)),
        "behaviour_weight": float(masked_mean(prepared.weights, mask)),
        "action_tokens": float(mask.sum()),
        "beta": beta,
    })
    return mean_metrics(metrics)


# --------------------------------------------------------------------------------------------------------------
# The pieces of the training loop (icrl_core/policy_optimization.py runs them on icrl_core/training_loop.py)


VALUE_HEAD_PREFIX = "value_head."


def episode_indices(n_episodes: int, per_step: int, step: int, seed: int) -> list[int]:
    """Episodes rolled out at PPO iteration `step` (1-based): consecutive slices of a seeded permutation, a new
    permutation per pass over the data. A pure function of (seed, step), so a resumed run sees the same data."""
    import numpy as np

    out = []
    for i in range((step - 1) * per_step, step * per_step):
        data_pass, position = divmod(i, n_episodes)
        order = np.random.default_rng([seed, data_pass]).permutation(n_episodes)
        out.append(int(order[position]))
    return out


def iteration_generator(seed: int, step: int) -> torch.Generator:
    """The sampling / shuffling RNG of one iteration, derived from (seed, step) so resuming is exact."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def trainable_tensors(policy) -> dict[str, torch.Tensor]:
    tensors = dict(policy.trainable_state_dict())
    if policy.value_head is not None:
        tensors.update({VALUE_HEAD_PREFIX + k: v.detach().clone() for k, v in policy.value_head.state_dict().items()})
    return tensors


def load_trainable_tensors(policy, tensors: dict[str, torch.Tensor]) -> None:
    head = {k[len(VALUE_HEAD_PREFIX):]: v for k, v in tensors.items() if k.startswith(VALUE_HEAD_PREFIX)}
    policy.load_trainable_state_dict({k: v for k, v in tensors.items() if not k.startswith(VALUE_HEAD_PREFIX)},
                                     "checkpoint")
    if policy.value_head is not None:
        from icrl_core.errors import CheckpointError

        if not head:
            raise CheckpointError("checkpoint has no value head but ppo.value_head is on")
        policy.value_head.load_state_dict(head)


def zero_value_head(policy) -> None:
    """Start a fresh critic at V = 0. Its random init reads SmolLM2's final hidden states (norms in the tens) as
    values of several units against rewards in [0, 1]; the value-loss gradient through the shared backbone would
    then swamp the policy gradient in the first iterations."""
    if policy.value_head is not None:
        with torch.no_grad():
            policy.value_head.linear.weight.zero_()
            policy.value_head.linear.bias.zero_()


def make_optimizer(policy, cfg: PPOConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW on the trainable weights (adapter + value head) and a linear warm-up over PPO iterations."""
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=cfg.learning_rate,
                                  weight_decay=cfg.weight_decay)
    warmup = cfg.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: min(1.0, (it + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler


def rollout_batch(rollouts, pad_id: int) -> PPOBatch:
    """PPOBatch of scored rollouts (see icrl_core.rollout)."""
    return collate([r.ppo_ids() for r in rollouts], [r.action_positions for r in rollouts],
                   [r.behaviour_logp for r in rollouts], [r.token_scores() for r in rollouts], pad_id)


def evaluate(policy, episodes, cfg: PPOConfig, max_tokens: int, scorer=None) -> dict[str, float]:
    """Greedy answers to validation episodes: exact-match accuracy (and the configured reward's mean)."""
    from icrl_core.rollout import Sampling, generate_rollouts, score_rollouts

    if not episodes:
        return {}
    accuracy, score, count = 0.0, 0.0, 0
    for start in range(0, len(episodes), cfg.batch_size):
        rollouts = generate_rollouts(policy, episodes[start:start + cfg.batch_size], Sampling(greedy=True),
                                     cfg.max_new_tokens, max_tokens, feedback_in_context=cfg.feedback_in_context)
        score_rollouts(rollouts, cfg.reward, scorer)
        for rollout in rollouts:
            accuracy += sum(rollout.task_rewards)
            score += sum(rollout.scores)
            count += len(rollout.answers)
    return {"val_accuracy": accuracy / count, "val_reward": score / count}


def ppo_step(policy, optimizer, scheduler, episodes, cfg: PPOConfig, beta: float, generator: torch.Generator,
             max_tokens: int, scorer=None, regularizer=None) -> dict[str, float]:
    """One PPO iteration: roll out `episodes` (epsilon-mixture sampling, batched with a KV cache), score them,
    update (`ppo_iteration`). Returns its metrics (reward statistics, update diagnostics, timings)."""
    import time

    from icrl_core.rollout import Sampling, generate_rollouts, score_rollouts

    started = time.perf_counter()
    rollouts = []
    for start in range(0, len(episodes), cfg.batch_size):
        rollouts += generate_rollouts(policy, episodes[start:start + cfg.batch_size], Sampling.from_ppo(cfg),
                                      cfg.max_new_tokens, max_tokens, generator, cfg.feedback_in_context)
    score_rollouts(rollouts, cfg.reward, scorer)
    rollout_seconds = time.perf_counter() - started
    batch = rollout_batch(rollouts, policy.tokenizer.pad_token_id)
    metrics = ppo_iteration(policy, optimizer, batch, cfg, beta, generator, scheduler, regularizer)
    answers = [a for r in rollouts for a in r.answers]
    generated = sum(len(a.token_ids) for a in answers)
    metrics.update(mean_metrics({
        "mean_reward": sum(s for r in rollouts for s in r.scores) / len(answers),
        "task_accuracy": sum(a.task_reward for a in answers) / len(answers),
        "answer_tokens": generated / len(answers),
        "explored_fraction": sum(a.explored for a in answers) / max(generated, 1),
        "unfinished_answers": sum(not a.finished for a in answers) / len(answers),
        "rollout_seconds": rollout_seconds,
        "update_seconds": time.perf_counter() - started - rollout_seconds,
        "tokens": float(sum(len(r.ppo_ids()) for r in rollouts)),
    }))
    metrics["lr"] = optimizer.param_groups[0]["lr"]
    return metrics


def summarize(history: list[dict], evals: list[dict]) -> dict[str, float]:
    """Final metrics: mean reward (and, in code mode, each reward component) over the first and the last 20% of
    iterations, the last iteration's diagnostics, validation accuracy before and after training."""
    summary: dict[str, float] = {}
    if history:
        n = len(history)
        fifth = max(1, math.ceil(0.2 * n))
        first = [h["mean_reward"] for h in history[:fifth]]
        last = [h["mean_reward"] for h in history[-fifth:]]
        summary.update({
            "iterations": n,
            "mean_reward_first_20pct": sum(first) / len(first),
            "mean_reward_last_20pct": sum(last) / len(last),
        })
        summary["reward_gain"] = summary["mean_reward_last_20pct"] - summary["mean_reward_first_20pct"]
        for key in ("mean_reward", "task_accuracy", "kl", "entropy", "clip_frac", "approx_kl", "value_loss",
                    "policy_loss", "explained_variance", "beta"):
            if key in history[-1]:
                summary[f"final_{key}"] = history[-1][key]
        for key in sorted(k for k in history[-1] if k.startswith("reward/")):  # code mode's reward components
            summary[f"{key}_first_20pct"] = sum(h[key] for h in history[:fifth]) / fifth
            summary[f"{key}_last_20pct"] = sum(h[key] for h in history[-fifth:]) / fifth
    if evals:
        summary["val_accuracy_before"] = evals[0]["val_accuracy"]
        summary["val_accuracy_after"] = evals[-1]["val_accuracy"]
        summary["val_reward_before"] = evals[0]["val_reward"]
        summary["val_reward_after"] = evals[-1]["val_reward"]
    return summary

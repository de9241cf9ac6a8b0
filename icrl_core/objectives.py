"""Policy-optimization objectives: advantage estimators and losses, one pure function each (CleanRL style), and
their config schema (`ppo.objective`, a union discriminated on `kind`; in icrl_core/objective_config.py, which does
not import torch).

Shapes: B sequences (in-context RL streams), T steps of a stream, A action tokens of a stream (left-aligned,
right-padded), G sequences of one group (same task and query order). `mask` marks the valid entries.
Under stream training (icrl_core/streams.py) an action token is a *decision* of constrained decoding: a label
token chosen among several children of the label trie; its log-probability is the log-softmax restricted to
those children. Forced tokens (one child) decide nothing and are no actions.

Returns and advantages are per step; a step's advantage is given to each of its action tokens.

    R_t  = sum_{k >= t} gamma^(k - t) r_k            (discounted_returns: later rewards of the stream count)

Group baselines are taken per step position t across the G streams of a group: they answer the same query at
step t, so the baseline compares answers to one query, each after its own history.

    GRPO      A_{g,t} = (R_{g,t} - mean_g R_t) / (std_g R_t + eps)           (Shao et al., 2024; TRL)
    Dr.GRPO   A_{g,t} =  R_{g,t} - mean_g R_t                                (Liu et al., 2025: no std)
    RLOO      A_{g,t} =  R_{g,t} - (sum_{g' != g} R_{g',t}) / (G - 1)        (Ahmadian et al., 2024)
    OPO       A_{g,t} =  R_{g,t} - sum_g l_{g,t} R_{g,t} / sum_g l_{g,t}     (Hao et al., 2025; l = action tokens)

Losses (rho = pi / pi_old per action token; each returns a scalar to minimise):

    clipped       -min(rho A, clip(rho, 1 - c_low, 1 + c_high) A)   per token (PPO, GRPO, RLOO, Dr.GRPO)
    GSPO          the same with the sequence ratio s = exp(mean_t log rho_t) in place of rho (token form)
    AIPO          -min(pi / mu, delta) A   per token, mu = the behaviour policy  (Llama-RL; prime-rl's default)
    OPO           -rho A  per token (exactly on-policy: its gradient is sum_t A_t grad log pi)
    KL            k3 per token: exp(ref - logp) - (ref - logp) - 1   (TRL's GRPO KL term)
    exact KL      sum_v pi(v) (log pi(v) - log pi_base(v)) per position, over the vocabulary (bootstrap, replay)
    DPO / IPO     preference losses on (chosen, rejected) log-prob sums under policy and reference

Aggregations: `token_mean` (sum over all tokens / token count), `sequence_mean` (each sequence's token mean,
then the mean over sequences: GRPO's 1/G sum_i 1/|o_i| sum_t), `token_sum` (sum / a constant: Dr.GRPO).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from icrl_core.objective_config import (  # noqa: F401  (the schema, re-exported beside its losses)
    OBJECTIVE_KINDS,
    OBJECTIVE_TYPES,
    AIPOObjective,
    ContextDistillation,
    DrGRPOObjective,
    GRPOObjective,
    GSPOObjective,
    Objective,
    OPOObjective,
    PPOObjective,
    RLOOObjective,
)

# --------------------------------------------------------------------------------------------------------------
# Masked statistics and aggregations


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """mean of x over the True entries of mask (a scalar). x, mask: same shape."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance of x over the True entries of mask: sum((x - mean)^2) / (n - 1)."""
    mean = masked_mean(x, mask)
    n = mask.to(x.dtype).sum()
    return (((x - mean) ** 2) * mask.to(x.dtype)).sum() / (n - 1).clamp(min=1.0)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked entries; masked-out entries become 0.
    With shift_mean=False the mean is added back (x scaled only)."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask.to(x.dtype)


token_mean = masked_mean


def sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1/B' sum_i (sum_t x_it / n_i) over the B' rows with at least one valid entry. x, mask (B, A)."""
    maskf = mask.to(x.dtype)
    counts = maskf.sum(-1)
    per_row = (x * maskf).sum(-1) / counts.clamp(min=1.0)
    rows = counts > 0
    return per_row[rows].sum() / rows.sum().clamp(min=1)


def token_sum(x: torch.Tensor, mask: torch.Tensor, normalizer: float) -> torch.Tensor:
    """sum of x over valid entries / a constant `normalizer` (Dr.GRPO: batch size x the longest answer)."""
    return (x * mask.to(x.dtype)).sum() / normalizer


# --------------------------------------------------------------------------------------------------------------
# Returns and advantages (per step)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """R_t = r_t + gamma * R_{t+1} over each row's valid steps (a left-aligned prefix); 0 elsewhere.
    rewards, mask (B, T) -> (B, T)."""
    maskf = mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * maskf[:, t]
        returns[:, t] = running
    return returns


def distillation_rewards(rewards: torch.Tensor, teacher_logp: torch.Tensor, student_logp: torch.Tensor,
                         mask: torch.Tensor, adv_tau: float, teacher_tau: float, student_tau: float) -> torch.Tensor:
    """r'_t = adv_tau * r_t + teacher_tau * log pi_teacher(a_t) - student_tau * log pi_student(a_t) per step
    (ContextDistillation); 0 where mask is False. All (B, T) -> (B, T). The log-probs carry no gradient: they
    enter the update as reward, through the advantages."""
    shaped = adv_tau * rewards + teacher_tau * teacher_logp - student_tau * student_logp
    return shaped.detach() * mask.to(rewards.dtype)


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor, values: torch.Tensor, weight: float) -> torch.Tensor:
    """r'_{b,t} = r_{b,t} + weight * v_b [t = T_b - 1], T_b the number of valid steps of stream b: a value of what
    the whole stream produced (StreamTestReward: its context's expected test accuracy) paid at its last step, so
    the discounted return credits every step before it. rewards, mask (B, T), values (B,) -> (B, T), 0 where mask
    is False."""
    maskf = mask.to(rewards.dtype)
    last = (maskf.sum(1).long() - 1).clamp(min=0)
    terminal = torch.zeros_like(rewards).scatter(1, last[:, None], (weight * values.to(rewards.dtype))[:, None])
    return (rewards + terminal * maskf) * maskf


def discovery_rewards(rewards: torch.Tensor, novel: torch.Tensor, mask: torch.Tensor, bonus: float) -> torch.Tensor:
    """r'_{b,t} = r_{b,t} + bonus * n_{b,t}, where n_{b,t} = 1 when step t of stream b was answered right with a
    label that no rewarded episode of the context it saw holds (a discovery: StreamConfig.discovery_bonus), so a
    right answer the context could not have suggested pays more than one it could. rewards, novel, mask (B, T) ->
    (B, T), 0 where mask is False; novel is 0 wherever the reward is 0."""
    maskf = mask.to(rewards.dtype)
    return (rewards + bonus * novel.to(rewards.dtype)) * maskf


def _group_columns(returns: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask as float, count n_t of valid streams per step, sum over streams) of a group's (G, T) returns."""
    maskf = mask.to(returns.dtype)
    count = maskf.sum(0)
    total = (returns * maskf).sum(0)
    return maskf, count, total


def grpo_advantages(returns: torch.Tensor, mask: torch.Tensor, scale: bool = True, eps: float = 1e-4
                    ) -> torch.Tensor:
    """A_{g,t} = (R_{g,t} - mean_g R_{.,t}) / (std_g R_{.,t} + eps), std unbiased over the group's valid
    streams at step t (as TRL: torch.std, eps 1e-4); without `scale` only centred (Dr.GRPO).
    returns, mask: one group, (G, T) -> (G, T), 0 where mask is False."""
    maskf, count, total = _group_columns(returns, mask)
    mean = total / count.clamp(min=1.0)
    centred = (returns - mean) * maskf
    if not scale:
        return centred
    std = torch.sqrt((centred ** 2).sum(0) / (count - 1).clamp(min=1.0))
    return centred / (std + eps) * maskf


def rloo_advantages(returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A_{g,t} = R_{g,t} - (sum_{g' != g} R_{g',t}) / (n_t - 1): the leave-one-out baseline, independent of
    stream g's own actions (unbiased). (G, T) -> (G, T); 0 where a step has a single valid stream."""
    maskf, count, total = _group_columns(returns, mask)
    others = (total - returns) / (count - 1).clamp(min=1.0)
    return (returns - others) * maskf * (count > 1).to(returns.dtype)


def opo_advantages(returns: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A_{g,t} = R_{g,t} - b_t,  b_t = sum_g l_{g,t} R_{g,t} / sum_g l_{g,t}: OPO's optimal baseline when the
    squared gradient norm of an answer grows with its length l (its action tokens). (G, T) -> (G, T)."""
    maskf = mask.to(returns.dtype)
    weights = lengths.to(returns.dtype) * maskf
    baseline = (weights * returns).sum(0) / weights.sum(0).clamp(min=1e-12)
    return (returns - baseline) * maskf


def per_group(estimator, returns: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor, *extra: torch.Tensor,
              **options) -> torch.Tensor:
    """Apply a group estimator (e.g. rloo_advantages) to the rows of each group. returns, mask, extra: (B, T);
    groups (B,) group id of each row -> (B, T)."""
    out = torch.zeros_like(returns)
    for group in torch.unique(groups):
        rows = groups == group
        out[rows] = estimator(returns[rows], *[e[rows] for e in extra], mask[rows], **options)
    return out


def step_to_tokens(step_values: torch.Tensor, token_step: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Give each action token the value of its step: out[b, a] = step_values[b, token_step[b, a]].
    step_values (B, T), token_step (B, A) long, token_mask (B, A) -> (B, A), 0 where the mask is False."""
    gathered = step_values.gather(1, token_step.clamp(min=0, max=step_values.shape[1] - 1))
    return gathered * token_mask.to(step_values.dtype)


# --------------------------------------------------------------------------------------------------------------
# Per-token terms


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: float) -> torch.Tensor:
    """-min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A) per token, rho = exp(logp - old_logp). Any shape."""
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -torch.min(ratio * advantages, clipped * advantages)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per token (Schulman, 2020; TRL's GRPO): exp(ref - logp) - (ref - logp)
    - 1 >= 0. Any shape."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = mean over row i's valid tokens of (logp - old_logp): the log of GSPO's sequence ratio
    s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|). (B, A) -> (B,)."""
    maskf = mask.to(logp.dtype)
    return ((logp - old_logp) * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)


# --------------------------------------------------------------------------------------------------------------
# Losses


def grpo_loss(logp, old_logp, advantages, mask, clip_low: float, clip_high: float) -> torch.Tensor:
    """L = 1/B sum_i 1/|y_i| sum_t -min(rho A, clip(rho, 1 - c_low, 1 + c_high) A)   (GRPO's sequence mean).
    All (B, A); returns a scalar. RLOO uses it with its own advantages and c_low = c_high."""
    return sequence_mean(clipped_surrogate(logp, old_logp, advantages, clip_low, clip_high), mask)


def dr_grpo_loss(logp, old_logp, advantages, mask, clip_range: float, normalizer: float) -> torch.Tensor:
    """L = sum_{i,t} -min(rho A, clip(rho, 1 - c, 1 + c) A) / normalizer, a constant (streams x steps x the
    longest label path) instead of each sequence's length. All (B, A); returns a scalar."""
    return token_sum(clipped_surrogate(logp, old_logp, advantages, clip_range, clip_range), mask, normalizer)


def gspo_loss(logp, old_logp, advantages, mask, clip_low: float, clip_high: float) -> torch.Tensor:
    """GSPO, token form (GSPO-token of Zheng et al., 2025):

        log w_{i,t} = logp_{i,t} - sg(logp_{i,t}) + sg(log s_i)        (value s_i, gradient of token t only)
        L = 1/B sum_i 1/|y_i| sum_t -min(w_{i,t} A_{i,t}, clip(w_{i,t}, 1 - c_low, 1 + c_high) A_{i,t})

    With one advantage per sequence this is GSPO's sequence objective exactly. All (B, A); a scalar."""
    log_s = sequence_log_ratio(logp, old_logp, mask).detach()
    log_w = logp - logp.detach() + log_s[:, None]
    return grpo_loss(log_w, torch.zeros_like(log_w), advantages, mask, clip_low, clip_high)


def aipo_loss(logp, behaviour_logp, advantages, mask, delta: float) -> torch.Tensor:
    """AIPO (prime-rl's default loss, docs/async.md):

        L = -1 / sum_i |y_i| * sum_{i,t} min(pi(y_t) / mu(y_t), delta) A_t

    mu = the policy that sampled the stream. Above delta the ratio is capped (and carries no gradient), so a
    token mu found unlikely cannot produce a runaway step. All (B, A); a scalar."""
    ratio = torch.exp(logp - behaviour_logp)
    return -token_mean(torch.clamp(ratio, max=delta) * advantages, mask)


def policy_gradient_loss(logp, old_logp, advantages, mask) -> torch.Tensor:
    """L = -1 / sum_i |y_i| * sum_{i,t} rho_t A_t, rho = pi / pi_old (= 1 on-policy, where the gradient is
    -sum_t A_t grad log pi(y_t) / N): OPO's exactly on-policy update. All (B, A); a scalar."""
    return -token_mean(torch.exp(logp - old_logp) * advantages, mask)


def kl_policy_base(policy_logits: torch.Tensor, base_logits: torch.Tensor) -> torch.Tensor:
    """KL_t(pi || pi_base) = sum_v pi(v) (log pi(v) - log pi_base(v)), exact over the vocabulary.

    policy_logits, base_logits: (N, V) at the same positions. -> (N,), >= 0."""
    logp = torch.log_softmax(policy_logits.float(), dim=-1)
    logq = torch.log_softmax(base_logits.float(), dim=-1)
    return (logp.exp() * (logp - logq)).sum(dim=-1)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """DPO (Rafailov et al., 2023), mean over pairs:

        h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))
        L = -log sigmoid(beta * h)

    Each argument (P,): the summed log-probs of a pair's chosen (y_w) or rejected (y_l) answer."""
    h = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    return -F.logsigmoid(beta * h).mean()


def ipo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO (Azar et al., 2023), mean over pairs: L = (h - 1 / (2 beta))^2 with h as in `dpo_loss`: the log-ratio
    margin is regressed to a fixed target instead of pushed to infinity. Arguments (P,)."""
    h = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    return ((h - 1.0 / (2.0 * beta)) ** 2).mean()


def pairwise_rank_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, beta: float) -> torch.Tensor:
    """Reference-free pairwise logistic loss (the preference term of CPO, Xu et al., 2024), mean over pairs:

        margin = log pi(y_w | context) - log pi(y_l | context)
        L      = -log sigmoid(beta * margin)

    Unlike DPO's h, the margin is not measured from a reference, so a pair is satisfied only once its chosen
    answer is ranked first in its own context; the pairs ranked wrong carry the gradient (weight
    sigmoid(-beta margin)). Arguments (P,): the log-probs of each pair's chosen and rejected answer."""
    return -F.logsigmoid(beta * (policy_chosen - policy_rejected)).mean()


def couple_contrast_loss(real_margin: torch.Tensor, renamed_margin: torch.Tensor, beta: float) -> torch.Tensor:
    """The feedback contrast of hindsight couples (icrl_core/hindsight.py), mean over couples, reference-free:

        margin = log pi(y_w | context) - log pi(y_l | context)         in each world, its own chosen y_w
        m      = margin(real context) + margin(renamed context)
        L      = -log sigmoid(beta * m)

    The two worlds' chosen and rejected labels are swapped, so a policy blind to the feedback has m = 0 whatever
    it prefers, and the gradient moves only the difference between the two contexts (the feedback's effect),
    never the preference shared by both. Arguments (C,): each couple's margin in the real and renamed world."""
    return -F.logsigmoid(beta * (real_margin + renamed_margin)).mean()

"""Test-time adaptation for one request episode (stage 6).

1. Answer the request's queries greedily with the current policy: reward *before*.
2. Synthetic rollouts, leave-one-out over the request's exemplars: for each exemplar j whose answer is known to
   be right (a gold pair, or a past attempt with positive reward), an episode whose context is the other
   exemplars and whose query is exemplar j's prompt, with exemplar j's answer as the preferred answer.
   `num_rollouts` answers are sampled for each (temperature `adapt.temperature`, no exploration mixture),
   `adapt.rollout_batch` episodes at a time.
3. Score them (`adapt.reward`: exact match against the held-out answer, the reward model, or both) and keep the
   best rollout of each held-out exemplar (rejection sampling / expert iteration). With the exact task reward a
   best rollout that is still wrong (score 0) is dropped: training on it would teach the error.
4. `adapt.steps` AdamW steps on the kept rollouts: loss = -mean_t log pi(a_t | s_t) over their answer tokens
   (gradient accumulated over `adapt.minibatch_size` rollouts per backward pass).
5. Answer the request's queries again greedily: reward *after*.

The base adapter is left untouched: the trainable weights are snapshotted before step 4 and restored after
step 5 (a temporary copy of the adapter is trained, then discarded); nothing is written to disk here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from icrl_core.config import AdaptConfig
from icrl_core.episodes import Episode, Query
from icrl_core.ppo import collate, load_trainable_tensors, masked_mean, policy_outputs, trainable_tensors
from icrl_core.rollout import Sampling, generate_rollouts, score_rollouts


@dataclass
class AdaptResult:
    episode_id: str
    reward_before: float  # exact-match accuracy on the request's queries, greedy, before adapting
    reward_after: float
    answers_before: list[str]
    answers_after: list[str]
    held_out: int  # exemplars used as synthetic queries
    synthetic_reward: float  # mean score of the synthetic rollouts
    trained_on: int  # rollouts kept for the LoRA steps
    losses: list[float] = field(default_factory=list)
    score_before: float = 0.0  # mean of the configured reward (equals reward_* with the task reward)
    score_after: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def leave_one_out(episode: Episode) -> list[Episode]:
    """One synthetic episode per exemplar with a known-correct answer: the others as context, it as the query.
    (An exemplar whose reward says it was wrong stays in the context only: its right answer is unknown.)"""
    out = []
    for j, held in enumerate(episode.exemplars):
        others = episode.exemplars[:j] + episode.exemplars[j + 1:]
        if not others or (held.reward is not None and held.reward <= 0):
            continue
        # model_construct: the rejected answer is never used here, so it need not differ from the preferred one.
        query = Query.model_construct(prompt=held.prompt, preferred_answer=held.answer, rejected_answer=held.answer)
        out.append(Episode.model_construct(episode_id=f"{episode.episode_id}/loo{j}", exemplars=others,
                                           queries=[query], task_type=episode.task_type, metadata=None))
    return out


def answer(policy, episode: Episode, cfg: AdaptConfig, max_tokens: int, scorer=None) -> tuple[list[str], float, float]:
    """Greedy answers to the request's queries: (answers, exact-match accuracy, mean configured reward)."""
    rollout = generate_rollouts(policy, [episode], Sampling(greedy=True), cfg.max_new_tokens, max_tokens)[0]
    score_rollouts([rollout], cfg.reward, scorer)
    n = len(rollout.answers)
    return [a.text for a in rollout.answers], sum(rollout.task_rewards) / n, sum(rollout.scores) / n


def best_rollouts(rollouts, groups: int, per_group: int, task_only: bool) -> list:
    """The highest-scoring rollout of each group of `per_group` consecutive rollouts (first one on ties);
    with the exact task reward, groups whose best is wrong are dropped."""
    kept = []
    for g in range(groups):
        group = rollouts[g * per_group:(g + 1) * per_group]
        best = max(group, key=lambda r: r.scores[0])
        if task_only and best.scores[0] <= 0:
            continue
        kept.append(best)
    return kept


def answer_nll(policy, rollouts) -> torch.Tensor:
    """-mean_t log pi(a_t | s_t) over the generated tokens of `rollouts`, in their own contexts."""
    batch = collate([r.ppo_ids() for r in rollouts], [r.action_positions for r in rollouts],
                    [r.behaviour_logp for r in rollouts], [r.token_scores() for r in rollouts],
                    policy.tokenizer.pad_token_id)
    logp, _, _ = policy_outputs(policy, batch, temperature=1.0, with_values=False)
    return -masked_mean(logp, batch.action_mask)


def accumulate_answer_nll(policy, rollouts, minibatch_size: int) -> float:
    """Backward of answer_nll over all `rollouts`, `minibatch_size` rollouts per pass: each minibatch's mean is
    weighted by its share of the answer tokens, so the summed gradient equals one pass over the whole batch.
    Returns the loss value."""
    counts = [len(r.action_positions) for r in rollouts]
    total_tokens = sum(counts)
    value = 0.0
    for start in range(0, len(rollouts), minibatch_size):
        share = sum(counts[start:start + minibatch_size]) / total_tokens
        loss = answer_nll(policy, rollouts[start:start + minibatch_size]) * share
        loss.backward()
        value += loss.item()
    return value


def sample_rollouts(policy, episodes: list[Episode], cfg: AdaptConfig, max_tokens: int,
                    generator: torch.Generator) -> list:
    """Synthetic rollouts, `cfg.rollout_batch` episodes per generation pass (their KV caches live together)."""
    sampling = Sampling(temperature=cfg.temperature)
    rollouts = []
    for start in range(0, len(episodes), cfg.rollout_batch):
        rollouts += generate_rollouts(policy, episodes[start:start + cfg.rollout_batch], sampling,
                                      cfg.max_new_tokens, max_tokens, generator)
    return rollouts


def adapt_and_answer(policy, episode: Episode, cfg: AdaptConfig, max_tokens: int, generator: torch.Generator,
                     scorer=None) -> AdaptResult:
    """Steps 1-5 of the module docstring for one request; the policy's weights are restored afterwards."""
    answers_before, reward_before, score_before = answer(policy, episode, cfg, max_tokens, scorer)
    synthetic = leave_one_out(episode)
    repeated = [ep for ep in synthetic for _ in range(cfg.num_rollouts)]
    rollouts = sample_rollouts(policy, repeated, cfg, max_tokens, generator)
    score_rollouts(rollouts, cfg.reward, scorer)
    kept = best_rollouts(rollouts, len(synthetic), cfg.num_rollouts, task_only=cfg.reward.kind == "task")
    snapshot = {k: v.clone() for k, v in trainable_tensors(policy).items()}
    losses: list[float] = []
    try:
        if kept and cfg.steps:
            params = [p for p in policy.model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
            policy.train()
            for _ in range(cfg.steps):
                losses.append(accumulate_answer_nll(policy, kept, cfg.minibatch_size))
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            policy.eval()
        answers_after, reward_after, score_after = answer(policy, episode, cfg, max_tokens, scorer)
    finally:
        load_trainable_tensors(policy, snapshot)  # discard the temporary copy
        policy.eval()
    synthetic_reward = sum(r.scores[0] for r in rollouts) / len(rollouts) if rollouts else float("nan")
    return AdaptResult(episode.episode_id, reward_before, reward_after, answers_before, answers_after,
                       len(synthetic), synthetic_reward, len(kept), losses, score_before, score_after)

"""Rollouts: the policy answers the queries of a batch of episodes in context, with a KV cache.

An episode is rendered exactly as `icrl_core.episodes._render` renders it (system prompt, exemplars, then each
query opened with the assistant prompt) except that each query's answer is *generated*; the generated answer
stays in the context for the next query (with `feedback_in_context`, followed by the task reward feedback in the
in-context RL harness's words). If the rollout with the preferred answers were forced, its token ids would be
those of `render_episode` (tests check this).

Batched generation with holes (`BatchedCache`): all episodes of a batch share one KV cache of shape (B, L). Each
turn feeds a right-padded block of each row's new tokens; rows that are done generating feed padding.

Exploration (epsilon-mixture). Each generated token is drawn from the behaviour policy

    mu(a | s) = (1 - eps) * pi(a | s) + eps * q(a | s)
    pi = softmax(z / T)                                  the policy at sampling temperature T (ppo.temperature)
    q  = softmax(z / (T * T_explore)) restricted to the top-k tokens of pi and renormalised

i.e. with probability eps the token comes from a flattened version of the policy (exploration_temperature
T_explore > 1 spreads mass over plausible alternatives) that can never pick a token outside the policy's top-k
(exploration_top_k: no gibberish from the tail of a 49k vocabulary). log mu(a_t | s_t) is recorded for every
generated token; the PPO loss uses it as the importance weight pi_old / mu (see icrl_core/ppo.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from icrl_core.chat import Conversation, Tokens
from icrl_core.config import MixedReward, ModelReward, TaskReward
from icrl_core.episodes import Episode, Query, render_episode
from icrl_core.errors import UserError
from icrl_core.prompting import PromptTemplate, template_for

FEEDBACK_ALLOWANCE = 32  # tokens reserved per query for the feedback sentence when feedback_in_context is on


# --------------------------------------------------------------------------------------------------------------
# Sampling


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn. greedy: argmax of the policy (evaluation); otherwise the epsilon-mixture."""

    temperature: float = 1.0
    epsilon: float = 0.0
    exploration_temperature: float = 2.0
    exploration_top_k: int = 20
    greedy: bool = False

    @classmethod
    def from_ppo(cls, cfg) -> Sampling:
        return cls(cfg.temperature, cfg.epsilon_mixture, cfg.exploration_temperature, cfg.exploration_top_k)


def exploration_distribution(logits: torch.Tensor, temperature: float, exploration_temperature: float,
                             top_k: int) -> torch.Tensor:
    """q = softmax(z / (T * T_explore)) over the top-k tokens of z, 0 elsewhere. logits (B, V) -> probs (B, V)."""
    z = logits.float() / (temperature * exploration_temperature)
    k = min(top_k, z.shape[-1])
    top = torch.topk(z, k, dim=-1)
    restricted = torch.full_like(z, float("-inf")).scatter(-1, top.indices, top.values)
    return torch.softmax(restricted, dim=-1)


def mixture_sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per row from mu = (1 - eps) pi + eps q.

    logits (B, V) -> tokens (B,), log mu(token) (B,), explored (B,) (True where the token came from q)."""
    pi = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    none_explored = torch.zeros(pi.shape[0], dtype=torch.bool)
    if sampling.greedy:
        tokens = pi.argmax(-1)
        return tokens, torch.log(pi.gather(-1, tokens[:, None]).squeeze(-1)), none_explored
    eps = sampling.epsilon
    from_pi = torch.multinomial(pi, 1, generator=generator).squeeze(-1)
    if eps <= 0:
        return from_pi, torch.log(pi.gather(-1, from_pi[:, None]).squeeze(-1)), none_explored
    q = exploration_distribution(logits, sampling.temperature, sampling.exploration_temperature,
                                 sampling.exploration_top_k)
    from_q = torch.multinomial(q, 1, generator=generator).squeeze(-1)
    explored = torch.rand(from_pi.shape, generator=generator) < eps
    tokens = torch.where(explored, from_q, from_pi)
    mu = (1 - eps) * pi.gather(-1, tokens[:, None]) + eps * q.gather(-1, tokens[:, None])
    return tokens, torch.log(mu.squeeze(-1)), explored


# --------------------------------------------------------------------------------------------------------------
# One episode's dialogue


def exact_match(answer: str, gold: str) -> float:
    """1.0 when the stripped answer equals the stripped gold answer, else 0.0."""
    return 1.0 if answer.strip() == gold.strip() else 0.0


def task_reward(answer: str, query: Query) -> float:
    """Exact match of the stripped answer against the query's preferred answer: 1.0 or 0.0."""
    return exact_match(answer, query.preferred_answer)


@dataclass
class Answer:
    """One generated answer. token_ids exclude a forced end-of-turn (finished=False means it hit max_new_tokens)."""

    text: str
    token_ids: list[int]
    behaviour_logp: list[float]
    explored: int
    finished: bool
    task_reward: float
    start: int  # index of its first token in the episode's ids


class EpisodeDialogue:
    """The token ids of one episode, built as its queries are answered.

    `pending()` gives the ids not yet fed to the model; `add_answer(...)` closes the assistant turn with the
    generated tokens and opens the next query."""

    def __init__(self, episode: Episode, tokens: Tokens, max_tokens: int, max_new_tokens: int,
                 feedback_in_context: bool = False, template: PromptTemplate | None = None):
        self.episode = episode
        self.tokens = tokens
        self.template = template or template_for(episode.task_type)
        self.queries = list(episode.queries)
        self.feedback_in_context = feedback_in_context
        reserve = len(self.queries) * (max_new_tokens + (FEEDBACK_ALLOWANCE if feedback_in_context else 0))
        if max_tokens - reserve < 16:
            raise UserError(f"episode '{episode.episode_id}': a token budget of {max_tokens} leaves no room for "
                            f"{len(self.queries)} answers of up to {max_new_tokens} tokens")
        # Shave exemplars from the front exactly as rendering for training does, leaving room for the answers.
        shaved = render_episode(episode, tokens, max_tokens - reserve, self.template)
        self.exemplars = list(episode.exemplars[shaved.exemplars_dropped:])
        self.exemplars_dropped = shaved.exemplars_dropped
        self.conv = Conversation(tokens, separator=self.template.separator)
        with_feedback = feedback_in_context or any(ex.reward is not None for ex in self.exemplars)
        self.conv.system(self.template.system(with_feedback))
        for ex in self.exemplars:  # as in episodes._render
            self.conv.user(self.template.query(ex.prompt))
            self.conv.assistant_answer(self.template.answer_prefix, ex.answer)
            if ex.reward is not None:
                self.conv.user(self.template.feedback(ex.answer, ex.reward))
        self.answers: list[Answer] = []
        self.fed = 0
        self._open_query(0)

    def _open_query(self, index: int) -> None:
        if index < len(self.queries):
            self.conv.user(self.template.query(self.queries[index].prompt))
            self.conv.assistant_prompt(self.template.answer_prefix)

    @property
    def done(self) -> bool:
        return len(self.answers) == len(self.queries)

    def pending(self) -> list[int]:
        return self.conv.ids[self.fed:]

    def add_answer(self, token_ids: list[int], behaviour_logp: list[float], explored: int) -> Answer:
        """Append a generated answer (ending with end-of-turn unless it was cut at max_new_tokens)."""
        eot = self.tokens.end_of_turn_id
        finished = bool(token_ids) and token_ids[-1] == eot
        body = token_ids[:-1] if finished else token_ids
        text = self.tokens.decode(body).strip()
        query = self.queries[len(self.answers)]
        answer = Answer(text, list(token_ids), list(behaviour_logp), explored, finished, task_reward(text, query),
                        start=len(self.conv.ids))
        self.conv._emit(token_ids, trained=True)
        if not finished:  # close the turn so the next query sees a well-formed conversation
            self.conv._emit((eot,))
        self.conv._emit(self.tokens.assistant_suffix_rest)
        self.answers.append(answer)
        if self.feedback_in_context and not self.done:
            self.conv.user(self.template.feedback(text, answer.task_reward))
        self._open_query(len(self.answers))
        return answer


@dataclass
class Rollout:
    """A finished episode: its ids, where the generated tokens are, their behaviour log-probs, the answers."""

    episode: Episode
    input_ids: list[int]
    answers: list[Answer]
    exemplars_dropped: int
    scores: list[float] = field(default_factory=list)  # one per query, filled by score_rollouts

    @property
    def action_positions(self) -> list[int]:
        return [a.start + i for a in self.answers for i in range(len(a.token_ids))]

    @property
    def behaviour_logp(self) -> list[float]:
        return [lp for a in self.answers for lp in a.behaviour_logp]

    def token_scores(self) -> list[float]:
        """One value per generated token: a query's score on the last token of its answer, 0 elsewhere."""
        out: list[float] = []
        for answer, score in zip(self.answers, self.scores, strict=True):
            n = len(answer.token_ids)
            out.extend([0.0] * (n - 1) + [score] if n else [])
        return out

    def ppo_ids(self) -> list[int]:
        """The ids the update needs: up to the last generated token."""
        positions = self.action_positions
        return self.input_ids[: positions[-1] + 1] if positions else self.input_ids

    @property
    def task_rewards(self) -> list[float]:
        return [a.task_reward for a in self.answers]


# --------------------------------------------------------------------------------------------------------------
# Batched generation


class BatchedCache:
    """Several token sequences growing in one KV cache of shape (B, L), with holes.

    Each `feed` appends a right-padded block of each row's new tokens (rows with nothing new feed padding).
    Padding is masked out of attention and the rotary positions are the count of real tokens before each
    token, so every row sees exactly its own sequence (fp32 matches an unbatched recompute to ~2e-5 in logits)."""

    def __init__(self, policy, batch: int):
        from transformers import DynamicCache

        self.policy = policy
        self.batch = batch
        self.pad = policy.tokenizer.pad_token_id
        self.cache = DynamicCache()
        self.attention = torch.zeros((batch, 0), dtype=torch.long)
        self.n_real = torch.zeros(batch, dtype=torch.long)  # real tokens per row = the next rotary position

    @torch.no_grad()
    def feed(self, rows_ids: Sequence[Sequence[int]], logits: bool = True) -> torch.Tensor:
        """Feed each row its ids; return, for each row that got ids (in row order), the next-token logits (R, V)
        at its last new token, or its final hidden state (R, H) with `logits=False`, on the CPU.

        With model.share_prefix, a first feed in which rows repeat (G answers to one prompt, G streams of one
        task) runs each distinct row once and repeats its cache rows: the same numbers up to float rounding."""
        if self.policy.share_prefix and self.attention.shape[1] == 0 and all(rows_ids):
            distinct: dict[tuple[int, ...], int] = {}
            inverse = torch.tensor([distinct.setdefault(tuple(ids), len(distinct)) for ids in rows_ids])
            if len(distinct) < self.batch:
                batch, self.batch = self.batch, len(distinct)
                self.attention, self.n_real = self.attention[:self.batch], self.n_real[:self.batch]
                out = self._feed([list(ids) for ids in distinct], logits)
                self.cache.batch_select_indices(inverse.to(self.policy.device))
                self.attention, self.n_real, self.batch = self.attention[inverse], self.n_real[inverse], batch
                return out[inverse]
        return self._feed(rows_ids, logits)

    def _feed(self, rows_ids: Sequence[Sequence[int]], logits: bool) -> torch.Tensor:
        width = max(len(ids) for ids in rows_ids)
        block = torch.full((self.batch, width), self.pad, dtype=torch.long)
        block_mask = torch.zeros((self.batch, width), dtype=torch.long)
        last = torch.zeros((self.batch, width), dtype=torch.bool)
        for row, ids in enumerate(rows_ids):
            if ids:
                block[row, :len(ids)] = torch.tensor(list(ids), dtype=torch.long)
                block_mask[row, :len(ids)] = 1
                last[row, len(ids) - 1] = True
        positions = self.n_real[:, None] + (block_mask.cumsum(1) - 1).clamp(min=0)
        self.attention = torch.cat([self.attention, block_mask], dim=1)
        out, _, hidden = self.policy.forward(block, self.attention, logits_at=last if logits else torch.zeros_like(last),
                                             position_ids=positions, past_key_values=self.cache, use_cache=True)
        self.n_real.add_(block_mask.sum(1))
        # Back on the CPU: sampling uses the seeded CPU generator, so the draws are the same on every device.
        return (out if logits else hidden[last.to(hidden.device)]).cpu()


@torch.no_grad()
def generate_rollouts(policy, episodes: Sequence[Episode], sampling: Sampling, max_new_tokens: int,
                      max_tokens: int, generator: torch.Generator | None = None,
                      feedback_in_context: bool = False) -> list[Rollout]:
    """Answer every query of every episode with the policy, all episodes batched with one KV cache."""
    policy.eval()
    tokens = policy.tokens
    dialogues = [EpisodeDialogue(ep, tokens, max_tokens, max_new_tokens, feedback_in_context) for ep in episodes]
    batch = len(dialogues)
    stop = {tokens.end_of_turn_id, policy.tokenizer.eos_token_id}
    cache = BatchedCache(policy, batch)

    def feed(rows_ids: list[list[int]]) -> torch.Tensor:
        for row, ids in enumerate(rows_ids):
            dialogues[row].fed += len(ids)
        return cache.feed(rows_ids)

    while not all(d.done for d in dialogues):
        active = [not d.done for d in dialogues]
        logits = feed([d.pending() if a else [] for d, a in zip(dialogues, active)])
        rows = [r for r in range(batch) if active[r]]
        generated: dict[int, list[int]] = {r: [] for r in rows}
        logps: dict[int, list[float]] = {r: [] for r in rows}
        explored: dict[int, int] = {r: 0 for r in rows}
        for step in range(max_new_tokens):
            token, logp, from_q = mixture_sample(logits, sampling, generator)
            for i, r in enumerate(rows):
                generated[r].append(int(token[i]))
                logps[r].append(float(logp[i]))
                explored[r] += int(from_q[i])
            rows = [r for r in rows if generated[r][-1] not in stop]
            if not rows or step == max_new_tokens - 1:
                break
            # The sampled token enters the cache; rows that finished feed padding.
            logits = feed([[generated[r][-1]] if r in rows else [] for r in range(batch)])
        for r, tokens in generated.items():
            dialogues[r].add_answer(tokens, logps[r], explored[r])
    return [Rollout(d.episode, list(d.conv.ids), d.answers, d.exemplars_dropped) for d in dialogues]


# --------------------------------------------------------------------------------------------------------------
# Rewards


class SequenceScorer(Protocol):
    """What PPO needs from a reward model (icrl_core.reward_model.RewardModel satisfies it): one scalar per token
    sequence (the context up to and including an answer's end-of-turn token), higher = better."""

    def score(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor | Sequence[float]: ...


def score_rollouts(rollouts: Sequence[Rollout], reward: TaskReward | ModelReward | MixedReward,
                   scorer: SequenceScorer | None = None) -> None:
    """Fill `rollout.scores` (one per query) from `ppo.reward`: exact task reward, reward model score of the
    context up to the end of the answer, or task_weight * task + model_weight * model."""
    needs_model = isinstance(reward, (ModelReward, MixedReward))
    if needs_model and scorer is None:
        raise UserError(f"ppo.reward.kind={reward.kind} needs a reward model: set ppo.reward_model_path")
    model_scores: list[list[float]] = [[] for _ in rollouts]
    if needs_model:
        sequences, owners = [], []
        for index, rollout in enumerate(rollouts):
            for answer in rollout.answers:
                end = answer.start + len(answer.token_ids)
                if not answer.finished:  # score the answer as the conversation shows it: closed by end-of-turn
                    sequences.append(rollout.input_ids[:end + 1])
                else:
                    sequences.append(rollout.input_ids[:end])
                owners.append(index)
        flat = [float(v) for v in scorer.score(sequences)] if sequences else []
        for index, value in zip(owners, flat, strict=True):
            model_scores[index].append(float(value))
    for index, rollout in enumerate(rollouts):
        task = rollout.task_rewards
        if isinstance(reward, TaskReward):
            rollout.scores = list(task)
        elif isinstance(reward, ModelReward):
            rollout.scores = model_scores[index]
        else:
            rollout.scores = [reward.task_weight * t + reward.model_weight * m
                              for t, m in zip(task, model_scores[index], strict=True)]

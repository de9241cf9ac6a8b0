"""Rollouts: rendering identical to training episodes, batched KV-cache generation equal to unbatched, behaviour
log-probs equal to a recomputation, rewards from the task, a (tiny) reward model, or both."""

from __future__ import annotations

import pytest
import torch

from icrl_core.config import LoraAdapter, MixedReward, ModelConfig, ModelReward, TaskReward
from icrl_core.episodes import render_episode
from icrl_core.ppo import collate, policy_outputs, rollout_batch
from icrl_core.prompting import template_for
from icrl_core.rollout import EpisodeDialogue, Sampling, generate_rollouts, score_rollouts
from tests.ppo_helpers import keyword_episodes


@pytest.fixture(scope="module")
def policy():
    from icrl_core.model import load_policy

    return load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4), value_head=True)


@pytest.mark.parametrize("n_queries", [1, 3])
def test_dialogue_with_the_preferred_answers_is_the_training_rendering(tokens, n_queries):
    episode = keyword_episodes(1, k=4, n=n_queries, seed=3)[0]
    rendered = render_episode(episode, tokens, 2048)
    dialogue = EpisodeDialogue(episode, tokens, 2048, max_new_tokens=8)
    template = template_for(episode.task_type)
    for query, span in zip(episode.queries, rendered.queries, strict=True):
        answer_ids = list(dialogue.conv.answer_ids(template.answer_prefix, query.preferred_answer))
        assert dialogue.conv.ids == rendered.input_ids[:span.start]  # the prompt the policy sees
        answer = dialogue.add_answer(answer_ids, [0.0] * len(answer_ids), explored=0)
        assert answer.finished and answer.task_reward == 1.0 and answer.start == span.start
    assert dialogue.done and dialogue.conv.ids == rendered.input_ids


def test_shaving_leaves_room_for_the_answers(tokens):
    episode = keyword_episodes(1, k=12, n=1, seed=4)[0]
    full = len(render_episode(episode, tokens, 4096).input_ids)
    dialogue = EpisodeDialogue(episode, tokens, full, max_new_tokens=16)
    assert dialogue.exemplars_dropped > 0  # 16 answer tokens reserved instead of the 4-token gold answer
    assert len(dialogue.conv.ids) + 16 + 1 <= full


def test_batched_generation_equals_one_episode_at_a_time(policy):
    episodes = keyword_episodes(3, k=3, n=2, seed=5) + keyword_episodes(1, k=6, n=1, seed=6)
    batched = generate_rollouts(policy, episodes, Sampling(greedy=True), 5, 2048)
    for episode, together in zip(episodes, batched, strict=True):
        alone = generate_rollouts(policy, [episode], Sampling(greedy=True), 5, 2048)[0]
        assert together.input_ids == alone.input_ids
        assert together.action_positions == alone.action_positions
        assert torch.allclose(torch.tensor(together.behaviour_logp), torch.tensor(alone.behaviour_logp), atol=1e-4)


@pytest.mark.parametrize("epsilon", [0.0, 0.5])
def test_behaviour_logprobs_match_a_full_recomputation(policy, epsilon):
    """The KV-cache rollout (with holes from padding) records log mu; recomputing log pi on the finished
    sequences in one pass must agree: equal when eps = 0, mu >= (1 - eps) pi otherwise."""
    episodes = keyword_episodes(4, k=3, n=2, seed=7)
    sampling = Sampling(temperature=0.8, epsilon=epsilon, exploration_temperature=2.0, exploration_top_k=5)
    rollouts = generate_rollouts(policy, episodes, sampling, 4, 2048, torch.Generator().manual_seed(0))
    batch = collate([r.ppo_ids() for r in rollouts], [r.action_positions for r in rollouts],
                    [r.behaviour_logp for r in rollouts], [[0.0] * len(r.behaviour_logp) for r in rollouts],
                    policy.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _, _ = policy_outputs(policy, batch, 0.8, with_values=False)
    mask = batch.action_mask
    if epsilon == 0:
        assert torch.allclose(logp[mask], batch.behaviour_logp[mask], atol=1e-4)
    else:
        explored = sum(a.explored for r in rollouts for a in r.answers)
        assert explored > 0
        lower = torch.log(torch.tensor(1 - epsilon)) + logp[mask]
        assert bool((batch.behaviour_logp[mask] >= lower - 1e-4).all())


def test_answers_stay_in_context_with_feedback(policy):
    episode = keyword_episodes(1, k=2, n=2, seed=8)[0]
    rollout = generate_rollouts(policy, [episode], Sampling(greedy=True), 3, 2048, feedback_in_context=True)[0]
    first, second = rollout.answers
    assert rollout.input_ids[first.start:first.start + len(first.token_ids)] == first.token_ids
    assert second.start > first.start + len(first.token_ids)
    text = policy.tokens.decode(rollout.input_ids)
    assert "You must answer correctly, using previous feedback" in text  # the ICRL system prompt
    assert f"The answer '{first.text}' is wrong!" in text or f"'{first.text}' is the correct answer!" in text
    assert text.index(episode.queries[1].prompt) > text.index("is wrong" if first.task_reward == 0 else "correct")


def test_an_answer_cut_at_max_new_tokens_is_closed_but_not_an_action(policy):
    episode = keyword_episodes(1, k=2, n=2, seed=9)[0]
    rollout = generate_rollouts(policy, [episode], Sampling(greedy=True), 1, 2048)[0]
    eot = policy.tokens.end_of_turn_id
    for answer in rollout.answers:
        if not answer.finished:
            end = answer.start + len(answer.token_ids)
            assert rollout.input_ids[end] == eot and end not in rollout.action_positions
    assert len(rollout.action_positions) == sum(len(a.token_ids) for a in rollout.answers)


def test_same_seed_same_rollouts(policy):
    episodes = keyword_episodes(3, k=3, n=1, seed=10)
    sampling = Sampling(temperature=1.0, epsilon=0.3)
    a = generate_rollouts(policy, episodes, sampling, 4, 2048, torch.Generator().manual_seed(3))
    b = generate_rollouts(policy, episodes, sampling, 4, 2048, torch.Generator().manual_seed(3))
    assert [r.input_ids for r in a] == [r.input_ids for r in b]
    assert [r.behaviour_logp for r in a] == [r.behaviour_logp for r in b]


def test_rewards_from_task_reward_model_and_both(policy, tmp_path):
    from icrl_core.reward_model import load_reward_model, new_reward_model, save_reward_model

    saved = save_reward_model(tmp_path / "rm", new_reward_model(ModelConfig(spec="tiny"), None, seed=1))
    scorer = load_reward_model(saved, ModelConfig(spec="tiny"))
    episodes = keyword_episodes(2, k=2, n=2, seed=11)
    rollouts = generate_rollouts(policy, episodes, Sampling(greedy=True), 3, 2048)
    score_rollouts(rollouts, TaskReward())
    assert [r.scores for r in rollouts] == [r.task_rewards for r in rollouts]
    score_rollouts(rollouts, ModelReward(), scorer)
    model_scores = [list(r.scores) for r in rollouts]
    for rollout, scores in zip(rollouts, model_scores, strict=True):
        for answer, score in zip(rollout.answers, scores, strict=True):
            end = answer.start + len(answer.token_ids) + (0 if answer.finished else 1)
            expected = scorer.score([rollout.input_ids[:end]])[0].item()
            assert score == pytest.approx(expected, abs=1e-5)
    score_rollouts(rollouts, MixedReward(task_weight=2.0, model_weight=0.5), scorer)
    for rollout, scores in zip(rollouts, model_scores, strict=True):
        expected = [2.0 * t + 0.5 * m for t, m in zip(rollout.task_rewards, scores, strict=True)]
        assert rollout.scores == pytest.approx(expected, abs=1e-5)
    with pytest.raises(Exception, match="reward_model_path"):
        score_rollouts(rollouts, ModelReward(), None)
    # the score sits on the last token of each answer
    tokens = rollouts[0].token_scores()
    assert len(tokens) == len(rollouts[0].action_positions) and sum(tokens) == pytest.approx(sum(rollouts[0].scores))


def test_shared_prefix_rollouts_equal_unshared(policy):
    """model.share_prefix: G rollouts of one episode prefill their prompt once (and the PPO pass runs it once);
    the same seeded samples, behaviour log-probs and recomputed log-probs as without."""
    episodes = [ep for ep in keyword_episodes(2, k=3, n=2, seed=8) for _ in range(3)]

    def run(share: bool):
        policy.share_prefix = share
        try:
            rollouts = generate_rollouts(policy, episodes, Sampling(temperature=1.0), 5, 2048,
                                         torch.Generator().manual_seed(11))
            with torch.no_grad():
                for rollout in rollouts:
                    rollout.scores = [0.0] * len(rollout.answers)
                logp, _, values = policy_outputs(policy, rollout_batch(rollouts, policy.tokenizer.pad_token_id),
                                                 1.0, with_values=True)
        finally:
            policy.share_prefix = False
        return rollouts, logp, values

    (plain, plain_logp, plain_values), (shared, shared_logp, shared_values) = run(False), run(True)
    assert len({tuple(r.input_ids) for r in plain}) > 2  # the repeats sampled different answers
    for a, b in zip(plain, shared, strict=True):
        assert a.input_ids == b.input_ids and a.action_positions == b.action_positions
        assert torch.allclose(torch.tensor(a.behaviour_logp), torch.tensor(b.behaviour_logp), atol=1e-5)
    assert torch.allclose(plain_logp, shared_logp, atol=1e-5) and torch.allclose(plain_values, shared_values, atol=1e-5)

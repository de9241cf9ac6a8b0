"""Test-time adaptation: leave-one-out synthetic episodes, LoRA steps on the best rollouts, minibatched steps,
the base adapter restored in memory (tiny model). The `adapt` stage and `icrl adapt`:
tests/integration/test_adapt.py."""

from __future__ import annotations

import pytest
import torch

from icrl_core.adapt import adapt_and_answer, best_rollouts, leave_one_out
from icrl_core.config import AdaptConfig, LoraAdapter, ModelConfig, ModelReward
from icrl_core.episodes import Episode, Exemplar, Query
from icrl_core.ppo import trainable_tensors


def _episode(rewards=(None, None, None)) -> Episode:
    return Episode(episode_id="r1", task_type="keyword_map",
                   exemplars=[Exemplar(prompt=f"I saw a tiger {i}.", answer=f"l{i}", reward=r)
                              for i, r in enumerate(rewards)],
                   queries=[Query(prompt="I saw a tiger.", preferred_answer="l0", rejected_answer="l1")])


def test_leave_one_out_holds_out_each_known_answer():
    synthetic = leave_one_out(_episode())
    assert len(synthetic) == 3
    for j, ep in enumerate(synthetic):
        assert ep.queries[0].prompt == f"I saw a tiger {j}." and ep.queries[0].preferred_answer == f"l{j}"
        assert [e.answer for e in ep.exemplars] == [f"l{i}" for i in range(3) if i != j]
    # a past attempt marked wrong has no known right answer: context only
    assert [ep.queries[0].preferred_answer for ep in leave_one_out(_episode((1.0, 0.0, None)))] == ["l0", "l2"]
    single = _episode((None,))
    assert leave_one_out(single) == []


class _Scored:
    def __init__(self, score):
        self.scores = [score]


def test_best_rollout_per_group_drops_wrong_bests_with_the_task_reward():
    rollouts = [_Scored(s) for s in (0.0, 1.0, 1.0, 0.0, 0.0, 0.0)]
    kept = best_rollouts(rollouts, groups=2, per_group=3, task_only=True)
    assert kept == [rollouts[1]]
    kept = best_rollouts([_Scored(s) for s in (-2.0, -1.0, 0.5, -3.0)], groups=2, per_group=2, task_only=False)
    assert [k.scores[0] for k in kept] == [-1.0, 0.5]


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    from icrl_core.reward_model import load_reward_model, new_reward_model, save_reward_model

    folder = save_reward_model(tmp_path_factory.mktemp("rm") / "rm",
                               new_reward_model(ModelConfig(spec="tiny"), None, seed=2))
    return folder, load_reward_model(folder, ModelConfig(spec="tiny"))


def test_adaptation_trains_a_temporary_copy_and_restores_the_adapter(scorer):
    from icrl_core.model import load_policy
    from tests.ppo_helpers import keyword_episodes

    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4))
    with torch.no_grad():  # a non-trivial base adapter
        for p in policy.model.parameters():
            if p.requires_grad:
                p.add_(0.01)
    before = {k: v.clone() for k, v in trainable_tensors(policy).items()}
    episode = keyword_episodes(1, k=3, n=2, seed=4)[0]
    # the reward model always has a best rollout to keep, so the LoRA steps really run
    cfg = AdaptConfig(num_rollouts=2, steps=3, learning_rate=1e-2, max_new_tokens=3, reward=ModelReward())
    result = adapt_and_answer(policy, episode, cfg, 2048, torch.Generator().manual_seed(0), scorer[1])
    assert result.held_out == 3 and result.trained_on == 3 and len(result.losses) == 3
    assert result.losses[-1] < result.losses[0]  # the steps fit the kept rollouts
    assert len(result.answers_before) == len(result.answers_after) == 2
    after = trainable_tensors(policy)
    assert all(torch.equal(before[k], after[k]) for k in before)
    again = adapt_and_answer(policy, episode, cfg, 2048, torch.Generator().manual_seed(0), scorer[1])
    assert again.as_dict() == result.as_dict()  # deterministic given the seed, and from the same weights


def test_minibatched_steps_give_the_one_batch_gradient_and_rollouts_come_in_chunks():
    """The adapt stage bounds memory (rollout_batch, minibatch_size) without changing what a step computes."""
    from icrl_core.adapt import accumulate_answer_nll, answer_nll, sample_rollouts
    from icrl_core.model import load_policy
    from icrl_core.rollout import score_rollouts
    from tests.ppo_helpers import keyword_episodes

    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4))
    episodes = keyword_episodes(5, k=3, n=1, seed=7)
    cfg = AdaptConfig(rollout_batch=2, max_new_tokens=3, temperature=1.0)
    rollouts = sample_rollouts(policy, episodes, cfg, 2048, torch.Generator().manual_seed(0))
    assert len(rollouts) == 5  # three generation passes: 2 + 2 + 1 episodes
    assert [r.episode.episode_id for r in rollouts] == [e.episode_id for e in episodes]
    score_rollouts(rollouts, cfg.reward)
    params = [p for p in policy.model.parameters() if p.requires_grad]

    def gradient(fn):
        for p in params:
            p.grad = None
        value = fn()
        return value, [p.grad.clone() for p in params]

    policy.train()
    def whole_loss():
        loss = answer_nll(policy, rollouts)
        loss.backward()
        return loss.item()

    whole, whole_grad = gradient(whole_loss)
    accumulated, accumulated_grad = gradient(lambda: accumulate_answer_nll(policy, rollouts, minibatch_size=2))
    policy.eval()
    assert accumulated == pytest.approx(whole, rel=1e-5)
    for a, b in zip(whole_grad, accumulated_grad):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

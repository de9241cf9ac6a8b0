"""Objectives (icrl_core/objectives.py) against values computed by hand (the arithmetic is written out next to
each expectation)."""

from __future__ import annotations

import math

import pytest
import torch

from icrl_core.objectives import (
    aipo_loss,
    discounted_returns,
    dpo_loss,
    dr_grpo_loss,
    grpo_advantages,
    grpo_loss,
    gspo_loss,
    ipo_loss,
    k3_kl,
    opo_advantages,
    per_group,
    policy_gradient_loss,
    rloo_advantages,
    sequence_mean,
    step_to_tokens,
    token_sum,
)

T = torch.tensor


def test_discounted_returns_count_later_rewards_of_the_stream():
    rewards = T([[1.0, 0.0, 1.0], [0.0, 1.0, 7.0]])
    mask = T([[1, 1, 1], [1, 1, 0]]).bool()
    # row 0, gamma 0.5: R2 = 1; R1 = 0 + 0.5*1 = 0.5; R0 = 1 + 0.5*0.5 = 1.25
    # row 1: the third step is padding -> R1 = 1, R0 = 0 + 0.5*1 = 0.5
    assert torch.allclose(discounted_returns(rewards, mask, 0.5), T([[1.25, 0.5, 1.0], [0.5, 1.0, 0.0]]))
    # gamma 0: each step its own reward
    assert torch.allclose(discounted_returns(rewards, mask, 0.0), T([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))


def test_grpo_advantages_normalise_each_step_over_the_group():
    returns = T([[1.0, 2.0], [0.0, 2.0], [2.0, 2.0]])  # G=3 streams, T=2 steps
    mask = torch.ones(3, 2, dtype=torch.bool)
    # step 0: mean 1, unbiased std sqrt(((0)^2 + 1 + 1) / 2) = 1 -> (0, -1, 1) / (1 + 1e-4)
    # step 1: all equal -> 0 (std 0: 0 / 1e-4 = 0)
    expected = T([[0.0, 0.0], [-1.0, 0.0], [1.0, 0.0]]) / T([1.0 + 1e-4, 1.0])
    assert torch.allclose(grpo_advantages(returns, mask), expected)
    # Dr.GRPO: centred only
    assert torch.allclose(grpo_advantages(returns, mask, scale=False), T([[0.0, 0.0], [-1.0, 0.0], [1.0, 0.0]]))


def test_grpo_advantages_ignore_invalid_streams():
    returns = T([[1.0], [3.0], [100.0]])
    mask = T([[1], [1], [0]]).bool()
    # mean of (1, 3) = 2, std = sqrt((1 + 1) / 1) = sqrt(2)
    s = math.sqrt(2) + 1e-4
    assert torch.allclose(grpo_advantages(returns, mask), T([[-1 / s], [1 / s], [0.0]]))


def test_rloo_leaves_one_out():
    returns = T([[1.0], [0.0], [0.0], [1.0]])
    mask = torch.ones(4, 1, dtype=torch.bool)
    # stream 0: 1 - (0 + 0 + 1)/3 = 2/3; stream 1: 0 - (1 + 0 + 1)/3 = -2/3
    assert torch.allclose(rloo_advantages(returns, mask), T([[2 / 3], [-2 / 3], [-2 / 3], [2 / 3]]))
    # a step with one valid stream has no baseline: advantage 0
    assert torch.allclose(rloo_advantages(T([[5.0], [1.0]]), T([[1], [0]]).bool()), T([[0.0], [0.0]]))


def test_opo_baseline_is_length_weighted():
    returns = T([[1.0], [0.0]])
    lengths = T([[3.0], [1.0]])
    mask = torch.ones(2, 1, dtype=torch.bool)
    # b = (3*1 + 1*0) / (3 + 1) = 0.75 -> A = (0.25, -0.75)
    assert torch.allclose(opo_advantages(returns, lengths, mask), T([[0.25], [-0.75]]))


def test_per_group_applies_the_estimator_to_each_group_alone():
    returns = T([[1.0], [0.0], [5.0], [3.0]])
    mask = torch.ones(4, 1, dtype=torch.bool)
    groups = T([0, 0, 1, 1])
    # group 0: 1 - 0 = 1, 0 - 1 = -1; group 1: 5 - 3 = 2, 3 - 5 = -2
    out = per_group(rloo_advantages, returns, mask, groups)
    assert torch.allclose(out, T([[1.0], [-1.0], [2.0], [-2.0]]))
    lengths = T([[1.0], [1.0], [1.0], [3.0]])
    # group 1: b = (5 + 9) / 4 = 3.5 -> (1.5, -0.5)
    out = per_group(opo_advantages, returns, mask, groups, lengths)
    assert torch.allclose(out, T([[0.5], [-0.5], [1.5], [-0.5]]))


def test_step_to_tokens_broadcasts_a_steps_advantage_to_its_actions():
    steps = T([[0.5, -1.0], [2.0, 3.0]])
    token_step = T([[0, 0, 1], [1, 0, 0]])
    token_mask = T([[1, 1, 1], [1, 0, 0]]).bool()
    assert torch.allclose(step_to_tokens(steps, token_step, token_mask), T([[0.5, 0.5, -1.0], [3.0, 0.0, 0.0]]))


def test_aggregations():
    x = T([[1.0, 3.0, 100.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]]).bool()
    # rows: (1 + 3)/2 = 2, 4/1 = 4, row 2 has no entries -> (2 + 4) / 2 = 3
    assert sequence_mean(x, mask).item() == pytest.approx(3.0)
    # token sum: (1 + 3 + 4) / 10
    assert token_sum(x, mask, 10.0).item() == pytest.approx(0.8)


def test_grpo_loss_by_hand():
    logp = T([[math.log(0.6), math.log(0.5)], [math.log(0.2), 0.0]])
    old = T([[math.log(0.4), math.log(0.5)], [math.log(0.4), 0.0]])
    adv = T([[1.0, 1.0], [-2.0, 0.0]])
    mask = T([[1, 1], [1, 0]]).bool()
    # row 0: rho = 1.5 -> clip 1.2 -> -min(1.5, 1.2) = -1.2; rho = 1 -> -1; mean -1.1
    # row 1: rho = 0.5, A = -2: -min(-1.0, 0.8 * -2 = -1.6) = 1.6
    # GRPO: (-1.1 + 1.6) / 2 = 0.25
    assert grpo_loss(logp, old, adv, mask, 0.2, 0.2).item() == pytest.approx(0.25, abs=1e-6)
    # clip-higher 0.6: row 0 token 0 -> -1.5; row 0 mean -1.25 -> (-1.25 + 1.6) / 2 = 0.175
    assert grpo_loss(logp, old, adv, mask, 0.2, 0.6).item() == pytest.approx(0.175, abs=1e-6)
    # Dr.GRPO: (-1.2 - 1 + 1.6) / normalizer 4 = -0.15
    assert dr_grpo_loss(logp, old, adv, mask, 0.2, 4.0).item() == pytest.approx(-0.15, abs=1e-6)


def test_gspo_uses_the_sequence_ratio():
    logp = T([[math.log(0.9), math.log(0.4)]], requires_grad=True)
    old = T([[math.log(0.3), math.log(0.4)]])
    adv = T([[1.0, 1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    # log s = (log 3 + 0) / 2 -> s = sqrt(3) = 1.732 -> clipped to 1 + 0.5 = 1.5 for positive A
    loss = gspo_loss(logp, old, adv, mask, 0.5, 0.5)
    assert loss.item() == pytest.approx(-1.5, abs=1e-6)
    # within the clip range: clip 1.0 -> loss = -sqrt(3); d/dlogp_t of -(1/2) sum_t w_t = -sqrt(3)/2 each
    logp.grad = None
    loss = gspo_loss(logp, old, adv, mask, 0.9, 1.0)
    assert loss.item() == pytest.approx(-math.sqrt(3), abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.full((1, 2), -math.sqrt(3) / 2))


def test_aipo_caps_the_ratio_to_the_behaviour_policy():
    logp = T([[math.log(0.5), math.log(0.5), math.log(0.5)]], requires_grad=True)
    mu = T([[math.log(0.25), math.log(0.05), math.log(0.5)]])
    adv = T([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    # ratios 2, 10 -> capped at 4, 1: -(2*1 + 4*1 + 1*(-1)) / 3 = -5/3
    loss = aipo_loss(logp, mu, adv, mask, delta=4.0)
    assert loss.item() == pytest.approx(-5 / 3, abs=1e-6)
    loss.backward()
    # gradient: -(rho * A) / 3 where not capped (2/3 and -(-1)/3 = 1/3 ... signs), 0 where capped
    assert torch.allclose(logp.grad, T([[-2 / 3, 0.0, 1 / 3]]), atol=1e-6)


def test_policy_gradient_loss_on_policy_gradient_is_advantage():
    logp = T([[math.log(0.3), math.log(0.7)]], requires_grad=True)
    adv = T([[2.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss = policy_gradient_loss(logp, logp.detach(), adv, mask)
    assert loss.item() == pytest.approx(-(2.0 - 1.0) / 2)
    loss.backward()
    assert torch.allclose(logp.grad, T([[-1.0, 0.5]]))


def test_k3_kl_by_hand():
    # ref - logp = log(0.5/0.25) = log 2 -> 2 - log 2 - 1; equal -> 0
    out = k3_kl(T([math.log(0.25), -1.0]), T([math.log(0.5), -1.0]))
    assert torch.allclose(out, T([1.0 - math.log(2.0), 0.0]))


def test_dpo_and_ipo_by_hand():
    pc, pr = T([-1.0, -2.0]), T([-3.0, -1.0])
    rc, rr = T([-1.5, -2.0]), T([-2.0, -2.0])
    # h = (pc - rc) - (pr - rr): pair 0 = 0.5 - (-1.0) = 1.5; pair 1 = 0 - 1 = -1
    beta = 0.1
    expected_dpo = (math.log1p(math.exp(-0.15)) + math.log1p(math.exp(0.1))) / 2
    assert dpo_loss(pc, pr, rc, rr, beta).item() == pytest.approx(expected_dpo, abs=1e-6)
    # IPO target 1 / (2 * 0.1) = 5: ((1.5 - 5)^2 + (-1 - 5)^2) / 2 = (12.25 + 36) / 2
    assert ipo_loss(pc, pr, rc, rr, beta).item() == pytest.approx(24.125, abs=1e-5)


def test_couple_contrast_by_hand():
    from icrl_core.objectives import couple_contrast_loss

    # couple 0: margins 2.0 (real) and -2.0 (renamed): a feedback-blind preference, m = 0 -> log 2
    # couple 1: margins 1.0 and 3.0 -> m = 4, beta 0.5 -> log(1 + e^-2)
    real, renamed = T([2.0, 1.0]), T([-2.0, 3.0])
    expected = (math.log(2.0) + math.log1p(math.exp(-2.0))) / 2
    assert couple_contrast_loss(real, renamed, 0.5).item() == pytest.approx(expected, abs=1e-6)
    # a shared shift of the preference (both margins' labels swapped: +c in one world is -c in the other)
    shift = torch.zeros(2, requires_grad=True)
    couple_contrast_loss(real + shift, renamed - shift, 0.5).backward()
    assert torch.equal(shift.grad, torch.zeros(2))


def test_pairwise_rank_loss_by_hand():
    from icrl_core.objectives import pairwise_rank_loss

    # margins log pi(w) - log pi(l): 2.0 - 1.0 = 1 and -3.0 - (-1.0) = -2; beta 0.5 -> log(1 + e^-0.5), log(1 + e^1)
    chosen, rejected = T([2.0, -3.0]), T([1.0, -1.0])
    expected = (math.log1p(math.exp(-0.5)) + math.log1p(math.exp(1.0))) / 2
    assert pairwise_rank_loss(chosen, rejected, 0.5).item() == pytest.approx(expected, abs=1e-6)
    # the pair ranked wrong carries the larger gradient: sigmoid(-beta margin) * beta / P
    chosen.requires_grad_(True)
    pairwise_rank_loss(chosen, rejected, 0.5).backward()
    assert chosen.grad.tolist() == pytest.approx([-0.5 * torch.sigmoid(T(-0.5)).item() / 2,
                                                 -0.5 * torch.sigmoid(T(1.0)).item() / 2], abs=1e-6)


def test_terminal_rewards_pay_the_value_at_each_streams_last_step():
    from icrl_core.objectives import discounted_returns, terminal_rewards

    rewards = T([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = T([[True, True, True], [True, True, False]])  # the second stream has 2 steps
    out = terminal_rewards(rewards, mask, T([0.5, 0.25]), weight=2.0)
    assert torch.equal(out, T([[1.0, 0.0, 2.0], [0.0, 1.5, 0.0]]))
    # the return credits every earlier step with the discounted value: 0.5 * 1.5 at the second stream's first
    assert torch.allclose(discounted_returns(out, mask, 0.5)[1], T([0.75, 1.5, 0.0]))
    assert torch.equal(terminal_rewards(rewards, mask, T([0.5, 0.25]), weight=0.0), rewards * mask)


def test_distillation_rewards_by_hand():
    from icrl_core.objectives import distillation_rewards

    rewards, teacher, student = T([[1.0, 0.0, 0.0]]), T([[-0.5, -2.0, -1.0]]), T([[-1.0, -0.25, -3.0]])
    mask = T([[True, True, False]])
    # 0.5 * r + 2 * teacher - 0.1 * student; the masked step is 0
    out = distillation_rewards(rewards, teacher, student, mask, adv_tau=0.5, teacher_tau=2.0, student_tau=0.1)
    assert torch.allclose(out, T([[0.5 - 1.0 + 0.1, 0.0 - 4.0 + 0.025, 0.0]]))
    # the default weights leave the task reward as it is
    assert torch.equal(distillation_rewards(rewards, teacher, student, mask, 1.0, 0.0, 0.0), T([[1.0, 0.0, 0.0]]))


def test_discovery_rewards_add_the_bonus_where_a_step_was_a_discovery():
    from icrl_core.objectives import discovery_rewards

    rewards = T([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    novel = T([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    mask = T([[1, 1, 1], [1, 1, 0]]).bool()
    # r + 0.5 n: [1.5, 0, 1] and [1, 1.5, (masked) 0]
    assert torch.equal(discovery_rewards(rewards, novel, mask, 0.5), T([[1.5, 0.0, 1.0], [1.0, 1.5, 0.0]]))
    assert torch.equal(discovery_rewards(rewards, novel, mask, 0.0), rewards * mask)

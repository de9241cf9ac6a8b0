"""PPO pieces against values computed by hand (the arithmetic is written out next to each expectation)."""

from __future__ import annotations

import math

import pytest
import torch

from icrl_core.config import AdaptiveKL, FixedKL, PPOConfig
from icrl_core.ppo import (
    adaptive_kl_coefficient,
    approx_kl,
    behaviour_weights,
    clip_fraction,
    clipped_policy_loss,
    clipped_value_loss,
    collate,
    entropy_from_logits,
    explained_variance,
    gae_advantages,
    masked_mean,
    next_kl_coefficient,
    per_token_kl,
    policy_outputs,
    ppo_iteration,
    shape_rewards,
    token_logprobs,
    whiten,
)
from icrl_core.rollout import Sampling, exploration_distribution, mixture_sample

T = torch.tensor


def test_per_token_kl_is_k1():
    assert torch.allclose(per_token_kl(T([-1.0, -2.0]), T([-1.5, -1.0])), T([0.5, -1.0]))


def test_shape_rewards_puts_score_on_last_token_and_kl_everywhere():
    scores = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    kl = T([[0.1, 0.2, 0.3], [0.5, -0.5, 9.0]])
    mask = T([[1, 1, 1], [1, 1, 0]]).bool()
    # row 0: 0 - 0.1*0.1, 0 - 0.1*0.2, 1 - 0.1*0.3; row 1: -0.05, 2 + 0.05, padding -> 0
    expected = T([[-0.01, -0.02, 0.97], [-0.05, 2.05, 0.0]])
    assert torch.allclose(shape_rewards(scores, kl, mask, beta=0.1), expected)


def test_gae_by_hand():
    rewards = T([[1.0, 0.0, 2.0], [0.0, 1.0, 5.0]])
    values = T([[0.5, 1.0, 1.5], [0.2, 0.4, 7.0]])
    mask = T([[1, 1, 1], [1, 1, 0]]).bool()
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d2 = 2 - 1.5 = 0.5 -> A2 = 0.5
    #        d1 = 0 + 0.9*1.5 - 1.0 = 0.35 -> A1 = 0.35 + 0.72*0.5 = 0.71
    #        d0 = 1 + 0.9*1.0 - 0.5 = 1.4 -> A0 = 1.4 + 0.72*0.71 = 1.9112
    # row 1 (last entry is padding): d1 = 1 - 0.4 = 0.6 -> A1 = 0.6; d0 = 0 + 0.9*0.4 - 0.2 = 0.16 -> A0 = 0.592
    assert torch.allclose(adv, T([[1.9112, 0.71, 0.5], [0.592, 0.6, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, T([[2.4112, 1.71, 2.0], [0.792, 1.0, 0.0]]), atol=1e-6)


def test_gae_with_gamma_and_lambda_one_is_monte_carlo_return_minus_value():
    rewards = T([[0.1, -0.2, 1.0]])
    values = T([[0.3, 0.1, -0.4]])
    adv, ret = gae_advantages(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=1.0)
    mc = T([[0.9, 0.8, 1.0]])  # suffix sums of the rewards
    assert torch.allclose(ret, mc) and torch.allclose(adv, mc - values)


def test_whiten_ignores_padding():
    x = T([[1.0, 2.0], [3.0, 100.0]])
    mask = T([[1, 1], [1, 0]]).bool()
    # mean 2, unbiased variance ((1 + 0 + 1) / 2) = 1
    out = whiten(x, mask)
    assert torch.allclose(out, T([[-1.0, 0.0], [1.0, 0.0]]), atol=1e-6)
    assert torch.allclose(whiten(x, mask, shift_mean=False), T([[1.0, 2.0], [3.0, 0.0]]), atol=1e-6)
    assert masked_mean(x, mask).item() == pytest.approx(2.0)


def _policy_case():
    ratio = T([1.5, 0.5, 1.1, 0.7])
    logp = torch.log(ratio).requires_grad_(True)
    old = torch.zeros(4)
    adv = T([1.0, 1.0, -1.0, -2.0])
    return logp, old, adv, torch.ones(4, dtype=torch.bool)


def test_clipped_policy_loss_by_hand():
    logp, old, adv, mask = _policy_case()
    # min(rA, clip(r)A): 1.5 -> min(1.5, 1.2) = 1.2; 0.5 -> min(0.5, 0.8) = 0.5;
    # 1.1 -> -1.1 (inside the range); 0.7 -> min(-1.4, -1.6) = -1.6. mean = -1.0 / 4 -> loss 0.25
    loss = clipped_policy_loss(logp, old, adv, mask, clip_range=0.2)
    assert loss.item() == pytest.approx(0.25)
    loss.backward()
    # d loss / d logp = -(1/4) * r * A where the unclipped term is the min, 0 where the clipped one is
    assert torch.allclose(logp.grad, T([0.0, -0.125, 0.275, 0.0]))


def test_clipped_policy_loss_with_behaviour_weights():
    logp, old, adv, mask = _policy_case()
    weights = T([1.0, 0.5, 1.0, 0.5])
    # (1.2 + 0.5*0.5 - 1.1 + 0.5*(-1.6)) / 4 = -0.45 / 4
    loss = clipped_policy_loss(logp, old, adv, mask, 0.2, weights)
    assert loss.item() == pytest.approx(0.1125)


def test_clipped_value_loss_by_hand():
    values, old, returns = T([1.0, 0.0]), T([0.5, 0.5]), T([2.0, 1.0])
    # t0: (1-2)^2 = 1 vs clipped 0.7: (0.7-2)^2 = 1.69 -> 1.69; t1: (0-1)^2 = 1 vs clipped 0.3: 0.49 -> 1
    loss = clipped_value_loss(values, old, returns, torch.ones(2, dtype=torch.bool), clip_range=0.2)
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)


def test_entropy_and_token_logprobs_by_hand():
    logits = T([[0.0, 0.0], [0.0, math.log(3.0)]])
    # uniform over 2: ln 2; p = (1/4, 3/4): -(0.25 ln 0.25 + 0.75 ln 0.75)
    expected = T([math.log(2.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])
    assert torch.allclose(entropy_from_logits(logits), expected, atol=1e-6)
    # temperature 2 halves the logits: (0, ln 3 / 2) -> p(token 1) = sqrt(3) / (1 + sqrt(3))
    logp = token_logprobs(logits[1:], T([1]).long(), temperature=2.0)
    assert logp.item() == pytest.approx(math.log(math.sqrt(3) / (1 + math.sqrt(3))), abs=1e-6)


def test_diagnostics_by_hand():
    logp, old, _, mask = _policy_case()
    # ratios 1.5, 0.5, 1.1, 0.7: |r - 1| > 0.2 for 1.5, 0.5 and 0.7
    assert clip_fraction(logp, old, mask, 0.2).item() == pytest.approx(0.75)
    two = T([math.log(2.0), 0.0])
    # (2 - 1 - ln 2 + 0) / 2
    assert approx_kl(two, torch.zeros(2), torch.ones(2, dtype=torch.bool)).item() == pytest.approx(
        (1 - math.log(2.0)) / 2)
    returns, all_ = T([1.0, 2.0, 3.0]), torch.ones(3, dtype=torch.bool)
    assert explained_variance(returns.clone(), returns, all_).item() == pytest.approx(1.0)
    # R - V = (-1, 0, 1): variance 1 = Var(R) -> 0
    assert explained_variance(T([2.0, 2.0, 2.0]), returns, all_).item() == pytest.approx(0.0)
    assert math.isnan(explained_variance(T([1.0, 2.0]), T([1.0, 1.0]), all_[:2]).item())


def test_kl_controllers():
    # e = clip(0.15 / 0.1 - 1, -0.2, 0.2) = 0.2 -> 0.1 * (1 + 0.2 * 8 / 1000)
    assert adaptive_kl_coefficient(0.1, 0.15, 0.1, 1000, 8) == pytest.approx(0.10016)
    # e = 0.09 / 0.1 - 1 = -0.1 -> 0.1 * (1 - 0.1 * 8 / 1000)
    assert adaptive_kl_coefficient(0.1, 0.09, 0.1, 1000, 8) == pytest.approx(0.09992)
    assert next_kl_coefficient(FixedKL(), 0.1, 5.0, 8) == 0.1
    assert next_kl_coefficient(AdaptiveKL(target=0.1, horizon=1000), 0.1, 0.15, 8) == pytest.approx(0.10016)


def test_exploration_distribution_is_flattened_top_k():
    logits = T([[4.0, 2.0, 0.0, -1.0]])
    q = exploration_distribution(logits, temperature=1.0, exploration_temperature=2.0, top_k=2)
    # top-2 logits (4, 2) at temperature 2: softmax(2, 1)
    e = math.exp(1.0)
    assert torch.allclose(q, T([[e / (e + 1), 1 / (e + 1), 0.0, 0.0]]), atol=1e-6)


def test_mixture_weights_are_bounded_and_sampling_matches_mu():
    torch.manual_seed(0)
    logits = torch.randn(1, 6) * 2
    eps = 0.25
    sampling = Sampling(temperature=1.0, epsilon=eps, exploration_temperature=3.0, exploration_top_k=3)
    pi = torch.softmax(logits, -1)[0]
    mu = (1 - eps) * pi + eps * exploration_distribution(logits, 1.0, 3.0, 3)[0]
    gen = torch.Generator().manual_seed(1)
    draws = 20000
    tokens, logp_mu, explored = mixture_sample(logits.expand(draws, 6), sampling, gen)
    freq = torch.bincount(tokens, minlength=6).float() / draws
    assert torch.allclose(freq, mu, atol=0.015)
    assert torch.allclose(logp_mu, torch.log(mu[tokens]), atol=1e-6)
    assert abs(explored.float().mean().item() - eps) < 0.015
    weights = behaviour_weights(torch.log(pi[tokens]), logp_mu)
    assert weights.max().item() <= 1 / (1 - eps) + 1e-6


def test_one_ppo_iteration_moves_the_policy_toward_rewarded_answers():
    """Real update on the tiny model: two identical prompts, one answer rewarded, one not. After the update
    the rewarded answer is more likely and the unrewarded one less likely; the first minibatch starts at
    ratio 1 (old log-probs are recomputed in the training layout)."""
    from icrl_core.config import LoraAdapter
    from icrl_core.model import load_policy

    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4), value_head=True)
    prompt = policy.tokenizer.encode("Input: I saw a falcon. Label:")
    good, bad = policy.tokenizer.encode(" zorp"), policy.tokenizer.encode(" vell")
    seqs = [prompt + good, prompt + bad]
    positions = [list(range(len(prompt), len(s))) for s in seqs]
    with torch.no_grad():
        probe = collate(seqs, positions, [[0.0] * len(p) for p in positions], [[0.0] * len(p) for p in positions],
                        policy.tokenizer.pad_token_id)
        before, _, _ = policy_outputs(policy, probe, 1.0, with_values=False)
    scores = [[0.0] * (len(p) - 1) + [s] for p, s in zip(positions, (1.0, 0.0))]
    batch = collate(seqs, positions, [b[m].tolist() for b, m in zip(before, probe.action_mask)], scores,
                    policy.tokenizer.pad_token_id)
    # Without the critic the advantages are the whitened returns: +1 on the rewarded answer's tokens, -1 on the
    # other's (a random value head would add noise of its own to this two-sample test).
    cfg = PPOConfig(epochs=4, minibatch_size=2, learning_rate=1e-2, kl_beta=0.0, entropy_beta=0.0, value_head=False)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=cfg.learning_rate)
    metrics = ppo_iteration(policy, optimizer, batch, cfg, beta=0.0, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        after, _, _ = policy_outputs(policy, probe, 1.0, with_values=False)
    sums_before = (before * probe.action_mask).sum(1)
    sums_after = (after * probe.action_mask).sum(1)
    assert sums_after[0] > sums_before[0] and sums_after[1] < sums_before[1]
    assert metrics["behaviour_weight"] == pytest.approx(1.0, abs=1e-4)
    for key in ("loss", "policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac", "kl", "grad_norm"):
        assert key in metrics and math.isfinite(metrics[key]), key

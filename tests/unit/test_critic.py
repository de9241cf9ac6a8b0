"""The in-context critic (icrl_core/critic.py) on hand-made examples and the tiny model: joint-bin tokens round
trip, the supervision mask from the N-th trajectory, the Q-weighted distribution against its formula (min-p
included), the reverse-KL gradient direction, critic training lowering its loss, Q-labelling and distillation,
the selectors, AUC/calibration and the HTML view."""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch

from icrl_core.config import LoraAdapter, ModelConfig
from icrl_core.critic import (
    NO_LABEL,
    CriticTokens,
    JointBins,
    PromptGroup,
    Trajectory,
    add_critic_tokens,
    best_of_n,
    candidate_q_values,
    critic_micro_step,
    evaluate_critic,
    expected_calibration_error,
    expected_reward,
    joint_bin_logits,
    majority_vote,
    mean_interval,
    min_p_candidates,
    new_critic,
    pack_context,
    pad_contexts,
    q_distillation_loss,
    q_weighted_decode,
    q_weighted_logprobs,
    random_of_n,
    render_q_html,
    reverse_kl_loss,
    roc_auc,
    sample_candidates,
    sample_context,
    success_probability,
    train_critic,
    train_distilled_policy,
)
from icrl_core.critic_config import CriticBins, CriticConfig, CriticDistillConfig, QSampling
from icrl_core.model import load_base_model

T = torch.tensor
BINS = JointBins(reward_values=(0.0, 1.0), length_edges=(1, 2), success_threshold=0.5)  # K = 2 x 3
TINY_CRITIC = ModelConfig(spec="tiny", adapter=LoraAdapter(rank=4, alpha=8))


class MemoryRuntime:
    rank, world_size = 0, 1

    def __init__(self):
        self.checkpoints = []

    def report(self, metrics, step):
        pass

    def save_checkpoint(self, state):
        self.checkpoints.append(copy.deepcopy(state))

    def load_latest_checkpoint(self):
        return self.checkpoints[-1] if self.checkpoints else None


# --------------------------------------------------------------------------------------------------------------
# Joint-bin tokens


def test_bins_by_hand():
    bins = JointBins(reward_values=(0.0, 0.5, 1.0), length_edges=(1, 4), success_threshold=0.5)
    assert (bins.n_reward, bins.n_length, bins.size) == (3, 3, 9)
    # nearest value, a tie goes up: 0.25 is halfway between 0 and 0.5
    assert [bins.reward_bin(r) for r in (-3.0, 0.1, 0.25, 0.6, 0.75, 2.0)] == [0, 0, 1, 1, 2, 2]
    # [0, 1) -> 0, [1, 4) -> 1, [4, inf) -> 2
    assert [bins.length_bin(n) for n in (0, 1, 3, 4, 100)] == [0, 1, 1, 2, 2]
    assert bins.index(1.0, 2) == 2 * 3 + 1 and bins.split(7) == (2, 1)
    assert [bins.length_range(j) for j in range(3)] == [(0, 1), (1, 4), (4, None)]
    assert bins.success_bins().tolist() == [False, True, True]
    with pytest.raises(ValueError):
        bins.length_bin(-1)


def test_joint_bin_tokens_round_trip_through_the_tokenizer():
    bins = JointBins(reward_values=(0.0, 0.5, 1.0), length_edges=(1, 4, 16), success_threshold=0.5)
    model, tokenizer = load_base_model("tiny")
    vocab = len(tokenizer)
    old_mean = model.get_input_embeddings().weight.mean(dim=0)
    tokens = add_critic_tokens(model, tokenizer, bins)
    assert tokens.ids == tuple(range(vocab, vocab + bins.size))  # K new ids after the vocabulary
    weight = model.get_input_embeddings().weight
    assert weight.shape[0] == vocab + bins.size and model.get_output_embeddings().weight.shape[0] == vocab + bins.size
    assert torch.allclose(weight[vocab:], old_mean.expand(bins.size, -1))  # new rows start at the mean row
    for reward in bins.reward_values:
        for remaining in range(40):
            token_id = tokens.encode(reward, remaining)
            value, (low, high) = tokens.decode(token_id)
            assert value == reward and low <= remaining and (high is None or remaining < high)
            # the token is one id in and out of the tokenizer
            name = tokenizer.convert_ids_to_tokens(token_id)
            assert tokenizer.encode(name, add_special_tokens=False) == [token_id]
            assert tokenizer.decode([token_id]) == name
    # adding them again keeps the ids and the embedding size
    assert add_critic_tokens(model, tokenizer, bins) == tokens and weight.shape[0] == vocab + bins.size
    with pytest.raises(ValueError):
        tokens.decode(5)


def test_bins_config_refuses_unordered_values_and_unreachable_success():
    with pytest.raises(ValueError):
        CriticBins(reward_values=[1.0, 0.0])
    with pytest.raises(ValueError):
        CriticBins(length_edges=[4, 4])
    with pytest.raises(ValueError):
        CriticBins(reward_values=[0.0, 1.0], success_threshold=0.0)  # every bin would count as success
    with pytest.raises(ValueError):
        CriticConfig(context_trajectories=2, supervise_from=3)


# --------------------------------------------------------------------------------------------------------------
# Packing and the supervision mask


def test_supervision_mask_starts_at_the_nth_trajectory():
    written = []

    def encode(text):
        written.append(text)
        return [7, 7]  # every feedback line is two tokens here

    y1, y2, y3 = Trajectory((10, 11), 1.0), Trajectory((20,), 0.0), Trajectory((30, 31, 32), 1.0)
    packed = pack_context([1, 2], [y1, y2], y3, BINS, encode, "Reward: {reward:g} / Length: {length}",
                          supervise_from=2)
    assert packed.input_ids == [1, 2, 10, 11, 7, 7, 20, 7, 7, 30, 31, 32]
    assert written == ["\nReward: 1 / Length: 2\n", "\nReward: 0 / Length: 1\n"]
    # k = r * 3 + l; after token j of y, |y| - 1 - j tokens remain: bins [0, 1) -> 0, [1, 2) -> 1, [2, inf) -> 2
    # y1 (r 1): remaining 1, 0 -> 4, 3;  y2 (r 0): remaining 0 -> 0;  y3 (r 1): remaining 2, 1, 0 -> 5, 4, 3
    x = NO_LABEL
    assert packed.labels == [x, x, 4, 3, x, x, 0, x, x, 5, 4, 3]
    assert packed.trajectory == [0, 0, 1, 1, 0, 0, 2, 0, 0, 3, 3, 3]
    # only the tokens of trajectories 2 and 3: y1 is read, not supervised
    assert packed.supervised == [False] * 6 + [True] + [False] * 2 + [True] * 3
    assert packed.target_start == 9
    # from the first trajectory on: every trajectory token
    first = pack_context([1, 2], [y1, y2], y3, BINS, encode, "{reward}", supervise_from=1)
    assert [i for i, s in enumerate(first.supervised) if s] == [2, 3, 6, 9, 10, 11]
    # a partial target (bare ids, reward unknown) is read but neither labelled nor supervised
    partial = pack_context([1, 2], [y1, y2], [30, 31], BINS, encode, "{reward}", supervise_from=2)
    assert partial.input_ids[-2:] == [30, 31] and partial.labels[-2:] == [x, x]
    assert partial.supervised == [False] * 6 + [True] + [False] * 4
    # padded into a batch, the mask and labels keep their places
    batch = pad_contexts([partial, packed], pad_id=0)
    assert batch.supervised.shape == (2, 12) and batch.n_labels == 1 + 4
    assert batch.labels[0, -1] == NO_LABEL


def test_sample_context_is_seeded_and_puts_k_trajectories():
    group = PromptGroup((1, 2), tuple(Trajectory((10 + i,), float(i % 2)) for i in range(6)), "p")
    cfg = CriticConfig(context_trajectories=3, supervise_from=2)
    a = sample_context(group, cfg, BINS, lambda text: [7], np.random.default_rng([0, 1]))
    b = sample_context(group, cfg, BINS, lambda text: [7], np.random.default_rng([0, 1]))
    assert a == b and max(a.trajectory) == 3
    used = [t for t, n in zip(a.input_ids, a.trajectory) if n > 0]
    assert len(set(used)) == 3  # without replacement


# --------------------------------------------------------------------------------------------------------------
# Predictions from the joint bins


def test_success_probability_and_expected_reward_by_hand():
    bins = JointBins(reward_values=(0.0, 0.5, 1.0), length_edges=(4,), success_threshold=0.5)  # K = 3 x 2
    probs = T([[0.1, 0.2, 0.3, 0.1, 0.2, 0.1]])  # (r0: .1 .2) (r0.5: .3 .1) (r1: .2 .1)
    logits = probs.log()
    # P(success) = P(r = 0.5) + P(r = 1) = 0.4 + 0.3; E[r] = 0.5 * 0.4 + 1 * 0.3
    assert success_probability(logits, bins).item() == pytest.approx(0.7)
    assert expected_reward(logits, bins).item() == pytest.approx(0.5)


# --------------------------------------------------------------------------------------------------------------
# Q-weighted sampling over min-p candidates


def test_q_weighted_distribution_equals_the_formula_after_min_p():
    p_ref = T([[0.5, 0.25, 0.15, 0.07, 0.03]])
    candidates, mask = min_p_candidates(p_ref.log(), min_p=0.2, max_candidates=4)
    # kept: p >= 0.2 * 0.5 = 0.1 -> tokens 0, 1, 2; token 3 (0.07) is the 4th candidate but filtered out
    assert candidates.tolist() == [[0, 1, 2, 3]] and mask.tolist() == [[True, True, True, False]]
    q, tau = T([[0.0, 1.0, 0.5, 9.0]]), 0.5
    ref_logprobs = p_ref.log().gather(-1, candidates)
    log_new = q_weighted_logprobs(ref_logprobs, q, mask, tau)
    # pi_new(a) = pi_ref(a) exp(Q(a) / tau) / Z over the kept candidates
    w = [0.5 * math.exp(0.0 / 0.5), 0.25 * math.exp(1.0 / 0.5), 0.15 * math.exp(0.5 / 0.5)]
    expected = [v / sum(w) for v in w] + [0.0]
    assert log_new.exp()[0].tolist() == pytest.approx(expected, abs=1e-6)
    assert log_new[0, 3] == float("-inf")  # a filtered token never gets mass, whatever its Q
    # max_candidates cuts after the most probable ones
    two, two_mask = min_p_candidates(p_ref.log(), min_p=0.0, max_candidates=2)
    assert two.tolist() == [[0, 1]] and two_mask.all()
    # tau -> large: pi_new -> pi_ref renormalised over the candidates
    flat = q_weighted_logprobs(ref_logprobs, q, mask, 1e9).exp()[0, :3]
    assert flat.tolist() == pytest.approx([0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9], abs=1e-6)
    # sampling follows pi_new
    gen = torch.Generator().manual_seed(0)
    draws = sample_candidates(log_new.expand(20000, -1), candidates.expand(20000, -1), gen)
    frequencies = torch.bincount(draws, minlength=5).float() / 20000
    assert frequencies[:4].tolist() == pytest.approx(expected, abs=0.015) and frequencies[3] == 0


def test_reverse_kl_gradient_step_moves_the_policy_toward_pi_new():
    mask = T([[True, True, True, False]])
    target = q_weighted_logprobs(T([[0.6, 0.3, 0.1, 0.0]]).log(), T([[0.0, 1.0, 0.0, 0.0]]), mask, 0.5)
    logits = T([[2.0, -1.0, 0.5, 3.0]], requires_grad=True)  # the padded 4th candidate must not matter
    kl = reverse_kl_loss(logits, target, mask)
    kl.sum().backward()
    pi_new = target.exp()[0, :3]
    pi_theta = torch.softmax(logits.detach()[0, :3], dim=-1)
    # dKL/dz_a = pi_theta(a) (log pi_theta(a) - log pi_new(a) - KL): positive where pi_theta overshoots pi_new
    grad = logits.grad[0]
    expected = pi_theta * (pi_theta.log() - pi_new.log() - kl.detach())
    assert grad[:3].tolist() == pytest.approx(expected.tolist(), abs=1e-6) and grad[3] == 0
    assert (torch.sign(grad[:3]) == torch.sign(pi_theta - pi_new)).all()
    stepped = logits.detach() - 0.5 * logits.grad
    after = torch.softmax(stepped[0, :3], dim=-1)
    assert reverse_kl_loss(stepped, target, mask) < kl.detach()
    assert (after - pi_new).abs().sum() < (pi_theta - pi_new).abs().sum()
    # at pi_theta = pi_new the loss and its gradient vanish
    at_target = target.clone().masked_fill(~mask, 0.0).requires_grad_(True)
    zero = reverse_kl_loss(at_target, target, mask)
    zero.sum().backward()
    assert zero.item() == pytest.approx(0.0, abs=1e-6) and at_target.grad.abs().max() < 1e-6


# --------------------------------------------------------------------------------------------------------------
# The critic on the tiny model


def _toy_groups(n_prompts=6, per_prompt=4):
    """Trajectories whose reward is readable from their first token (101 -> 1, 102 -> 0)."""
    groups = []
    for p in range(n_prompts):
        trajectories = tuple(Trajectory((101 if (p + i) % 2 else 102, 200 + i, 300 + p), float((p + i) % 2))
                             for i in range(per_prompt))
        groups.append(PromptGroup((1, 400 + p, 5), trajectories, f"prompt-{p}"))
    return groups


@pytest.fixture(scope="module")
def untrained_critic():
    """A critic no test trains (read-only use)."""
    return new_critic(TINY_CRITIC, BINS)


def test_untrained_critic_predicts_uniform_bins(tiny, untrained_critic):
    critic, tokens = untrained_critic
    assert isinstance(tokens, CriticTokens) and tokens.ids[0] == len(tiny.tokenizer)
    names = {name for name, p in critic.model.named_parameters() if p.requires_grad}
    assert any("trainable_tokens_delta" in name for name in names)  # the added rows train with the LoRA
    ids = T([[1, 2, 3, 4]])
    bin_logits = joint_bin_logits(critic, tokens, ids, torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
    assert bin_logits.shape == (4, BINS.size)
    assert torch.allclose(torch.softmax(bin_logits, -1), torch.full((4, BINS.size), 1 / BINS.size), atol=1e-5)


def test_critic_training_lowers_its_loss_on_a_toy_packed_batch():
    torch.manual_seed(0)
    critic, tokens = new_critic(TINY_CRITIC, BINS)
    cfg = CriticConfig(context_trajectories=3, supervise_from=2)
    groups = _toy_groups()
    contexts = [sample_context(g, cfg, BINS, lambda text: [9, 9], np.random.default_rng([0, i]))
                for i, g in enumerate(groups)]
    batch = pad_contexts(contexts, critic.tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(critic.trainable_parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        optimizer.zero_grad()
        critic.train()
        losses.append(critic_micro_step(critic, tokens, batch, batch.n_labels)["loss"])
        optimizer.step()
    assert losses[0] == pytest.approx(math.log(BINS.size), abs=1e-3)  # uniform at the start
    assert losses[-1] < 0.7 * losses[0]
    # the trained token rows moved; the base vocabulary did not
    delta = next(p for n, p in critic.model.named_parameters() if "trainable_tokens_delta" in n)
    assert delta.abs().sum() > 0


def test_train_critic_on_the_shared_loop_improves_validation_loss():
    critic, tokens = new_critic(TINY_CRITIC, BINS, seed=1)
    cfg = CriticConfig(context_trajectories=3, supervise_from=2, batch_size=6, max_steps=8, eval_steps=8,
                       save_steps=4, learning_rate=1e-2)
    groups = _toy_groups()

    def encode(text):
        return [9, 9]

    val = [sample_context(g, cfg, BINS, encode, np.random.default_rng([99, i])) for i, g in enumerate(groups)]
    runtime = MemoryRuntime()
    metrics, history = train_critic(critic, tokens, groups, val, cfg, encode, seed=0, runtime=runtime,
                                    val_keys=[g.prompt_id for g in groups])
    assert len(history) == 8 and [c.step for c in runtime.checkpoints] == [4, 8]
    before = runtime.checkpoints[-1].extra["evals"][0]
    assert metrics["val_loss"] < before["val_loss"]
    assert 0.0 <= metrics["val_auc"] <= 1.0 and metrics["val_auc_low"] <= metrics["val_auc_high"]
    assert metrics["val_trajectories"] == 2 * len(groups)  # trajectories 2 and 3 of each context


def test_q_labelling_and_distillation_on_the_tiny_model(tiny):
    critic, tokens = new_critic(TINY_CRITIC, BINS, seed=3)
    with torch.no_grad():  # distinct token rows: Q differs between candidates
        delta = next(p for n, p in critic.model.named_parameters() if "trainable_tokens_delta" in n)
        delta.copy_(torch.randn(delta.shape, generator=torch.Generator().manual_seed(0)))
    q_cfg = QSampling(min_p=0.0, max_candidates=3, tau=0.5)
    prompt = [1, 2, 3]
    # labelling a given trajectory: one step per token, pi_new = the formula over the kept candidates
    steps = q_weighted_decode(tiny, critic, tokens, prompt, prompt, q_cfg, 8, trajectory=[50, 60, 70])
    assert [s.token for s in steps] == [50, 60, 70] and [s.position for s in steps] == [0, 1, 2]
    for s in steps:
        weights = [math.exp(lp + q / q_cfg.tau) for lp, q in zip(s.ref_logprobs, s.q)]
        assert [math.exp(v) for v in s.new_logprobs] == pytest.approx([w / sum(weights) for w in weights], abs=1e-5)
        assert math.isfinite(s.token_q) and len(set(s.q)) == 3
    # Q of a candidate is the critic's E[r] after context + token; later states read the tokens taken
    assert candidate_q_values(critic, tokens, prompt, steps[0].candidate_ids).tolist() == pytest.approx(steps[0].q)
    assert candidate_q_values(critic, tokens, prompt + [50], steps[1].candidate_ids).tolist() == pytest.approx(
        steps[1].q)
    # the KV-cached reading equals reading each context + candidate from scratch
    sequences = T([prompt + [50, a] for a in steps[1].candidate_ids])
    last = torch.zeros_like(sequences, dtype=torch.bool)
    last[:, -1] = True
    scratch = expected_reward(joint_bin_logits(critic, tokens, sequences, torch.ones_like(sequences), last), BINS)
    assert steps[1].q == pytest.approx(scratch.tolist(), abs=1e-5)
    # sampling: seeded, draws among the candidates, stops at the budget
    a, b = (q_weighted_decode(tiny, critic, tokens, prompt, prompt, q_cfg, 4,
                              generator=torch.Generator().manual_seed(3)) for _ in range(2))
    assert [s.token for s in a] == [s.token for s in b] and len(a) == 4
    assert all(s.token in s.candidate_ids for s in a)
    # the control arm (Q weights off): pi_new is pi_ref renormalised over the kept candidates, Q all zero
    control = q_weighted_decode(tiny, critic, tokens, prompt, prompt, q_cfg, 8, trajectory=[50, 60, 70],
                                weighted=False)
    for s, c in zip(steps, control):
        assert c.candidate_ids == s.candidate_ids and set(c.q) == {0.0}
        total = sum(math.exp(lp) for lp in c.ref_logprobs)
        assert [math.exp(v) for v in c.new_logprobs] == pytest.approx(
            [math.exp(lp) / total for lp in c.ref_logprobs], abs=1e-5)
    low, high = mean_interval([0.0, 0.5, 1.0, 0.25], seed=0)
    assert 0.0 <= low <= 0.4375 <= high <= 1.0  # brackets the mean
    # distillation into a LoRA policy (here the critic's own weights): finite, >= 0, gradients reach the adapter
    loss = q_distillation_loss(critic, prompt, steps)
    loss.backward()
    assert math.isfinite(loss.item()) and loss.item() >= 0
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in critic.trainable_parameters())


def test_critic_tokens_are_never_candidate_actions(untrained_critic):
    critic, tokens = untrained_critic

    class FavoursCriticTokens:  # a reference whose most probable tokens are the critic's own
        def eval(self):
            return self

        def forward(self, ids, attention, logits_at):
            logits = torch.zeros(1, tokens.ids[-1] + 1)
            logits[0, list(tokens.ids)] = 10.0
            return logits, None, None

    steps = q_weighted_decode(FavoursCriticTokens(), critic, tokens, [1, 2], [1, 2],
                              QSampling(min_p=0.0, max_candidates=4), 2, generator=torch.Generator().manual_seed(0))
    assert steps and all(not set(s.candidate_ids) & set(tokens.ids) for s in steps)
    assert all(math.isfinite(v) for s in steps for v in s.new_logprobs)


@pytest.mark.parametrize("method", ["reverse_kl", "rft"])
def test_distillation_and_rejection_fine_tuning_train_the_policy(method, untrained_critic):
    from icrl_core.model import load_policy

    critic, tokens = untrained_critic
    policy = load_policy("tiny", adapter=LoraAdapter(rank=4, alpha=8), seed=5)
    before = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    cfg = CriticConfig(context_trajectories=3, supervise_from=2, data={"max_new_tokens": 3},
                       q={"min_p": 0.0, "max_candidates": 3})
    distill = CriticDistillConfig(method=method, max_steps=2, batch_size=2, eval_steps=2, save_steps=2,
                                  eval_samples=2, learning_rate=1e-2)
    groups = [PromptGroup(g.prompt_ids, g.trajectories, g.prompt_id, gold="zz") for g in _toy_groups(4)]
    runtime = MemoryRuntime()
    metrics, history = train_distilled_policy(policy, critic, tokens, groups, groups[:2], cfg, distill,
                                              lambda text: [9], lambda ids: "zz" if ids and ids[0] == 101 else "no",
                                              (2,), seed=0, runtime=runtime)
    assert [h["step"] for h in history] == [1, 2] and all(math.isfinite(h["loss"]) for h in history)
    assert {"val_reward", "val_reward_before"} <= set(metrics) and metrics["val_samples"] == 2 * 2
    # rft trains on the successful trajectories only: half of the toy ones
    assert metrics["train_items"] == (8 if method == "rft" else 4)
    after = policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    if method == "reverse_kl":
        assert 0 <= history[0]["sampled_reward"] <= 1 and math.isfinite(history[0]["token_q"])
    # prompts without a gold answer (code tasks): trained on, but no exact-match reward is measured on them
    gold_less = [PromptGroup(g.prompt_ids, g.trajectories, g.prompt_id) for g in groups]
    one_step = distill.model_copy(update={"max_steps": 1, "eval_steps": 1, "save_steps": 1})
    metrics, history = train_distilled_policy(policy, critic, tokens, gold_less, gold_less[:2], cfg, one_step,
                                              lambda text: [9], lambda ids: "", (2,), seed=0,
                                              runtime=MemoryRuntime())
    assert math.isfinite(history[0]["loss"]) and metrics["val_samples"] == 0 and math.isnan(metrics["val_reward"])
    if method == "reverse_kl":
        assert math.isnan(history[0]["sampled_reward"])  # an empty answer would have matched the empty gold


def test_evaluate_critic_reads_each_supervised_trajectory_once(untrained_critic):
    critic, tokens = untrained_critic
    cfg = CriticConfig(context_trajectories=3, supervise_from=2)
    contexts = [sample_context(g, cfg, BINS, lambda text: [9], np.random.default_rng(i))
                for i, g in enumerate(_toy_groups(4))]
    metrics = evaluate_critic(critic, tokens, contexts, batch_size=3)
    assert metrics["val_trajectories"] == 8
    assert metrics["val_loss"] == pytest.approx(math.log(BINS.size), abs=1e-3)
    assert metrics["val_auc"] == 0.5  # uniform predictions: every pair ties


# --------------------------------------------------------------------------------------------------------------
# Selectors and metrics


def test_best_of_n_consistency_and_random():
    scores = T([[0.1, 0.9, 0.5], [0.7, 0.7, 0.2]])
    rewards = T([[0.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    assert best_of_n(scores, rewards).tolist() == [1.0, 0.0]  # ties: the first
    assert random_of_n(rewards).tolist() == pytest.approx([1 / 3, 2 / 3])
    assert majority_vote(["b", "a", "a", "b", "c"]) == 0  # a and b tie: b was seen first
    assert majority_vote(["x", "y", "y"]) == 1


def test_auc_and_calibration_by_hand():
    # positives 0.8, 0.4; negatives 0.4, 0.1: pairs (0.8 > 0.4), (0.8 > 0.1), (0.4 = 0.4: 1/2), (0.4 > 0.1)
    assert roc_auc([0.8, 0.4, 0.4, 0.1], [1, 1, 0, 0]) == pytest.approx(3.5 / 4)
    assert math.isnan(roc_auc([0.1, 0.2], [1, 1]))
    # two bins used: [0.2] with label 0 -> |0 - 0.2|; [0.9, 0.9] with labels 1, 0 -> |0.5 - 0.9|
    assert expected_calibration_error([0.2, 0.9, 0.9], [0, 1, 0]) == pytest.approx(0.2 / 3 + 2 * 0.4 / 3)


def test_html_view_is_self_contained_and_escapes_tokens():
    page = render_q_html("Q <view>", [{"pieces": ["def", " f", "(<x>)", "\n"], "q": [0.0, 0.5, 1.0, None],
                                       "prompt": "write f & g", "meta": "reward 1"}])
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page
    assert not re.search(r"<script|<link|<img|src=|href=|url\(|@import|https?://", page)
    assert "(&lt;x&gt;)" in page and "write f &amp; g" in page and "Q &lt;view&gt;" in page
    assert 'title="Q = 0.0000"' in page and 'title="Q = 1.0000"' in page
    assert "background:#ff6e6e" in page and "background:#5aff78" in page  # the ends of the scale
    with pytest.raises(ValueError):
        render_q_html("x", [{"pieces": ["a"], "q": [0.1, 0.2]}])


def test_the_pipeline_runs_the_critic_stages_only_when_asked():
    from tasks.stages import CRITIC_STAGES, load_stages, pipeline_stages
    from tests.conftest import ROOT

    assert set(CRITIC_STAGES) <= set(load_stages(ROOT))  # both are stages of dvc.yaml
    assert not set(CRITIC_STAGES) & set(pipeline_stages("ppo", ROOT))
    with_critic = pipeline_stages("ppo", ROOT, critic=True)
    assert (with_critic.index("build_dataset") < with_critic.index("critic_data") < with_critic.index("critic")
            < with_critic.index("critic_distill"))


# --------------------------------------------------------------------------------------------------------------
# The critic_data stage's generation: shard-invariant batches


def test_generated_rows_do_not_depend_on_how_the_batches_are_shared(tiny):
    """Each batch draws from its own generator, seeded by (seed, split, batch index): the batches generated in one
    process in order, or shared by two "workers" each taking them in another order, give identical rows once put
    back in (split, batch index) order."""
    from icrl_core.critic import SPLITS, generation_batches, sample_episode_batch
    from icrl_core.dataset_build import build_episodes, resolve_sources
    from icrl_core.rollout import Sampling
    from tests.stage_helpers import keyword_data

    data = keyword_data(num_episodes=8)
    built = build_episodes(resolve_sources(data, 0), data, 0)
    episodes = {split: [b.episode for b in built if b.split == split][:3] for split in SPLITS}
    assert len(episodes["train"]) == 3 and episodes["val"]
    batches = [b for split in SPLITS for b in generation_batches(episodes[split], 3, 4, split)]
    assert [(b.split, b.index, len(b.samples)) for b in batches][:3] == [("train", 0, 4), ("train", 1, 4),
                                                                         ("train", 2, 1)]
    assert batches[0].samples == (0, 1, 2, 0) and batches[0].prompts[3] is episodes["train"][1]  # prompt-major

    def rows(order, seed=0):
        keyed = [(batches[i].order, sample_episode_batch(tiny, batches[i], Sampling(temperature=1.0), 4, 2048, seed))
                 for i in order]
        return [row for _, part in sorted(keyed, key=lambda item: item[0]) for row in part]

    in_order = rows(range(len(batches)))
    worker_a, worker_b = list(range(len(batches)))[1::2], list(range(len(batches)))[0::2]
    assert rows(worker_a[::-1] + worker_b[::-1]) == in_order  # another partition, another order: the same rows
    assert [(r["split"], r["prompt_id"], r["sample"]) for r in in_order] == [
        (split, e.episode_id, s) for split in SPLITS for e in episodes[split] for s in range(3)]
    assert all(r["reward"] == float(r["success"]) == float(r["answer"].strip() == r["gold"].strip())
               for r in in_order)
    assert [r["trajectory_ids"] for r in rows(range(len(batches)), seed=1)] != [r["trajectory_ids"]
                                                                                  for r in in_order]


def test_the_critic_stage_refuses_rewards_beyond_its_reward_bins(in_tmp):
    """Code rewards (up to ~2.3) with the default bins [0, 1] would all land in the top bin: a clear error."""
    from icrl_core.critic import trajectory_table_bytes
    from icrl_core.errors import UserError
    from tasks.critic import read_groups
    from tasks.settings import load_config

    row = {"prompt_id": "t", "split": "train", "sample": 0, "prompt_ids": [1, 2], "trajectory_ids": [3],
           "reward": 2.2, "length": 1, "finished": True, "answer": "x", "gold": "", "success": True}
    path = in_tmp / "artifacts" / "critic_data" / "trajectories.parquet"
    path.parent.mkdir(parents=True)
    path.write_bytes(trajectory_table_bytes([row, {**row, "sample": 1, "reward": 0.0, "success": False}]))
    with pytest.raises(UserError, match=r"rewards span \[0, 2.2\], beyond critic.bins.reward_values \[0.0, 1.0\]"):
        read_groups(load_config(None, [], environ={}))
    code_bins = "critic.bins={reward_values: [0.0, 0.4, 0.8, 1.2, 2.0, 2.3], success_threshold: 1.5}"
    fitting = load_config(None, [code_bins], environ={})  # the bins docs/CRITIC.md gives for code
    (train,), val = read_groups(fitting)
    assert [t.reward for t in train.trajectories] == [2.2, 0.0] and train.gold == "" and val == []

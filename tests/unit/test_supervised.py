"""Supervised losses against hand-computed values, masking, data order, data-parallel equivalence of rank
shards, validation metrics (tiny model). The bootstrap loop's determinism and resume, and two gloo worker
processes: tests/integration/test_supervised.py."""

from __future__ import annotations

import math

import pytest
import torch

from icrl_core.config import LoraAdapter
from icrl_core.distributed import shard
from icrl_core.model import load_policy
from icrl_core.objectives import kl_policy_base
from icrl_core.supervised import (
    batch_indices,
    bootstrap_micro_step,
    bootstrap_objective,
    bradley_terry_loss,
    evaluate_bootstrap,
    make_scheduler,
    masked_token_cross_entropy,
    pad_episodes,
    query_accuracy,
)
from tests.stage_helpers import keyword_rows


def test_cross_entropy_matches_hand_computation():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    targets = torch.tensor([2, 0])
    z = math.exp(1) + math.exp(2) + math.exp(3)
    expected = [-(3 - math.log(z)), math.log(3)]
    assert masked_token_cross_entropy(logits, targets).tolist() == pytest.approx(expected, abs=1e-6)


def test_kl_matches_hand_computation():
    # pi = softmax([0, ln 2]) = [1/3, 2/3]; pi_base = [1/2, 1/2]
    policy = torch.tensor([[0.0, math.log(2.0)]])
    base = torch.tensor([[5.0, 5.0]])
    expected = 1 / 3 * math.log((1 / 3) / 0.5) + 2 / 3 * math.log((2 / 3) / 0.5)
    assert kl_policy_base(policy, base).item() == pytest.approx(expected, abs=1e-6)
    assert kl_policy_base(policy, policy).item() == pytest.approx(0.0, abs=1e-7)


def test_bradley_terry_matches_hand_computation():
    r_pref, r_rej = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 1.0])
    expected = [-math.log(1 / (1 + math.exp(-1.5))), -math.log(1 / (1 + math.exp(2.0)))]
    assert bradley_terry_loss(r_pref, r_rej).tolist() == pytest.approx(expected, abs=1e-6)
    big = bradley_terry_loss(torch.tensor([0.0]), torch.tensor([200.0]))  # stable where sigmoid underflows
    assert big.item() == pytest.approx(200.0)


def test_bootstrap_objective_is_token_mean_of_ce_plus_beta_kl():
    ce, kl = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.0, 1.0])
    assert bootstrap_objective(ce, kl, 0.2, n_tokens=6).item() == pytest.approx((6 + 0.2 * 1.5) / 6)
    assert bootstrap_objective(ce, None, 0.2, n_tokens=3).item() == pytest.approx(2.0)


def test_query_accuracy_needs_every_answer_token_right():
    correct = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.long)
    query_ids = torch.tensor([-1, 0, 0, 1, 1, 2])  # the first token is an exemplar answer
    assert query_accuracy(correct, query_ids, 3).tolist() == [0, 1, 1]


def test_masks_select_exactly_the_answer_tokens(tokens):
    train, _ = keyword_rows(tokens, n_queries=2)
    batch = pad_episodes(train[:3], tokens.tokenizer.pad_token_id)
    predict_at, targets = batch.predict_at, batch.targets
    assert int(predict_at.sum()) == targets.numel() == sum(sum(r.loss_mask[1:]) for r in train[:3])
    # each selected position is followed by a trained token, and that token is the target
    rows, cols = predict_at.nonzero(as_tuple=True)
    assert torch.equal(batch.input_ids[rows, cols + 1], targets)
    assert bool(batch.loss_mask[rows, cols + 1].all()) and not bool(batch.attention_mask[~batch.attention_mask.bool()]
                                                                      .any())
    # query answer tokens carry their query's index; the preferred ids are exactly those tokens
    qids = batch.target_query_ids
    first = train[0]
    spans = [first.input_ids[s:e] for s, e in zip(first.query_start, first.query_end)]
    for q, span in enumerate(spans):
        assert targets[qids == q].tolist() == span
    eot = tokens.end_of_turn_id
    assert all(span[-1] == eot for span in spans)


def test_batch_indices_are_seeded_epoch_permutations():
    n, g = 10, 4
    stream = [i for step in range(5) for i in batch_indices(n, seed=3, step=step, global_batch=g)]
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert stream[:10] != stream[10:20]  # a new permutation each epoch
    assert batch_indices(n, 3, 2, g) == stream[8:12]  # a pure function of (seed, step)
    assert batch_indices(n, 4, 0, g) != batch_indices(n, 3, 0, g)


def test_scheduler_warmup_then_linear_decay():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=1.0)
    sched = make_scheduler(opt, warmup_steps=2, max_steps=6, schedule="linear")
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])


def _lora_policy(seed=0):
    return load_policy("tiny", seed=seed, adapter=LoraAdapter(rank=4, alpha=8))


def test_kl_is_zero_and_ce_is_the_base_ce_before_training(tiny, tokens):
    train, _ = keyword_rows(tokens)
    batch = pad_episodes(train[:2], tokens.tokenizer.pad_token_id)
    policy = _lora_policy()  # LoRA B starts at zero: the policy is the base model
    out = bootstrap_micro_step(policy, batch, kl_beta=0.5, n_tokens=batch.targets.numel(), backward=False)
    assert out["kl"] == pytest.approx(0.0, abs=1e-9)
    with torch.no_grad():
        logits, _, _ = tiny.forward(batch.input_ids, batch.attention_mask, logits_at=batch.predict_at)
    assert out["ce"] == pytest.approx(float(masked_token_cross_entropy(logits, batch.targets).mean()), rel=1e-6)


def test_two_rank_shards_give_the_one_process_gradient(tokens):
    """Each rank scales its summed loss by W / N_global; the mean of the ranks' gradients (what
    average_gradients computes) equals the one-process gradient of the token-mean loss."""
    train, _ = keyword_rows(tokens, n_queries=2, n_queries_min=1)
    rows = train[:6]
    n_tokens = sum(sum(r.loss_mask[1:]) for r in rows)
    pad = tokens.tokenizer.pad_token_id
    policy = _lora_policy()
    with torch.no_grad():  # move off the zero-B init so the KL term has a gradient too
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    params = policy.trainable_parameters()

    def grads(parts, scale):
        for p in params:
            p.grad = None
        metrics = {}
        for part in parts:
            out = bootstrap_micro_step(policy, pad_episodes(part, pad), 0.3, n_tokens, scale=scale)
            metrics = {k: metrics.get(k, 0.0) + v for k, v in out.items()}
        return [p.grad.clone() for p in params], metrics

    single, single_metrics = grads([rows[:3], rows[3:]], 1.0)
    per_rank = [grads([shard(rows, r, 2)], 2.0) for r in range(2)]
    averaged = [(a + b) / 2 for a, b in zip(per_rank[0][0], per_rank[1][0])]
    for one, avg in zip(single, averaged):
        assert torch.allclose(one, avg, atol=1e-6, rtol=1e-4)
    for key in single_metrics:
        assert (per_rank[0][1][key] + per_rank[1][1][key]) / 2 == pytest.approx(single_metrics[key], rel=1e-5)


def test_validation_metrics_on_tiny(tokens):
    _, val = keyword_rows(tokens)
    metrics = evaluate_bootstrap(_lora_policy(), val, batch_size=3, kl_beta=0.1)
    assert metrics["val_queries"] == sum(len(r.query_start) for r in val)
    assert metrics["val_kl"] == pytest.approx(0.0, abs=1e-9)
    assert 0.0 <= metrics["val_answer_accuracy"] <= 1.0
    assert metrics["val_ce"] > 5  # a random model over a 49k vocabulary

"""Reward model: scoring at the last real token, save/load round trip, refusal of wrong or corrupt folders,
data-parallel equivalence, pairs from tokenized queries (tiny model). Bradley-Terry training and bitwise resume:
tests/integration/test_reward_model.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from icrl_core.config import LoraAdapter, ModelConfig
from icrl_core.distributed import shard
from icrl_core.errors import CheckpointError, UserError
from icrl_core.reward_model import load_reward_model, new_reward_model, save_reward_model
from icrl_core.supervised import Pair, episode_pairs, evaluate_reward_model, reward_micro_step
from tests.stage_helpers import keyword_rows

TINY = ModelConfig(spec="tiny", adapter=LoraAdapter(rank=4, alpha=8))


def _perturbed(seed=0):
    rm = new_reward_model(TINY, None, seed=seed)
    with torch.no_grad():  # LoRA B starts at zero: make the adapter matter
        gen = torch.Generator().manual_seed(1)
        for p in rm.backbone_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return rm


def _toy_pairs(tokens, n=16):
    """Preferred answers end in ' yes', rejected ones in ' no': separable from the answer alone."""
    eot = tokens.end_of_turn_id
    yes, no = list(tokens.encode(" yes")), list(tokens.encode(" no"))
    pairs = []
    for i in range(n):
        prompt = list(tokens.encode(f"Question {i}: is {i % 7} small?"))
        pairs.append(Pair(prompt + yes + [eot], prompt + no + [eot]))
    return pairs


def test_score_reads_the_last_real_token_whatever_the_padding(tokens):
    rm = _perturbed()
    seqs = [list(tokens.encode("short one")), list(tokens.encode("a much longer sequence of several words here"))]
    together = rm.score(seqs, batch_size=2)
    alone = torch.cat([rm.score([s]) for s in seqs])
    assert together.shape == (2,) and together.dtype == torch.float32
    assert torch.allclose(together, alone, atol=1e-5)
    # the reward depends on the last token: changing it changes the score
    assert not torch.allclose(rm.score([seqs[0][:-1] + [seqs[0][-1] + 1]]), alone[:1])


def test_save_load_round_trip_and_refusals(tmp_path, tokens):
    rm = _perturbed()
    with torch.no_grad():
        rm.head.linear.bias.fill_(0.25)
    folder = save_reward_model(tmp_path / "rm", rm, {"base": "base"})
    assert sorted(p.name for p in folder.iterdir()) == ["adapter.safetensors", "reward_head.safetensors",
                                                        "reward_model.json"]
    # the adapter shape comes from the folder: a policy config with another LoRA rank still loads it
    loaded = load_reward_model(folder, ModelConfig(spec="tiny", adapter=LoraAdapter(rank=16)))
    seqs = [pair.preferred for pair in _toy_pairs(tokens, 3)]
    assert torch.equal(rm.score(seqs), loaded.score(seqs))
    assert not any(p.requires_grad for p in loaded.parameters())
    with pytest.raises(UserError, match="trained on model.spec='tiny'"):
        load_reward_model(folder, ModelConfig(spec="smollm2-135m"))
    with pytest.raises(UserError, match="not a reward model folder"):
        load_reward_model(tmp_path / "missing", TINY)
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    head = broken / "reward_head.safetensors"
    head.write_bytes(head.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_reward_model(broken, TINY)
    shutil.copy(folder / "reward_head.safetensors", head)
    (broken / "adapter.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError):
        load_reward_model(broken, TINY)


def test_two_rank_shards_give_the_one_process_gradient(tokens):
    pairs = _toy_pairs(tokens, 6)
    rm = _perturbed()
    params = rm.parameters()

    def grads(parts, scale):
        for p in params:
            p.grad = None
        for part in parts:
            reward_micro_step(rm, part, len(pairs), scale=scale)
        return [p.grad.clone() for p in params]

    single = grads([pairs[:3], pairs[3:]], 1.0)
    ranks = [grads([shard(pairs, r, 2)], 2.0) for r in range(2)]
    for one, a, b in zip(single, *ranks):
        assert torch.allclose(one, (a + b) / 2, atol=1e-6, rtol=1e-4)


def test_pairs_come_from_tokenized_queries(tokens):
    train, _ = keyword_rows(tokens, n_queries=2)
    pairs = episode_pairs(train[:2])
    assert len(pairs) == 4
    row = train[0]
    assert pairs[0].preferred == row.input_ids[:row.query_end[0]]
    assert pairs[0].rejected == row.input_ids[:row.query_start[0]] + row.rejected_ids[0]
    assert pairs[1].preferred == row.input_ids[:row.query_end[1]]


def test_evaluation_reports_the_reward_scale_of_the_pairs_it_scored(tokens):
    pairs = _toy_pairs(tokens, 5)
    rm = _perturbed()
    metrics = evaluate_reward_model(rm, pairs, batch_size=2)  # batches of 2, 2, 1 pairs
    rewards = rm.score([p.preferred for p in pairs] + [p.rejected for p in pairs])
    assert metrics["val_pairs"] == 5
    assert metrics["val_reward_mean"] == pytest.approx(float(rewards.mean()), abs=1e-5)
    assert metrics["val_reward_std"] == pytest.approx(float(rewards.std()), abs=1e-5)  # the sample std

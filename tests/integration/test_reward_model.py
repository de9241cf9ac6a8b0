"""Reward model: Bradley-Terry training that learns and resumes bitwise (tiny model). Its parts:
tests/unit/test_reward_model.py."""

from __future__ import annotations

import shutil

import torch

from icrl_core.checkpoint import list_checkpoints
from icrl_core.config import RewardModelConfig
from icrl_core.reward_model import new_reward_model
from icrl_core.supervised import evaluate_reward_model, train_reward_model
from tasks.runtime import LocalRuntime
from tests.conftest import timeless
from tests.unit.test_reward_model import TINY, _toy_pairs


def _cfg(**kw):
    base = {"max_steps": 12, "batch_size": 4, "grad_accum": 1, "save_steps": 4, "eval_steps": 6, "learning_rate": 1e-3,
            "head_learning_rate": 3e-2, "warmup_steps": 0, "lr_schedule": "constant"}
    base.update(kw)
    return RewardModelConfig(**base)


def test_bradley_terry_training_learns_and_resumes_bitwise(tmp_path, tokens):
    pairs = _toy_pairs(tokens, 24)
    train, val = pairs[:16], pairs[16:]
    rm = new_reward_model(TINY, None, seed=0)
    before = evaluate_reward_model(rm, val, 4)
    runtime = LocalRuntime(tmp_path / "full")
    metrics, _ = train_reward_model(rm, train, val, _cfg(), seed=3, runtime=runtime)
    assert metrics["val_pairwise_accuracy"] == 1.0 and metrics["val_loss"] < before["val_loss"]
    assert metrics["val_margin"] > 0 and metrics["val_pairs"] == 8
    step8 = [p for p in list_checkpoints(tmp_path / "full") if p.name.endswith("00000008")]
    shutil.copytree(step8[0], tmp_path / "resumed" / step8[0].name)
    resumed = new_reward_model(TINY, None, seed=0)
    runtime2 = LocalRuntime(tmp_path / "resumed")
    metrics2, _ = train_reward_model(resumed, train, val, _cfg(), seed=3, runtime=runtime2)
    assert [h["step"] for h in runtime2.history] == [9, 10, 11, 12]
    assert timeless(metrics2) == timeless(metrics)
    a, b = rm.trainable_tensors(), resumed.trainable_tensors()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

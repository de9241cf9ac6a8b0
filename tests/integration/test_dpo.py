"""DPO / IPO (icrl_core/dpo.py, stage tasks/dpo.py) on the tiny model: training on the episodes' pairs raises
preference accuracy, a kill resumes exactly, and the stage (episode pairs + pairs mined from the policy's
streams) writes its outputs. The loss's parts: tests/unit/test_dpo.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from icrl_core.config import DPOConfig
from icrl_core.dpo import train_dpo
from icrl_core.supervised import episode_pairs
from tasks.settings import load_config
from tests.conftest import Killed, MemoryRuntime, timeless
from tests.stage_helpers import keyword_rows, stage_args
from tests.unit.test_dpo import _policy, _start_adapter


def _cfg(**overrides) -> DPOConfig:
    fields = {"max_steps": 6, "eval_steps": 3, "save_steps": 2, "batch_size": 8, "learning_rate": 1e-2,
              "max_eval_pairs": 8, "beta": 0.5}
    return DPOConfig(**{**fields, **overrides})


def test_dpo_raises_preference_accuracy_and_resumes_exactly(tokens):
    train, _ = keyword_rows(tokens)
    # 8 pairs in every (full) batch, validated on themselves: a tiny random model cannot generalise, it can learn
    pairs = val = episode_pairs(train)[:8]
    policy = _policy()
    metrics, history = train_dpo(policy, pairs, val, _cfg(), seed=1, runtime=MemoryRuntime())
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # -log sigmoid(0)
    assert metrics["val_preference_accuracy_before"] == 0.0  # h = 0 everywhere: no pair preferred yet
    assert metrics["val_preference_accuracy"] >= 0.75 and metrics["val_margin"] > 0
    losses = [h["loss"] for h in history]
    assert losses == sorted(losses, reverse=True)  # full-batch steps: the loss falls at every step
    weights = {k: v.clone() for k, v in policy.trainable_state_dict().items()}

    saved: list = []
    with pytest.raises(Killed):
        train_dpo(_policy(), pairs, val, _cfg(), seed=1, runtime=MemoryRuntime(saved, kill_after=2))
    resumed_policy = _policy()
    _, resumed_history = train_dpo(resumed_policy, pairs, val, _cfg(), seed=1, runtime=MemoryRuntime(saved))
    assert timeless(resumed_history) == timeless(history)
    assert all(torch.equal(weights[k], v) for k, v in resumed_policy.trainable_state_dict().items())
    ipo, _ = train_dpo(_policy(), pairs, val, _cfg(loss="ipo", max_steps=2), seed=1, runtime=MemoryRuntime())
    assert ipo["loss"] > 0


def test_dpo_from_an_adapter_with_the_start_as_reference_starts_at_log_2_and_resumes_exactly(tokens):
    """dpo.reference=start from a non-zero adapter: the first loss is log 2 (against the base model it is not), and
    a killed run resumes to the same weights (the reference is frozen before the checkpoint is restored)."""
    pairs = episode_pairs(keyword_rows(tokens)[0])[:8]
    cfg = _cfg(reference="start", max_steps=4)
    policy = _start_adapter()
    _, history = train_dpo(policy, pairs, pairs, cfg, seed=1, runtime=MemoryRuntime())
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    _, base_history = train_dpo(_start_adapter(), pairs, pairs, _cfg(max_steps=1), seed=1, runtime=MemoryRuntime())
    assert abs(base_history[0]["loss"] - math.log(2)) > 1e-3
    saved: list = []
    with pytest.raises(Killed):
        train_dpo(_start_adapter(), pairs, pairs, cfg, seed=1, runtime=MemoryRuntime(saved, kill_after=2))
    resumed = _start_adapter()
    train_dpo(resumed, pairs, pairs, cfg, seed=1, runtime=MemoryRuntime(saved))
    weights = policy.trainable_state_dict()
    assert all(torch.equal(weights[k], v) for k, v in resumed.trainable_state_dict().items())


def test_dpo_stage_trains_on_episode_and_mined_pairs(in_tmp):
    from icrl_core.adapter_format import is_adapter_folder
    from tasks import build_dataset, dpo, tokenize

    config = load_config(None, [a for a in stage_args(
        "dpo.max_steps=2", "dpo.eval_steps=2", "dpo.save_steps=1", "dpo.batch_size=2", "dpo.mine_streams=true",
        "dpo.stream={steps: 3, group_size: 2, groups: 1}", "data.labels_per_episode=3") if a != "--set"],
        environ={})
    build_dataset.run(config)
    tokenize.run(config)
    metrics = dpo.run(config)
    out = in_tmp / "artifacts" / "dpo"
    assert is_adapter_folder(out / "adapter") and (out / "curves.png").stat().st_size > 1000
    history = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2]
    assert all(h["pairs"] >= 2 for h in history) and "mined_pairs" in history[0]
    headline = json.loads((in_tmp / "metrics" / "dpo.json").read_text())
    assert set(headline) == {"val_preference_accuracy", "val_preference_accuracy_before", "val_margin"}
    assert metrics["step"] == 2 and "seconds" in metrics


def test_dpo_on_hindsight_couples_starts_feedback_blind_and_resumes_exactly():
    """dpo.mine_hindsight alone (no episode pairs) on keyword_map streams of the tiny model: every step's pairs are
    hindsight pairs, the first loss is log 2 (policy = reference), the validation couples are scored before any
    update as a feedback-blind policy scores them (half the pairs, no couple right), and a kill resumes to the
    same weights. That the loss teaches reading the feedback: tests/unit/test_hindsight.py."""
    from icrl_core.config import DataConfig, SyntheticSource
    from icrl_core.dataset_build import resolve_sources

    data = DataConfig(sources=[SyntheticSource(name="keyword_map")], labels_per_episode=3, labels_per_episode_min=2)
    sources = (resolve_sources(data, seed=0), data)
    cfg = _cfg(episode_pairs=False, mine_hindsight=True, max_steps=6, eval_steps=6, save_steps=2, batch_size=4,
               learning_rate=2e-2, beta=0.1, stream={"steps": 8, "group_size": 2, "groups": 2, "eval_groups": 2})
    policy = _policy()
    metrics, history = train_dpo(policy, [], [], cfg, seed=3, runtime=MemoryRuntime(), stream_sources=sources)
    assert all(h["hindsight_pairs"] > 0 and h["pairs"] == h["hindsight_pairs"] for h in history)
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # -log sigmoid(0)
    assert metrics["val_hindsight_accuracy_before"] == 0.5 and metrics["val_couple_accuracy_before"] == 0.0
    assert metrics["val_hindsight_margin_before"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["val_hindsight_pairs"] > 0 and 0 <= metrics["val_stream_reward"] <= 1
    weights = {k: v.clone() for k, v in policy.trainable_state_dict().items()}

    saved: list = []
    with pytest.raises(Killed):
        train_dpo(_policy(), [], [], cfg, seed=3, runtime=MemoryRuntime(saved, kill_after=3), stream_sources=sources)
    resumed = _policy()
    train_dpo(resumed, [], [], cfg, seed=3, runtime=MemoryRuntime(saved), stream_sources=sources)
    assert all(torch.equal(weights[k], v) for k, v in resumed.trainable_state_dict().items())



def test_dpo_with_general_chat_replay_keeps_replies_nearer_the_base_and_resumes_exactly(tokens):
    """dpo.replay: the bootstrap's replay term added to each DPO step (from an adapter away from the base, so the
    replies' KL starts above 0). It is logged every step and on held-back chats at each evaluation, it ends with
    the replies nearer the base model than the same run without it, and a killed run resumes to the same weights
    (the chats are drawn as a pure function of (seed, step))."""
    from icrl_core.config import ReplayConfig
    from icrl_core.model import load_policy
    from icrl_core.replay import sample_replies
    from icrl_core.supervised import evaluate_replay
    from tests.unit.test_replay import TEXTS

    pairs = episode_pairs(keyword_rows(tokens)[0])[:8]
    chats = sample_replies(load_policy("tiny", seed=0), TEXTS[:12], max_new_tokens=8, temperature=1.0, seed=0)
    replay = (chats[3:], chats[:3])
    cfg = _cfg(max_steps=4, eval_steps=2, replay=ReplayConfig(beta=5.0, per_step=4))
    start_kl = evaluate_replay(_start_adapter(), chats[:3], batch_size=4)["val_replay_kl"]
    policy = _start_adapter()
    metrics, history = train_dpo(policy, pairs, pairs, cfg, seed=1, runtime=MemoryRuntime(), replay=replay)
    assert all(h["replay_kl"] > 0 for h in history)
    assert [("val_replay_kl" in h) for h in history] == [False, True, False, True]
    assert metrics["val_replay_kl_before"] == pytest.approx(start_kl)  # the evaluation before step 1
    plain = _start_adapter()
    train_dpo(plain, pairs, pairs, _cfg(max_steps=4, eval_steps=2), seed=1, runtime=MemoryRuntime())
    without = evaluate_replay(plain, chats[:3], batch_size=4)["val_replay_kl"]
    assert metrics["val_replay_kl"] < start_kl and metrics["val_replay_kl"] < 0.8 * without  # 0.017, 0.023, 0.027
    saved: list = []
    with pytest.raises(Killed):
        train_dpo(_start_adapter(), pairs, pairs, cfg, seed=1, runtime=MemoryRuntime(saved, kill_after=2),
                  replay=replay)
    resumed = _start_adapter()
    train_dpo(resumed, pairs, pairs, cfg, seed=1, runtime=MemoryRuntime(saved), replay=replay)
    weights = policy.trainable_state_dict()
    assert all(torch.equal(weights[k], v) for k, v in resumed.trainable_state_dict().items())

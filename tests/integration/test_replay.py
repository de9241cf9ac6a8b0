"""General-chat replay in the bootstrap (tiny model): the loop reports it and resumes bitwise, and the stage
samples the replay chats once and reuses them. Replay's parts: tests/unit/test_replay.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from icrl_core.checkpoint import list_checkpoints
from icrl_core.config import BootstrapConfig, ReplayConfig
from icrl_core.model import load_policy
from icrl_core.replay import sample_replies
from icrl_core.supervised import evaluate_replay, train_bootstrap
from tasks.runtime import LocalRuntime
from tests.stage_helpers import keyword_rows
from tests.unit.test_replay import TEXTS, _lora_policy


def test_bootstrap_with_replay_reports_it_and_resumes_bitwise(tmp_path, tokens):
    """The replay term is logged every step (zero at the start: LoRA B = 0) and on held-back chats at each
    evaluation; its chats are drawn as a pure function of (seed, step), so a resumed run ends where an
    uninterrupted one does."""
    train, val = keyword_rows(tokens)
    chats = sample_replies(load_policy("tiny", seed=0), TEXTS[:10], max_new_tokens=8, temperature=1.0, seed=0)
    replay = (chats[2:], chats[:2])
    cfg = BootstrapConfig(max_steps=4, batch_size=2, grad_accum=1, save_steps=2, eval_steps=2, learning_rate=2e-2,
                          kl_beta=0.0, max_eval_episodes=2, replay=ReplayConfig(beta=1.0, per_step=3))
    policy = _lora_policy()
    _, history = train_bootstrap(policy, train, val, cfg, seed=1, runtime=LocalRuntime(tmp_path / "a"),
                                 replay=replay)
    assert all("replay_kl" in h for h in history) and history[0]["replay_kl"] == pytest.approx(0.0, abs=1e-7)
    assert [("val_replay_kl" in h) for h in history] == [False, True, False, True]
    assert history[-1]["val_replay_kl"] == pytest.approx(
        evaluate_replay(policy, chats[:2], batch_size=2)["val_replay_kl"])
    step2 = [p for p in list_checkpoints(tmp_path / "a") if p.name.endswith("00000002")]
    shutil.copytree(step2[0], tmp_path / "resumed" / step2[0].name)
    resumed = _lora_policy()
    train_bootstrap(resumed, train, val, cfg, seed=1, runtime=LocalRuntime(tmp_path / "resumed"), replay=replay)
    expected, got = policy.trainable_state_dict(), resumed.trainable_state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    # off (beta 0): the run is the plain bootstrap
    plain_cfg = cfg.model_copy(update={"replay": ReplayConfig(beta=0.0)})
    _, plain = train_bootstrap(_lora_policy(), train, val, plain_cfg, seed=1, runtime=LocalRuntime(tmp_path / "p"),
                               replay=replay)
    assert not any("replay_kl" in h or "val_replay_kl" in h for h in plain)


def test_bootstrap_stage_samples_replay_chats_once_and_reuses_them(tmp_path, monkeypatch):
    """tasks/training.replay_chats: training texts of the replay tasks become chats, cached outside the stage's
    output folder (which DVC deletes before the stage runs) under a key of what determines them; a rerun after
    the output folder is gone reuses them, training-only settings do not matter, changed settings sample again."""
    import shutil

    from tasks.settings import PipelineConfig, with_overrides
    from tasks.training import REPLAY_CACHE, replay_chats, replay_key
    from tests.conftest import TASKS_DIR

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "artifacts" / "bootstrap"
    config = with_overrides(PipelineConfig(), {
        "model.spec": "tiny", "model.dtype": "float32", "data.tasks_dir": str(TASKS_DIR),
        "bootstrap.output_dir": str(out),
        "bootstrap.replay": {"beta": 1.0, "tasks": ["banking77"], "prompts": 12, "max_new_tokens": 3}})
    assert replay_chats(with_overrides(config, {"bootstrap.replay.beta": 0.0}), None, rank=0) is None
    policy = load_policy("tiny", seed=0)
    train, val = replay_chats(config, policy, rank=0)
    assert len(train) == 10 and len(val) == 2
    path = tmp_path / REPLAY_CACHE / f"{replay_key(config)}.jsonl"
    written = path.stat().st_mtime_ns
    assert not out.exists() or not list(out.iterdir())  # nothing in the DVC out
    shutil.rmtree(out, ignore_errors=True)
    retrained = with_overrides(config, {"bootstrap.replay.beta": 0.3, "bootstrap.learning_rate": 1e-3})
    assert replay_key(retrained) == replay_key(config)
    assert replay_chats(retrained, policy, rank=0) == (train, val) and path.stat().st_mtime_ns == written
    changed = with_overrides(config, {"bootstrap.replay.max_new_tokens": 4})
    assert replay_key(changed) != replay_key(config)
    longer = replay_chats(changed, policy, rank=0)
    assert longer != (train, val) and path.stat().st_mtime_ns == written
    assert sorted(p.name for p in (tmp_path / REPLAY_CACHE).iterdir()) == sorted(
        f"{replay_key(c)}.jsonl" for c in (config, changed))

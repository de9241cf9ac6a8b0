"""General-chat replay (icrl_core/replay.py): prompts, sampled replies, the KL positions, the objective, that
the replay term pulls a changed policy back to the base, and the bootstrap loop with replay (tiny model)."""

from __future__ import annotations

import shutil

import pytest
import torch

from icrl_core.chat import chat_prompt_ids
from icrl_core.checkpoint import list_checkpoints
from icrl_core.config import BootstrapConfig, LoraAdapter, ReplayConfig
from icrl_core.errors import UserError
from icrl_core.model import load_policy
from icrl_core.replay import (ReplaySequence, pad_replay, read_replay, replay_kl, replay_prompts, sample_replies,
                              write_replay)
from icrl_core.supervised import evaluate_replay, replay_micro_step, replay_objective, train_bootstrap
from tasks.runtime import LocalRuntime
from tests.stage_helpers import keyword_rows

TEXTS = [f"how do I do thing number {i}?" for i in range(40)]


def _lora_policy(seed=0):
    return load_policy("tiny", seed=seed, adapter=LoraAdapter(rank=4, alpha=8))


def test_replay_prompts_are_distinct_and_seeded():
    a = replay_prompts(TEXTS + TEXTS[:5], 10, seed=3)
    assert len(a) == len(set(a)) == 10 and set(a) <= set(TEXTS)
    assert a == replay_prompts(TEXTS, 10, seed=3)
    assert a != replay_prompts(TEXTS, 10, seed=4)
    with pytest.raises(UserError, match="40 distinct"):
        replay_prompts(TEXTS, 41, seed=0)


def test_pad_replay_marks_the_positions_that_predict_reply_tokens():
    batch = pad_replay([ReplaySequence([5, 6, 7, 8, 9], 3), ReplaySequence([1, 2, 3], 2)], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # reply tokens 8, 9 are predicted at positions 2, 3; reply token 3 at position 1
    assert batch.predict_at.tolist() == [[False, False, True, True, False], [False, True, False, False, False]]
    assert batch.n_tokens == 3 == sum(s.reply_tokens for s in [ReplaySequence([5, 6, 7, 8, 9], 3),
                                                               ReplaySequence([1, 2, 3], 2)])


def test_replay_objective_is_beta_times_token_mean_kl():
    kl = torch.tensor([0.2, 0.4, 0.9])
    assert float(replay_objective(kl, 0.5, n_tokens=6)) == pytest.approx(0.5 * 1.5 / 6)


def test_sampled_replies_are_the_chat_template_plus_a_seeded_reply(tiny):
    prompts = TEXTS[:5]
    chats = sample_replies(tiny, prompts, max_new_tokens=6, temperature=1.0, seed=11, batch_size=2)
    again = sample_replies(tiny, prompts, max_new_tokens=6, temperature=1.0, seed=11, batch_size=2)
    other = sample_replies(tiny, prompts, max_new_tokens=6, temperature=1.0, seed=12, batch_size=2)
    assert chats == again and chats != other
    eot = tiny.tokens.end_of_turn_id
    for prompt, chat in zip(prompts, chats):
        assert chat.input_ids[:chat.reply_start] == chat_prompt_ids(tiny.tokenizer, prompt)
        reply = chat.input_ids[chat.reply_start:]
        assert 1 <= len(reply) <= 6
        assert eot not in reply[:-1]  # a reply stops at its end of turn
        assert len(reply) == 6 or reply[-1] == eot
    assert "how do I do thing number 0?" in tiny.tokenizer.decode(chats[0].input_ids)


def test_replay_file_is_reused_only_with_the_same_key(tmp_path):
    chats = [ReplaySequence([1, 2, 3], 2), ReplaySequence([4, 5], 1)]
    write_replay(tmp_path / "replay.jsonl", chats, key="k1")
    assert read_replay(tmp_path / "replay.jsonl", "k1") == chats
    assert read_replay(tmp_path / "replay.jsonl", "k2") is None
    assert read_replay(tmp_path / "missing.jsonl", "k1") is None


def _perturbed_policy():
    policy = _lora_policy()
    with torch.no_grad():  # move off the zero-B init: the policy now differs from the base
        for p in policy.trainable_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return policy


def test_the_replay_term_pulls_the_policy_back_to_the_base(tiny):
    chats = sample_replies(tiny, TEXTS[:4], max_new_tokens=8, temperature=1.0, seed=0)
    policy = _perturbed_policy()
    batch = pad_replay(chats, policy.tokenizer.pad_token_id)
    optimizer = torch.optim.Adam(policy.trainable_parameters(), lr=3e-2)
    seen = []
    for _ in range(6):
        optimizer.zero_grad()
        seen.append(replay_micro_step(policy, batch, replay_beta=1.0, n_tokens=batch.n_tokens)["replay_kl"])
        optimizer.step()
    assert seen[0] > 0 and seen[-1] < 0.8 * seen[0], seen


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


def test_replay_kl_is_zero_for_the_base_and_positive_after_a_change(tiny):
    chats = sample_replies(tiny, TEXTS[:3], max_new_tokens=5, temperature=1.0, seed=0)
    batch = pad_replay(chats, tiny.tokenizer.pad_token_id)
    assert float(replay_kl(_lora_policy(), batch).detach().abs().max()) == pytest.approx(0.0, abs=1e-7)
    kl = replay_kl(_perturbed_policy(), batch)
    assert kl.shape == (batch.n_tokens,) and bool((kl > 0).all())


def test_bootstrap_stage_samples_replay_chats_once_and_reuses_them(tmp_path, monkeypatch):
    """tasks/bootstrap.replay_chats: training texts of the replay tasks become chats, cached outside the stage's
    output folder (which DVC deletes before the stage runs) under a key of what determines them; a rerun after
    the output folder is gone reuses them, training-only settings do not matter, changed settings sample again."""
    import shutil

    from tasks.settings import PipelineConfig, with_overrides
    from tasks.bootstrap import REPLAY_CACHE, replay_chats, replay_key
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

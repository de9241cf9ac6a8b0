"""General-chat replay (icrl_core/replay.py): prompts, sampled replies, the KL positions, the objective, and that
the replay term pulls a changed policy back to the base (tiny model). The bootstrap loop and stage with replay:
tests/integration/test_replay.py."""

from __future__ import annotations

import pytest
import torch

from icrl_core.chat import chat_prompt_ids
from icrl_core.config import LoraAdapter
from icrl_core.errors import UserError
from icrl_core.model import load_policy
from icrl_core.replay import (
    ReplaySequence,
    pad_replay,
    read_replay,
    replay_kl,
    replay_prompts,
    sample_replies,
    write_replay,
)
from icrl_core.supervised import replay_micro_step, replay_objective

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


def test_replay_kl_is_zero_for_the_base_and_positive_after_a_change(tiny):
    chats = sample_replies(tiny, TEXTS[:3], max_new_tokens=5, temperature=1.0, seed=0)
    batch = pad_replay(chats, tiny.tokenizer.pad_token_id)
    assert float(replay_kl(_lora_policy(), batch).detach().abs().max()) == pytest.approx(0.0, abs=1e-7)
    kl = replay_kl(_perturbed_policy(), batch)
    assert kl.shape == (batch.n_tokens,) and bool((kl > 0).all())

"""The critic's stages on the tiny model: build_dataset -> critic_data (trajectories sampled from the reference
policy into a Parquet file) -> critic (trained on packed contexts, measured on held-out prompts, saved, the HTML
view written) -> critic_distill (the Q-weighted policy distilled into the policy); the saved critic loads and
predicts as trained. The critic's parts on hand-made
examples: tests/unit/test_critic.py."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest
import torch

from tasks.settings import load_config, with_overrides
from tests.stage_helpers import stage_args


def test_critic_data_and_critic_stages_on_the_tiny_model(in_tmp):
    from icrl_core.adapter_format import is_adapter_folder
    from icrl_core.config import ModelConfig
    from icrl_core.critic import joint_bin_logits, load_critic, read_trajectory_groups
    from icrl_core.errors import UserError
    from tasks import build_dataset, critic, critic_data, critic_distill

    settings = ("critic.data={prompts: 6, val_prompts: 4, samples_per_prompt: 5, max_new_tokens: 4, batch_size: 10}",
                "critic.context_trajectories=3", "critic.supervise_from=2", "critic.max_steps=3",
                "critic.eval_steps=3", "critic.save_steps=2", "critic.batch_size=3", "critic.html_trajectories=2",
                "critic.q={eval_samples: 2, max_candidates: 3}")
    config = load_config(None, [a for a in stage_args(*settings) if a != "--set"], environ={})
    build_dataset.run(config)
    data_metrics = critic_data.run(config)
    table = pq.read_table(in_tmp / "artifacts" / "critic_data" / "trajectories.parquet").to_pylist()
    assert len(table) == data_metrics["trajectories"] == (6 + 4) * 5
    assert {r["split"] for r in table} == {"train", "val"}
    assert all(r["length"] == len(r["trajectory_ids"]) <= 4 and r["reward"] in (0.0, 1.0) for r in table)
    groups = read_trajectory_groups(in_tmp / "artifacts" / "critic_data" / "trajectories.parquet")
    assert [len(g.trajectories) for g in groups["train"]] == [5] * 6 and len(groups["val"]) == 4
    # the same seed samples the same trajectories
    again = critic_data.generate(config)[1]
    assert [r["trajectory_ids"] for r in again] == [r["trajectory_ids"] for r in table]

    metrics = critic.run(config)
    out = in_tmp / "artifacts" / "critic"
    history = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3]
    assert metrics["step"] == 3 and "val_loss" in metrics and metrics["selection_prompts"] == 4
    assert metrics["candidates_per_prompt"] == 5 - 2  # K - 1 = 2 trajectories are the context
    # Q-weighted sampling: 2 samples per held-out prompt against the first 2 plain candidates
    assert metrics["q_sampling_prompts"] == 4 and 0 <= metrics["q_weighted_reward"] <= 1
    assert 0 <= metrics["plain_sampling_reward"] <= 1 and 0 <= metrics["min_p_sampling_reward"] <= 1
    assert metrics["q_minus_plain"] == pytest.approx(metrics["q_weighted_reward"] - metrics["plain_sampling_reward"])
    assert metrics["q_minus_plain_low"] <= metrics["q_minus_plain"] <= metrics["q_minus_plain_high"]
    headline = json.loads((in_tmp / "metrics" / "critic.json").read_text())
    assert {"best_of_n_reward", "random_of_n_reward", "consistency_reward", "q_weighted_reward"} <= set(headline)
    page = (out / "q_view.html").read_text()
    assert page.count('<div class="trajectory">') == 2 and 'title="Q = ' in page
    assert not re.search(r"<script|<link|src=|https?://", page)
    # the saved critic is the trained one
    loaded, tokens = load_critic(out / "model", ModelConfig(spec="tiny"))
    meta = json.loads((out / "model" / "critic.json").read_text())
    assert meta["token_ids"] == list(tokens.ids) and meta["bins"]["reward_values"] == [0.0, 1.0]
    ids = torch.tensor([groups["val"][0].prompt_ids + groups["val"][0].trajectories[0].token_ids])
    at = torch.zeros_like(ids, dtype=torch.bool)
    at[0, -3:] = True
    logits = joint_bin_logits(loaded, tokens, ids, torch.ones_like(ids), at)
    assert logits.shape == (3, tokens.bins.size) and torch.isfinite(logits).all()
    assert not torch.allclose(torch.softmax(logits, -1), torch.full_like(logits, 1 / tokens.bins.size))  # trained

    # the trained critic's Q-weighted policy distilled into the policy
    distill = load_config(None, [a for a in stage_args(*settings, "critic_distill={max_steps: 2, batch_size: 2, "
                                                       "eval_steps: 2, save_steps: 2, eval_samples: 2}")
                                 if a != "--set"], environ={})
    result = critic_distill.run(distill)
    assert is_adapter_folder(in_tmp / "artifacts" / "critic_distill" / "adapter")
    assert result["method"] == "reverse_kl" and {"val_reward", "val_reward_before"} <= set(result)
    assert [h["step"] for h in json.loads((in_tmp / "artifacts" / "critic_distill" / "history.json").read_text())
            ] == [1, 2]
    # rejection fine-tuning needs successful trajectories: the random tiny model has none, a clear error says so
    if not any(r["reward"] for r in table if r["split"] == "train"):
        with pytest.raises(UserError, match="no trajectory succeeded"):
            critic_distill.run(with_overrides(distill, {"critic_distill.method": "rft"}))


# --------------------------------------------------------------------------------------------------------------
# critic_data on Ray workers; code tasks as the trajectory source

SMALL_DATA = "critic.data={prompts: 4, val_prompts: 2, samples_per_prompt: 3, max_new_tokens: 4, batch_size: 4}"


@pytest.fixture
def short_tmp(monkeypatch):
    """A fresh working directory with a short path (a local Ray's sockets live under <cwd>/.icrl/ray)."""
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="icrl-critic-", dir="/tmp"))
    monkeypatch.chdir(folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.integration
def test_two_ray_workers_write_the_same_trajectories_as_the_stage_process(short_tmp):
    """critic.data.workers=2: two real Ray tasks on a local Ray (never mocked) each load the tiny reference policy
    and generate every other batch (4 train prompts x 3 samples in batches of 4, then 2 val prompts: 5 batches);
    the file is the one the stage's own process writes."""
    import ray

    from tasks import build_dataset, critic_data

    config = load_config(None, [a for a in stage_args(SMALL_DATA) if a != "--set"], environ={})
    build_dataset.run(config)
    path = short_tmp / "artifacts" / "critic_data" / "trajectories.parquet"
    in_process = critic_data.run(config)
    expected = pq.read_table(path).to_pylist()
    path.unlink()
    try:
        on_ray = critic_data.run(with_overrides(config, {"critic.data.workers": 2}))
        assert ray.is_initialized()
    finally:
        ray.shutdown()
    assert pq.read_table(path).to_pylist() == expected and len(expected) == (4 + 2) * 3
    assert on_ray["workers"] == 2 and in_process["workers"] == 0
    assert {k: v for k, v in on_ray.items() if k not in ("seconds", "workers")} == {
        k: v for k, v in in_process.items() if k not in ("seconds", "workers")}


@pytest.mark.integration
def test_code_tasks_are_a_trajectory_source_rewarded_in_the_sandbox(in_tmp):
    """critic.data.source=code on the tiny model: train-split and held-out test-split code tasks, prompted as code
    RL prompts them, completions scored by the composed code reward of the real sandbox, gold empty; the critic
    stage trains on them with code reward bins, and skips the exact-match Q-sampling comparison (no gold)."""
    from icrl_core.code_config import CodeConfig
    from icrl_core.code_reward import extract_code, score
    from icrl_core.code_rl import CodeTaskSet, code_episode
    from icrl_core.critic import GenerationBatch
    from icrl_core.critic_code import code_rows
    from icrl_core.model import load_policy
    from icrl_core.rollout import EpisodeDialogue, Rollout
    from tasks import critic, critic_data

    code_bins = "critic.bins={reward_values: [0.0, 0.4, 0.8, 1.2, 2.0, 2.3], success_threshold: 1.5}"
    config = load_config(None, [a for a in stage_args(
        "critic.data={source: code, prompts: 2, val_prompts: 2, samples_per_prompt: 3, max_new_tokens: 12, "
        "batch_size: 6}", code_bins, "critic.context_trajectories=2", "critic.max_steps=1", "critic.eval_steps=1",
        "critic.save_steps=1", "critic.batch_size=2", "critic.q={eval_samples: 1, max_candidates: 2}",
        "code.sandbox.workers=2") if a != "--set"], environ={})
    task_set = CodeTaskSet.from_config(config.code)
    metrics = critic_data.run(config)  # no build_dataset: code tasks need no built episodes
    table = pq.read_table(in_tmp / "artifacts" / "critic_data" / "trajectories.parquet").to_pylist()
    assert len(table) == metrics["trajectories"] == (2 + 2) * 3
    tasks = {t.task_id: t for t in task_set.train + task_set.test}
    train_ids = {r["prompt_id"] for r in table if r["split"] == "train"}
    val_ids = {r["prompt_id"] for r in table if r["split"] == "val"}
    assert len(train_ids) == len(val_ids) == 2
    assert all(tasks[i].split == "train" for i in train_ids) and all(tasks[i].split == "test" for i in val_ids)
    tokenizer = load_policy("tiny", seed=0).tokens
    for row in table:
        task = tasks[row["prompt_id"]]
        prompt = tokenizer.decode(row["prompt_ids"])
        assert task.prompt in prompt and task_set.shot.reference.strip() in prompt and row["gold"] == ""
        assert row["length"] == len(row["trajectory_ids"]) <= 12
        # the reward is the composed code reward of the answer's program (the tiny model passes nothing)
        assert row["reward"] == score(extract_code(row["answer"], task), task, config.code).total == 0.0
    assert metrics["train_success_rate"] == 0.0 and metrics["train_max_reward"] == 0.0

    # a passing and a failing completion through the same scoring: the sandbox really runs them
    task = next(t for t in task_set.train if t.template == "add_constant")
    rollouts = []
    for text in ("```python\n" + task.reference + "```", f"```python\n{task.prompt}    return None\n```"):
        dialogue = EpisodeDialogue(code_episode(task, task_set.shot), tokenizer, 2048, 256)
        ids = [*tokenizer.encode(text), tokenizer.end_of_turn_id]
        dialogue.add_answer(ids, [0.0] * len(ids), 0)
        rollouts.append(Rollout(dialogue.episode, list(dialogue.conv.ids), dialogue.answers, 0))
    passing, failing = code_rows(GenerationBatch("train", 0, (task, task), (0, 1)), rollouts, CodeConfig())
    assert passing["success"] and 2.0 <= passing["reward"] <= 2.3 and passing["gold"] == ""
    assert not failing["success"] and failing["reward"] == 0.0 and failing["sample"] == 1

    result = critic.run(config)
    assert result["step"] == 1 and result["selection_prompts"] == 2 and "val_loss" in result
    assert result["q_sampling_prompts"] == 0 and "q_weighted_reward" not in result  # no gold: skipped

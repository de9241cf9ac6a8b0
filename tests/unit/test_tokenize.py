"""Tokenize: columns match the renderer, Parquet round trip, content hash, manifest, stats, and the stage."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from icrl_core.episodes import read_episodes, render_episode, write_episodes
from icrl_core.errors import UserError
from icrl_core.tokenized import (
    SCHEMA,
    content_hash,
    read_tokenized,
    tokenize_episodes,
    tokenized_path,
    tokenized_stats,
    tokenizer_identity,
    write_tokenized,
)
from tasks.settings import load_config
from tests.conftest import ROOT
from tests.stage_helpers import stage_args

EXAMPLES = ROOT / "examples" / "episodes.jsonl"


def test_rows_follow_the_renderer(tokens):
    episodes = read_episodes(EXAMPLES)
    rows, too_long = tokenize_episodes(episodes, "train", tokens, 2048)
    assert not too_long and len(rows) == len(episodes)
    for episode, row in zip(episodes, rows):
        rendered = render_episode(episode, tokens, 2048)
        assert row["input_ids"] == rendered.input_ids and row["loss_mask"] == rendered.loss_mask
        assert row["length"] == len(rendered.input_ids)
        for q, start, end, pref, rej in zip(rendered.queries, row["query_start"], row["query_end"],
                                            row["preferred_ids"], row["rejected_ids"]):
            assert (start, end) == (q.start, q.end)
            assert pref == row["input_ids"][start:end] and rej == list(q.rejected_ids)
            assert pref[-1] == rej[-1] == tokens.end_of_turn_id
            assert all(row["loss_mask"][start:end])


def test_episodes_over_budget_are_reported(tokens):
    _, too_long = tokenize_episodes(read_episodes(EXAMPLES), "train", tokens, 40)
    assert too_long and "does not fit 40 tokens" in too_long[0]


def test_parquet_round_trip_manifest_and_stale_files(tmp_path, tokens):
    episodes = read_episodes(EXAMPLES)
    rows, _ = tokenize_episodes(episodes[:2], "train", tokens, 2048)
    val, _ = tokenize_episodes(episodes[2:], "val", tokens, 2048)
    path = write_tokenized(tmp_path, "abc", rows + val, {"note": 1})
    assert pq.read_schema(path).equals(SCHEMA, check_metadata=False)
    assert tokenized_path(tmp_path) == path
    back = read_tokenized(tmp_path)
    assert [r.episode_id for r in back] == [e.episode_id for e in episodes]
    assert back[0].input_ids == rows[0]["input_ids"] and back[2].split == "val"
    assert [r.episode_id for r in read_tokenized(tmp_path, "val")] == [episodes[2].episode_id]
    pairs = back[2].pairs()  # arith-1 has two queries
    assert len(pairs) == 2 and pairs[1][0] == back[2].input_ids[:back[2].query_end[1]]
    newer = write_tokenized(tmp_path, "def", rows, {})
    assert sorted(p.name for p in tmp_path.glob("*.parquet")) == [newer.name]  # the manifest names the only one
    assert json.loads((tmp_path / "manifest.json").read_text())["file"] == "def.parquet"
    with pytest.raises(UserError, match="run the tokenize stage"):
        tokenized_path(tmp_path / "nowhere")


def test_content_hash_follows_files_tokenizer_and_settings(tmp_path, tokens):
    episodes = read_episodes(EXAMPLES)
    write_episodes(tmp_path / "train.jsonl", episodes)
    files = {"train": tmp_path / "train.jsonl"}
    tok_id = tokenizer_identity(tokens.tokenizer)
    first = content_hash(files, tok_id, {"episode_tokens": 2048})
    assert first == content_hash(files, tok_id, {"episode_tokens": 2048})
    assert first != content_hash(files, tok_id, {"episode_tokens": 1024})
    assert first != content_hash(files, "other-tokenizer", {"episode_tokens": 2048})
    write_episodes(tmp_path / "train.jsonl", episodes[:2])
    assert first != content_hash(files, tok_id, {"episode_tokens": 2048})


def test_stats_by_hand(tokens):
    rows, _ = tokenize_episodes(read_episodes(EXAMPLES), "train", tokens, 2048)
    stats = tokenized_stats(rows)
    assert stats["sequences"] == 3 and stats["queries"] == 4
    assert stats["tokens"] == sum(len(r["input_ids"]) for r in rows)
    assert stats["loss_tokens"] == sum(sum(r["loss_mask"]) for r in rows)
    assert stats["max_length"] == max(len(r["input_ids"]) for r in rows)
    assert stats["per_split"]["val"]["sequences"] == 0


def test_tokenize_stage_writes_hash_named_file(in_tmp):
    from tasks import build_dataset, tokenize

    config = load_config(None, [a for a in stage_args() if a != "--set"])
    build_dataset.run(config)
    first = tokenize.run(config)
    manifest = json.loads((in_tmp / "artifacts/tokenized/manifest.json").read_text())
    stats = json.loads((in_tmp / "artifacts/tokenized/stats.json").read_text())
    assert (in_tmp / "artifacts/tokenized" / manifest["file"]).exists()
    assert stats["sequences"] == first["sequences"] == 40
    first_row = read_tokenized(in_tmp / "artifacts/tokenized")[0]
    from icrl_core.chat import Tokens
    from icrl_core.tokenized import load_tokenizer

    text = Tokens(load_tokenizer("tiny")).decode(first_row.input_ids)
    assert "Input: I saw a" in text and "Label:" in text  # keyword_map's own template
    assert json.loads((in_tmp / "metrics/tokenize.json").read_text())["sequences"] == 40
    # same inputs -> same name; another budget -> another name
    tokenize.run(config)
    assert json.loads((in_tmp / "artifacts/tokenized/manifest.json").read_text())["file"] == manifest["file"]
    config2 = load_config(None, [a for a in stage_args("data.episode_tokens=600") if a != "--set"])
    tokenize.run(config2)
    assert json.loads((in_tmp / "artifacts/tokenized/manifest.json").read_text())["file"] != manifest["file"]
    # labels only (no end-of-turn in the loss): another name, one trained token fewer per answer
    config3 = load_config(None, [a for a in stage_args("tokenize.train_end_of_turn=false") if a != "--set"])
    third = tokenize.run(config3)
    assert json.loads((in_tmp / "artifacts/tokenized/manifest.json").read_text())["file"] != manifest["file"]
    rows = read_tokenized(in_tmp / "artifacts/tokenized")
    assert rows[0].input_ids == first_row.input_ids
    assert sum(rows[0].loss_mask) < sum(first_row.loss_mask)
    assert third["loss_tokens"] < first["loss_tokens"]


def test_a_fresh_process_renders_synthetic_tasks_with_their_template():
    """template_for('keyword_map') depends on icrl_core.task_data having registered it: the tokenize stage must
    not fall back to the generic template (no 'Input:'/'Label:') in a process that never built a dataset."""
    import subprocess
    import sys

    code = ("import icrl_core.tokenized\nfrom icrl_core.prompting import template_for\n"
            "print(template_for('keyword_map').answer_prefix)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "Label:"

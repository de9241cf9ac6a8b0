"""Dataset build: determinism, episodic randomization, support exemplars, label permutation, feedback style,
split, mixing, file sources, token budget, model-chosen rejected answers. A bad episode file through
`icrl stage build_dataset` (exit 2, nothing written): tests/integration/test_dataset_build.py."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from icrl_core.config import FileSource, SyntheticSource, TaskSource
from icrl_core.dataset_build import (
    allocate,
    apply_budget,
    build_episodes,
    dataset_card,
    label_log_likelihoods,
    model_rejected_answers,
    policy_predictor,
    resolve_sources,
    split_of,
    support_key,
)
from icrl_core.episodes import read_episodes, render_episode
from icrl_core.errors import EpisodeFileError, UserError
from icrl_core.task_data import keyword_map, load_task
from tasks.settings import load_config
from tests.conftest import ROOT
from tests.stage_helpers import keyword_data, stage_args


def _build(seed=0, **overrides):
    data = keyword_data(**overrides)
    return build_episodes(resolve_sources(data, seed), data, seed), data


def _keyword(text: str) -> str:
    return text.split()[3]


def test_build_is_deterministic_and_seeded():
    a, _ = _build(seed=1)
    b, _ = _build(seed=1)
    c, _ = _build(seed=2)
    assert [x.episode for x in a] == [x.episode for x in b]
    assert [x.episode for x in a] != [x.episode for x in c]
    # an episode does not depend on how many others are built
    more, _ = _build(seed=1, num_episodes=40)
    assert [x.episode for x in more[:24]] == [x.episode for x in a]


def test_k_and_n_are_drawn_within_ranges():
    built, _ = _build(num_episodes=200, k_exemplars_min=1, k_exemplars=5, n_queries_min=1, n_queries=3)
    ks = Counter(len(x.episode.exemplars) for x in built)
    ns = Counter(len(x.episode.queries) for x in built)
    assert set(ks) == {1, 2, 3, 4, 5} and set(ns) == {1, 2, 3}
    fixed, _ = _build(num_episodes=20, k_exemplars=4, n_queries=2)
    assert {len(x.episode.exemplars) for x in fixed} == {4} and {len(x.episode.queries) for x in fixed} == {2}


def test_support_exemplars_put_the_answer_in_context():
    task = keyword_map(seed=0)
    mapping = {_keyword(e.text): e.label for e in task.train}
    always, _ = _build(num_episodes=60, query_support=1.0, k_exemplars=3, n_queries=2)
    for item in always:
        keywords = {_keyword(ex.prompt) for ex in item.episode.exemplars}
        for query in item.episode.queries:
            assert _keyword(query.prompt) in keywords
            assert query.preferred_answer == mapping[_keyword(query.prompt)]  # gold labels
            assert query.rejected_answer != query.preferred_answer and query.rejected_answer in task.labels
    never, _ = _build(num_episodes=60, query_support=0.0, k_exemplars=3)
    hits = sum(_keyword(i.episode.queries[0].prompt) in {_keyword(e.prompt) for e in i.episode.exemplars}
               for i in never)
    assert hits < 40  # only chance co-occurrences (12 keywords, 3 exemplars)
    assert support_key("banking77")(task.train[0]) == task.train[0].label


def test_hard_negatives_are_wrong_labels_the_context_shows(tokens):
    built, data = _build(num_episodes=60, hard_negatives=1.0, k_exemplars=3)
    for item in built:
        shown = {ex.answer for ex in item.episode.exemplars}
        for q in item.episode.queries:
            assert q.rejected_answer != q.preferred_answer
            if shown - {q.preferred_answer}:
                assert q.rejected_answer in shown
    card = dataset_card(apply_budget(built, tokens, 2048), data, 0, "tiny")
    plain, plain_data = _build(num_episodes=60, k_exemplars=3, hard_negatives=0.0)
    assert card["rejected_in_context_share"] > 0.9
    assert dataset_card(apply_budget(plain, tokens, 2048), plain_data, 0, "tiny")["rejected_in_context_share"] < 0.7


def test_permuted_labels_are_consistent_within_an_episode_and_differ_across():
    built, _ = _build(num_episodes=40, permute_labels=True, query_support=1.0, k_exemplars=4)
    task = keyword_map(seed=0)
    maps = []
    for item in built:
        mapping = {}
        for text, answer in [(e.prompt, e.answer) for e in item.episode.exemplars] + \
                            [(q.prompt, q.preferred_answer) for q in item.episode.queries]:
            assert mapping.setdefault(_keyword(text), answer) == answer and answer in task.labels
        maps.append(tuple(sorted(mapping.items())))
    gold = {_keyword(e.text): e.label for e in task.train}
    assert any(any(gold[k] != v for k, v in m) for m in maps)


def test_few_way_episodes_use_a_label_subset_and_skew_the_context(tasks_dir):
    from icrl_core.config import DataConfig

    def build(**overrides):
        data = DataConfig(tasks_dir=tasks_dir, sources=[TaskSource(name="banking77")], num_episodes=60,
                          k_exemplars=24, n_queries=2, query_support=0.0, **overrides)
        return build_episodes(resolve_sources(data, 0), data, 0)

    few = build(labels_per_episode=6, labels_per_episode_min=3)
    sizes = Counter()
    for item in few:
        episode = item.episode
        labels = {ex.answer for ex in episode.exemplars} | {q.preferred_answer for q in episode.queries}
        assert len(labels) <= 6
        for q in episode.queries:  # rejected answers come from the episode's own labels
            assert q.rejected_answer != q.preferred_answer
        sizes[len(labels)] += 1
    assert min(sizes) >= 2 and max(sizes) <= 6 and len(sizes) >= 3

    def majority_share(built):
        shares = [Counter(ex.answer for ex in item.episode.exemplars).most_common(1)[0][1] / 24 for item in built]
        return sum(shares) / len(shares)

    skewed, even = build(labels_per_episode=6, label_skew=0.3), build(labels_per_episode=6)
    assert majority_share(skewed) > majority_share(even) + 0.15  # a few labels dominate skewed contexts
    assert build(labels_per_episode=6) == even  # still deterministic


def test_feedback_exemplars_carry_rewards():
    built, _ = _build(num_episodes=150, exemplar_style="feedback", feedback_accuracy=0.7, k_exemplars=4)
    gold = {_keyword(e.text): e.label for e in keyword_map(seed=0).train}
    rewards = []
    for item in built:
        for ex in item.episode.exemplars:
            assert ex.reward in (0.0, 1.0)
            assert (ex.answer == gold[_keyword(ex.prompt)]) == (ex.reward == 1.0)
            rewards.append(ex.reward)
    assert 0.6 < sum(rewards) / len(rewards) < 0.8


def test_collapsed_history_episodes_repeat_one_label_and_leave_other_builds_unchanged():
    plain, _ = _build(num_episodes=60, exemplar_style="feedback", feedback_accuracy=0.7, k_exemplars=6)
    off, _ = _build(num_episodes=60, exemplar_style="feedback", feedback_accuracy=0.7, k_exemplars=6,
                    collapsed_history=0.0)
    assert [b.episode for b in off] == [b.episode for b in plain]
    built, _ = _build(num_episodes=200, exemplar_style="feedback", feedback_accuracy=0.7, k_exemplars=6,
                      collapsed_history=0.5)
    gold = {_keyword(e.text): e.label for e in keyword_map(seed=0).train}
    collapsed = [b.episode for b in built if "collapsed_label" in b.episode.metadata]
    assert 0.35 < len(collapsed) / len(built) < 0.65
    for episode in collapsed:
        label = episode.metadata["collapsed_label"]
        assert {ex.answer for ex in episode.exemplars} == {label}
        assert all(ex.reward == float(gold[_keyword(ex.prompt)] == label) for ex in episode.exemplars)
        assert all(q.preferred_answer == gold[_keyword(q.prompt)] for q in episode.queries)
    # the other episodes still follow feedback_accuracy
    rewards = [ex.reward for b in built if "collapsed_label" not in b.episode.metadata for ex in b.episode.exemplars]
    assert 0.6 < sum(rewards) / len(rewards) < 0.8


def test_feedback_episode_renders_like_the_icrl_harness(tokens):
    built, _ = _build(num_episodes=5, exemplar_style="feedback", feedback_accuracy=0.5, k_exemplars=4)
    episode = built[0].episode
    text = tokens.decode(render_episode(episode, tokens, 2048).input_ids)
    assert "Feedback will indicate if you answered correctly" in text  # the ICRL system prompt
    for ex in episode.exemplars:
        feedback = (f"'{ex.answer}' is the correct answer! Good job!" if ex.reward else
                    f"The answer '{ex.answer}' is wrong! You can do better!")
        assert feedback in text


def test_split_is_stable_by_id_and_val_queries_come_from_test_examples(tasks_dir):
    assert split_of("keyword_map-0-000001", 0.3) == split_of("keyword_map-0-000001", 0.3)
    splits = Counter(split_of(f"x-{i}", 0.25) for i in range(2000))
    assert 0.2 < splits["val"] / 2000 < 0.3
    task = load_task("banking77", tasks_dir)
    test_texts, train_texts = {e.text for e in task.test}, {e.text for e in task.train}
    data = keyword_data(sources=[TaskSource(name="banking77")], num_episodes=30, val_fraction=0.3)
    built = build_episodes(resolve_sources(data, 0), data, 0)
    assert {b.split for b in built} == {"train", "val"}
    for item in built:
        pool = test_texts if item.split == "val" else train_texts
        assert all(q.prompt in pool for q in item.episode.queries)
        assert all(e.prompt in pool for e in item.episode.exemplars)
        assert item.episode.task_type == "banking77"


def test_sources_are_mixed_by_weight(tmp_path):
    assert allocate([3, 1], 10) == [8, 2] and allocate([1, 1, 1], 10) == [4, 3, 3] and sum(allocate([0.3], 7)) == 7
    file_path = ROOT / "examples" / "episodes.jsonl"
    data = keyword_data(sources=[SyntheticSource(name="keyword_map", weight=3),
                                 SyntheticSource(name="modular_sum", weight=1),
                                 FileSource(path=file_path, weight=1)], num_episodes=20)
    built = build_episodes(resolve_sources(data, 0), data, 0)
    counts = Counter(b.source for b in built)
    assert counts["synthetic:keyword_map"] == 12 and counts["synthetic:modular_sum"] == 4
    assert counts[f"file:{file_path}"] == 3  # asked for 4, the file holds 3
    file_ids = {e.episode_id for e in read_episodes(file_path)}
    assert {b.episode.episode_id for b in built if b.source.startswith("file:")} == file_ids


def test_bad_inputs_raise_before_building(tmp_path):
    bad = ROOT / "tests" / "data" / "bad_episodes" / "several_bad.jsonl"
    with pytest.raises(EpisodeFileError):
        resolve_sources(keyword_data(sources=[FileSource(path=bad)]), 0)
    with pytest.raises(UserError, match="not a synthetic task"):
        resolve_sources(keyword_data(sources=[SyntheticSource(name="banking77")]), 0)
    with pytest.raises(UserError, match="at least one exemplar"):
        _build(k_exemplars=0)


def test_budget_shaves_from_the_front_and_the_card_counts_it(tokens):
    built, data = _build(num_episodes=12, k_exemplars=8, n_queries=1)
    full = apply_budget(built, tokens, 2048)
    assert not full.shaved
    longest = max(full.tokens.values())
    tight = apply_budget(built, tokens, longest - 30)
    assert tight.shaved and not tight.too_long
    for item in tight.kept:
        original = next(b.episode for b in built if b.episode.episode_id == item.episode.episode_id)
        dropped = len(original.exemplars) - len(item.episode.exemplars)
        assert item.episode.exemplars == original.exemplars[dropped:]  # dropped from the front
        assert (dropped > 0) == (item.episode.episode_id in tight.shaved)
        assert len(render_episode(item.episode, tokens, 10**6).input_ids) == tight.tokens[item.episode.episode_id]
    card = dataset_card(tight, data, 0, "tiny")
    assert card["shaved_episodes"] == len(tight.shaved) and card["episodes"] == 12
    assert sum(card["k_histogram"].values()) == 12
    assert sum(card["label_balance"]["preferred"].values()) == card["queries"] == 12
    assert apply_budget(built, tokens, 40).too_long  # not even the query fits


def test_label_log_likelihood_with_cache_equals_full_recompute(tiny, tokens):
    built, _ = _build(num_episodes=3)
    rendered = render_episode(built[0].episode, tokens, 2048)
    prompt = rendered.input_ids[:rendered.queries[0].start]
    candidates = [tokens.encode(" zorp") + (tokens.end_of_turn_id,), tokens.encode(" a") + (tokens.end_of_turn_id,)]
    fast = label_log_likelihoods(tiny, prompt, candidates)
    for score, cand in zip(fast, candidates):
        ids = torch.tensor([prompt + list(cand)])
        with torch.no_grad():
            logp = torch.log_softmax(tiny.causal_lm(input_ids=ids).logits[0].float(), -1)
        expected = sum(logp[len(prompt) - 1 + j, tok] for j, tok in enumerate(cand))
        assert float(score) == pytest.approx(float(expected), abs=1e-4)


def test_model_rejected_uses_the_models_wrong_predictions(tiny):
    data = keyword_data(num_episodes=12)
    sources = resolve_sources(data, 0)
    built = build_episodes(sources, data, 0)
    predict = policy_predictor(tiny)
    out, stats = model_rejected_answers(built, sources, predict)
    assert stats["model_wrong"] + stats.get("model_right", 0) == 12
    for before, after in zip(built, out):
        predicted = predict(before.episode, sources[0].labels)[0]
        q_before, q_after = before.episode.queries[0], after.episode.queries[0]
        assert q_after.preferred_answer == q_before.preferred_answer
        expected = predicted if predicted != q_before.preferred_answer else q_before.rejected_answer
        assert q_after.rejected_answer == expected


def test_build_stage_writes_splits_card_and_samples(in_tmp):
    from tasks import build_dataset

    config = load_config(None, [a for a in stage_args() if a != "--set"])
    metrics = build_dataset.run(config)
    out = in_tmp / "artifacts" / "dataset"
    train, val = read_episodes(out / "train.jsonl"), read_episodes(out / "val.jsonl")
    assert len(train) + len(val) == metrics["episodes"] == 40
    assert all(split_of(e.episode_id, 0.1) == "val" for e in val)
    card = json.loads((out / "card.json").read_text())
    assert card["per_source"] == {"synthetic:keyword_map": 40} and card["splits"]["val"] == len(val)
    assert "# Dataset card" in (out / "card.md").read_text()
    assert "[[ " in (out / "samples.md").read_text()
    headline = json.loads((in_tmp / "metrics" / "build_dataset.json").read_text())
    assert headline == {"train_episodes": len(train), "val_episodes": len(val)}

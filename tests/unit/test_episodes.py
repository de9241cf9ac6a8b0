from __future__ import annotations

import json

import pytest

from icrl_core.episodes import Episode, read_episodes, render_episode, render_episodes, write_episodes
from icrl_core.errors import EpisodeFileError, EpisodeTooLongError
from icrl_core.prompting import template_for
from tests.conftest import ROOT

BAD = ROOT / "tests" / "data" / "bad_episodes"
EXPECTED = json.loads((BAD / "expected.json").read_text())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_malformed_corpus_reports_every_bad_line(name):
    path = BAD / name
    with pytest.raises(EpisodeFileError) as info:
        read_episodes(path)
    problems = info.value.problems
    for line, reason in EXPECTED[name].items():
        hits = [p for p in problems if p.startswith(f"{path}:{line}: ")]
        assert any(reason in p for p in hits), (line, reason, problems)
    reported_lines = {p[len(str(path)) + 1:].split(":", 1)[0] for p in problems}
    assert reported_lines == set(EXPECTED[name]), problems


def test_write_then_read_round_trip(tmp_path):
    episodes = read_episodes(ROOT / "examples" / "episodes.jsonl")
    out = tmp_path / "copy.jsonl"
    assert write_episodes(out, episodes) == 3
    assert read_episodes(out) == episodes
    assert not list(tmp_path.glob(".*tmp"))  # atomic write leaves no temp file


def _episode(n_exemplars=3, **kw) -> Episode:
    return Episode.model_validate({
        "episode_id": kw.get("episode_id", "e"),
        "task_type": "banking77",
        "exemplars": [{"prompt": f"my card number {i} is lost", "answer": "lost or stolen card",
                       **({"reward": kw["reward"]} if "reward" in kw else {})} for i in range(n_exemplars)],
        "queries": [{"prompt": "where is my card", "preferred_answer": "card arrival",
                     "rejected_answer": "card linking"}],
    })


def test_render_mask_covers_exactly_the_answers(tokens):
    episode = _episode(2)
    rendered = render_episode(episode, tokens, 2048)
    masked = [t for t, m in zip(rendered.input_ids, rendered.loss_mask) if m]
    eot = tokens.end_of_turn_id
    expected = []
    for answer in ["lost or stolen card", "lost or stolen card", "card arrival"]:
        expected += list(tokens.encode(" " + answer)) + [eot]
    assert masked == expected
    span = rendered.queries[0]
    assert tokens.decode(rendered.input_ids[span.start:span.end]) == " card arrival<|im_end|>"
    assert tokens.decode(span.rejected_ids) == " card linking<|im_end|>"
    assert tokens.decode(rendered.input_ids[:span.start]).endswith("<|im_start|>assistant\nIntent:")


def test_end_of_turn_can_be_left_out_of_the_loss(tokens):
    """train_end_of_turn=False: same ids and spans, the mask loses exactly the end-of-turn after each answer."""
    episode = _episode(2)
    full = render_episode(episode, tokens, 2048)
    labels_only = render_episode(episode, tokens, 2048, train_end_of_turn=False)
    assert labels_only.input_ids == full.input_ids and labels_only.queries == full.queries
    dropped = [i for i, (a, b) in enumerate(zip(full.loss_mask, labels_only.loss_mask)) if a != b]
    assert len(dropped) == 3 and all(full.input_ids[i] == tokens.end_of_turn_id for i in dropped)
    assert all(b <= a for a, b in zip(full.loss_mask, labels_only.loss_mask))
    masked = tokens.decode([t for t, m in zip(labels_only.input_ids, labels_only.loss_mask) if m])
    assert masked == " lost or stolen card lost or stolen card card arrival"


def test_rendering_matches_the_chat_template(tokens):
    """Piecewise ids equal the tokenizer's own chat template applied to the same messages."""
    episode = _episode(2)
    template = template_for("banking77")
    rendered = render_episode(episode, tokens, 2048)
    messages = [{"role": "system", "content": template.system(False)}]
    for ex in episode.exemplars:
        messages += [{"role": "user", "content": f"Query: {ex.prompt}"},
                     {"role": "assistant", "content": f"Intent: {ex.answer}"}]
    messages += [{"role": "user", "content": "Query: where is my card"},
                 {"role": "assistant", "content": "Intent: card arrival"}]
    reference = tokens.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert rendered.input_ids == list(reference)


def test_feedback_exemplars_render_feedback_and_never_train_on_wrong_attempts(tokens):
    episode = Episode.model_validate({
        "episode_id": "fb", "task_type": "banking77",
        "exemplars": [{"prompt": "a", "answer": "card arrival", "reward": 0.0},
                      {"prompt": "b", "answer": "card linking", "reward": 1.0}],
        "queries": [{"prompt": "c", "preferred_answer": "card arrival", "rejected_answer": "card linking"}]})
    rendered = render_episode(episode, tokens, 2048)
    text = tokens.decode(rendered.input_ids)
    assert "The answer 'card arrival' is wrong! You can do better!\n\nQuery: b" in text
    assert "'card linking' is the correct answer! Good job!\n\nQuery: c" in text
    assert "Feedback will indicate" in text
    masked = tokens.decode([t for t, m in zip(rendered.input_ids, rendered.loss_mask) if m])
    assert masked == " card linking<|im_end|> card arrival<|im_end|>"


def test_long_episode_is_shaved_from_the_front(tokens):
    episode = _episode(40)
    full = render_episode(episode, tokens, 100_000)
    budget = len(full.input_ids) - 30
    shaved = render_episode(episode, tokens, budget)
    assert shaved.shaved and shaved.exemplars_dropped >= 1
    assert len(shaved.input_ids) <= budget
    # the kept exemplars are the last ones; one more would not fit
    assert render_episode(episode.model_copy(update={"exemplars": episode.exemplars[shaved.exemplars_dropped - 1:]}),
                          tokens, 100_000).longest_sequence() > budget
    report = render_episodes([episode, _episode(1, episode_id="small")], tokens, budget)
    assert report.shaved == 1 and not report.too_long


def test_episode_whose_queries_cannot_fit_is_named(tokens):
    with pytest.raises(EpisodeTooLongError, match="episode 'e' does not fit 32 tokens even without exemplars"):
        render_episode(_episode(3), tokens, 32)

"""The in-context RL protocol: strategies, rendering, cap, constrained decoding, reuse == recompute (tiny model).
Reuse == recompute on the real SmolLM2: tests/integration/test_icrl_eval.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from icrl_core.config import EvalConfig, EvaluateConfig
from icrl_core.episodes import Episode, Exemplar, Query, render_episode
from icrl_core.errors import UserError
from icrl_core.icrl_eval import (
    Approximate,
    EpisodeRecord,
    Explorative,
    Naive,
    NaivePlus,
    Predictor,
    Show,
    StepEvent,
    SupervisedICL,
    behaviour,
    decode_rng,
    evaluation_steps,
    flip_draw,
    is_supervised,
    make_strategy,
    max_context_examples,
    needed_nodes,
    render_context,
    render_query,
    repeat_rates,
    run_protocol,
    sample_child,
    show_for,
    summarize,
)
from icrl_core.kernels import LabelTrie, PrefixCache
from icrl_core.prompting import template_for
from icrl_core.task_data import keyword_map, load_task


def _history(feedbacks):
    return [EpisodeRecord(i, f"q{i}", "a", "a" if f else "b", f, f) for i, f in enumerate(feedbacks)]


# ---------------------------------------------------------------------------------------------------------------
# Strategies


def test_naive_and_naive_plus_keep_the_most_recent():
    history = _history([1, 0, 1, 1, 0, 1])
    assert Naive(max_examples=3, seed=0).select(history, 6) == [3, 4, 5]
    assert NaivePlus(max_examples=3, seed=0).select(history, 6) == [2, 3, 5]
    assert Naive(max_examples=0, seed=0).select(history, 6) == []


def test_naive_with_p_keep_below_1_follows_the_papers_random_biased_end():
    history = _history([1, 0] * 30)
    # The paper: rng(seed+step); binomial per episode (per positive one for _only_positive); the last
    # max_examples of the kept, in time order.
    rng = np.random.default_rng(107)
    kept = np.flatnonzero(rng.binomial(1, 0.5, size=60) == 1)
    assert Naive(max_examples=5, seed=100, p_keep=0.5).select(history, 7) == [int(i) for i in kept[-5:]]
    positives = list(range(0, 60, 2))
    rng = np.random.default_rng(107)
    kept = [positives[i] for i in np.flatnonzero(rng.binomial(1, 0.5, size=30) == 1)]
    assert NaivePlus(max_examples=5, seed=100, p_keep=0.5).select(history, 7) == kept[-5:]
    assert Naive(max_examples=5, seed=100, p_keep=1.0).select(history, 7) == list(range(55, 60))


def test_the_papers_strategy_names_and_p_keep_per_strategy():
    paper = {"random_biased_end": (Naive, "naive"), "random_biased_end_only_positive": (NaivePlus, "naive_plus"),
             "random_unbiased_only_positive": (Explorative, "explorative"),
             "approximate_only_positive": (Approximate, "approximate"), "random_unbiased": (SupervisedICL, "icl")}
    for name, (kind, ours) in paper.items():
        cfg = EvalConfig(strategy=name, p_keep={name: 0.25})
        assert cfg.strategy == ours and cfg.p_keep_of(ours) == 0.25
        strategy = make_strategy(cfg, 10)
        assert type(strategy) is kind and strategy.p_keep == 0.25
    evaluate = EvaluateConfig(strategies=["random_biased_end"], temperatures={"random_unbiased_only_positive": 2})
    assert evaluate.strategies == ["naive"] and evaluate.temperatures == {"explorative": 2.0}
    # defaults: the paper's 0.1 for explorative and approximate, every episode for naive and ICL
    cfg = EvalConfig()
    assert [cfg.p_keep_of(s) for s in ("explorative", "approximate", "naive", "naive_plus", "icl")] == [
        0.1, 0.1, 1.0, 1.0, 1.0]
    assert EvalConfig(p_keep={"naive": 0.5}).p_keep_of("explorative") == 0.1  # unlisted: the paper's value
    # one number (the form before p_keep was per strategy): the strategies that sample by default
    cfg = EvalConfig(p_keep=0.3)
    assert cfg.p_keep_of("explorative") == cfg.p_keep_of("approximate") == 0.3 and cfg.p_keep_of("naive") == 1.0
    assert make_strategy(EvalConfig(strategy="icl", p_keep={"icl": 0.5}), 10).p_keep == 0.5
    for bad in ({"strategy": "random_biased_start"}, {"p_keep": {"naive": 0}}, {"p_keep": {"bogus": 0.5}}):
        with pytest.raises(ValidationError):
            EvalConfig(**bad)


def test_explorative_follows_the_papers_draws():
    history = _history([1, 0] * 30)
    strategy = Explorative(max_examples=5, seed=100, p_keep=0.5)
    chosen = strategy.select(history, 7)
    # The paper: rng(seed+step); binomial per positive; permutation of the kept; first max_examples; sorted.
    rng = np.random.default_rng(107)
    positives = [i for i in range(60) if i % 2 == 0]
    kept = np.flatnonzero(rng.binomial(1, 0.5, size=len(positives)) == 1)
    expected = [positives[i] for i in np.sort(rng.permutation(kept)[:5])]
    assert chosen == expected and len(chosen) == 5 and all(history[i].feedback == 1 for i in chosen)
    assert strategy.select(history, 7) == chosen           # seeded per step
    assert strategy.select(history, 8) != chosen


def test_supervised_icl_is_a_random_subset_of_all_episodes():
    history = [EpisodeRecord(i, f"q{i}", "a", None, None, None) for i in range(50)]
    chosen = SupervisedICL(max_examples=10, seed=0, supervised=True).select(history, 50)
    assert len(chosen) == 10 and chosen == sorted(chosen) and len(set(chosen)) == 10
    assert SupervisedICL(max_examples=100, seed=0, supervised=True).select(history, 50) == list(range(50))


def test_approximate_contexts_grow_and_track_their_probability():
    strategy = Approximate(max_examples=3, seed=1, p_keep=0.5, max_contexts=4)
    history: list[EpisodeRecord] = []
    for step, feedback in enumerate([1, 1, 0, 1, 1, 1, 1, 1, 1, 1]):
        context = strategy.select(history, step)
        assert context == strategy.contexts[strategy.chosen]
        history.append(EpisodeRecord(step, f"q{step}", "a", "a", feedback, feedback))
    for context, logp in zip(strategy.contexts, strategy.log_probs):
        assert len(context) <= 3 and context == sorted(context) and 2 not in context  # the negative never joins
        assert len(set(context)) == len(context)
        # each offer to a non-full context adds log p (joined) or log(1-p) (not joined)
        assert logp <= len(context) * math.log(0.5) + 1e-9
    with pytest.raises(RuntimeError):
        strategy.select(history + history, len(history) * 2)


def test_approximate_likelihood_sampling_prefers_probable_contexts():
    strategy = Approximate(max_examples=50, seed=0, p_keep=0.9, max_contexts=2, sampling="likelihood")
    strategy.log_probs = [0.0, -50.0]
    rng = np.random.default_rng(0)
    assert all(strategy._choose(rng) == 0 for _ in range(20))


def test_make_strategy_and_supervision():
    assert is_supervised(EvalConfig(strategy="icl"))
    assert not is_supervised(EvalConfig(strategy="naive"))
    assert is_supervised(EvalConfig(strategy="naive", icrl=False))
    with pytest.raises(UserError, match="supervised"):
        is_supervised(EvalConfig(strategy="icl", icrl=True))
    assert isinstance(make_strategy(EvalConfig(strategy="approximate", max_contexts=3), 10), Approximate)
    assert show_for(EvalConfig(strategy="naive", omit_feedback=True)) == Show(True, "prediction", False)
    assert show_for(EvalConfig(strategy="zero_shot")).system_with_feedback is False


def test_naive_block_eviction_keeps_a_growing_prefix_between_evictions():
    history = _history([1] * 20)
    sliding, block = Naive(max_examples=5, seed=0), Naive(max_examples=5, seed=0, evict=3)
    assert [sliding.select(history[:t], t) for t in range(7, 9)] == [[2, 3, 4, 5, 6], [3, 4, 5, 6, 7]]
    sizes = [len(block.select(history[:t], t)) for t in range(13)]
    assert sizes == [0, 1, 2, 3, 4, 5, 3, 4, 5, 3, 4, 5, 3]
    # between evictions each context extends the previous one (the cache is reused); every context is recent
    assert block.select(history[:8], 8)[:-1] == block.select(history[:7], 7)
    assert block.select(history[:12], 12) == [9, 10, 11]


def test_evaluation_steps_follow_the_paper_and_include_the_end():
    assert evaluation_steps(1000, 250) == [0, 249, 499, 749, 999]
    assert evaluation_steps(10, 4) == [0, 3, 7, 9]
    assert evaluation_steps(1, 50) == [0]


def test_flip_draw_is_the_papers_float():
    assert flip_draw(100, 5) == np.random.default_rng(105).random()


# ---------------------------------------------------------------------------------------------------------------
# Rendering


@pytest.mark.parametrize("icrl", [True, False])
def test_rendering_matches_training_episodes(tokens, icrl):
    """Evaluation prompts are token-for-token the training episodes' prompts (icrl_core.episodes)."""
    past = [("where is my card?", "card arrival", 1), ("my card was eaten", "card swallowed", 0)]
    exemplars = [Exemplar(prompt=p, answer=a, reward=float(r) if icrl else None) for p, a, r in past]
    episode = Episode(episode_id="e", task_type="banking77", exemplars=exemplars,
                      queries=[Query(prompt="new pin", preferred_answer="change pin", rejected_answer="age limit")])
    rendered = render_episode(episode, tokens, 4096)
    template = template_for("banking77")
    show = Show(True, "prediction", True) if icrl else Show(False, "gold", False)
    records = [EpisodeRecord(i, p, a, a if icrl else None, r if icrl else None, r if icrl else None)
               for i, (p, a, r) in enumerate(past)]
    context, user_open = render_context(tokens, template, records, show)
    assert user_open is icrl
    prompt = context + render_query(tokens, template, "new pin", user_open)
    assert prompt == rendered.input_ids[:rendered.queries[0].start]
    text = tokens.decode(prompt)
    assert text.endswith("<|im_start|>assistant\nIntent:")
    if icrl:
        assert "'card arrival' is the correct answer! Good job!\n\nQuery: my card was eaten" in text
        assert "The answer 'card swallowed' is wrong! You can do better!\n\nQuery: new pin" in text
    else:
        assert "Feedback" not in text and "correct answer" not in text


def test_max_context_examples_fits_exactly(tokens, tasks_dir):
    task = load_task("trec_coarse", tasks_dir)
    show = Show(True, "prediction", True)
    n = max_context_examples(task, tokens, show, 2048)
    assert 5 < n < 100
    assert max_context_examples(task, tokens, show, 4096) > n
    assert max_context_examples(task, tokens, Show(False, "gold", False), 2048) > n  # no feedback turns
    with pytest.raises(UserError, match="does not fit"):
        max_context_examples(task, tokens, show, 64)


# ---------------------------------------------------------------------------------------------------------------
# Constrained decoding and the protocol


def test_sample_child():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 3.0, 1.0])
    assert sample_child(logits, 0.0, rng) == 1
    draws = [sample_child(logits, 1.0, rng) for _ in range(4000)]
    p = np.exp(logits) / np.exp(logits).sum()
    assert np.allclose(np.bincount(draws, minlength=3) / 4000, p, atol=0.03)


def test_needed_nodes_skip_chains_that_never_branch():
    trie = LabelTrie.build([(5, 2), (6, 2), (7, 2)])      # single-token labels: only the root branches
    assert needed_nodes(trie) == []
    trie = LabelTrie.build([(5, 6, 2), (5, 7, 2), (8, 9, 2)])
    assert [trie.token[n] for n in needed_nodes(trie)] == [5]


def _run(policy, task, cfg, reuse, expand="auto"):
    capacity = cfg.max_contexts + 1 if cfg.strategy == "approximate" else 2
    predictor = Predictor(policy, policy.tokens, task.template, task.labels,
                          PrefixCache(policy, capacity=capacity, reuse=reuse), cfg.temperature, expand=expand)
    max_examples = 0 if cfg.strategy == "zero_shot" else 12
    steps, tests = [], []
    for event in run_protocol(predictor, task, cfg, max_examples):
        (steps if isinstance(event, StepEvent) else tests).append(event.to_json())
    return steps, tests


def _deterministic(records):
    return [{k: v for k, v in r.items() if k not in ("seconds", "tokens_computed", "prob")} for r in records]


@pytest.mark.parametrize("strategy", ["naive", "naive_plus", "explorative", "approximate", "icl", "zero_shot"])
def test_reuse_gives_the_same_run_as_recomputing(tiny, strategy):
    task = keyword_map(seed=3)
    cfg = EvalConfig(task="keyword_map", strategy=strategy, train_k=30, test_every=10, test_k=12, p_keep=0.5,
                     max_contexts=3, temperature=1.0)
    fast_steps, fast_tests = _run(tiny, task, cfg, reuse=True)
    slow_steps, slow_tests = _run(tiny, task, cfg, reuse=False)
    assert _deterministic(fast_steps) == _deterministic(slow_steps)
    assert _deterministic(fast_tests) == _deterministic(slow_tests)
    assert [t["step"] for t in fast_tests] == [0, 9, 19, 29]
    if strategy == "naive":  # while the context grows (12 = the cap here), reuse feeds only the new tokens
        fast = sum(s["tokens_computed"] for s in fast_steps[1:12])
        slow = sum(s["tokens_computed"] for s in slow_steps[1:12])
        assert fast * 3 < slow


def test_block_eviction_is_exact_on_the_engine_and_reuses_the_full_context(tiny):
    task = keyword_map(seed=3)
    cfg = EvalConfig(task="keyword_map", strategy="naive", train_k=30, test_every=10, test_k=6, evict_episodes=6)
    fast_steps, fast_tests = _run(tiny, task, cfg, reuse=True)
    slow_steps, slow_tests = _run(tiny, task, cfg, reuse=False)
    assert _deterministic(fast_steps) == _deterministic(slow_steps)
    assert _deterministic(fast_tests) == _deterministic(slow_tests)
    assert {len(s["context"]) for s in fast_steps[13:]} == {7, 8, 9, 10, 11, 12}
    sliding_steps, _ = _run(tiny, task, cfg.model_copy(update={"evict_episodes": 1}), reuse=True)
    full = lambda steps: sum(s["tokens_computed"] for s in steps[13:])
    assert full(fast_steps) * 2 < full(sliding_steps)


def test_trie_and_path_decoding_agree(tiny, tasks_dir):
    task = load_task("banking77", tasks_dir)   # 77 multi-token labels: the trie branches at several depths
    cfg = EvalConfig(task="banking77", strategy="naive", train_k=6, test_every=3, test_k=6)
    trie_run = _run(tiny, task, cfg, reuse=True, expand="trie")
    path_run = _run(tiny, task, cfg, reuse=True, expand="path")
    assert _deterministic(trie_run[0]) == _deterministic(path_run[0])
    assert _deterministic(trie_run[1]) == _deterministic(path_run[1])


def test_supervised_icl_shows_gold_and_predicts_only_tests(tiny):
    task = keyword_map(seed=0)
    steps, tests = _run(tiny, task, EvalConfig(strategy="icl", train_k=8, test_every=4, test_k=5), reuse=True)
    assert all(s["prediction"] is None and s["tokens_computed"] == 0 for s in steps)
    assert [t["step"] for t in tests] == [0, 3, 7] and tests[-1]["context_size"] == 7


def test_flipped_feedback_and_summary(tiny):
    task = keyword_map(seed=0)
    cfg = EvalConfig(strategy="naive", train_k=40, test_every=100, test_k=4, flip_feedback_prob=0.5, seed=7)
    steps, tests = _run(tiny, task, cfg, reuse=True)
    flipped = [s["feedback"] != s["reward"] for s in steps]
    assert flipped == [flip_draw(7, s["step"]) < 0.5 for s in steps] and any(flipped)
    metrics = summarize(steps, tests)
    assert metrics["regret"] == sum(1 - s["reward"] for s in steps)
    assert set(metrics["test_accuracy"]) == {0, 39}
    assert metrics["tokens_processed"] == sum(s["tokens_computed"] for s in steps + tests)


def test_repeat_rates_by_hand():
    def step(prediction, reward, feedback=None):
        return {"prediction": prediction, "reward": reward, "feedback": reward if feedback is None else feedback,
                "tokens_computed": 1, "seconds": 0.0}

    # after wrong: a->a (repeat), b->b (repeat), b->c; after right: a->b, c->c (repeat)
    steps = [step("a", 0), step("a", 1), step("b", 0), step("b", 0), step("c", 1), step("c", 0)]
    assert repeat_rates(steps) == {"repeat_after_wrong": round(2 / 3, 4), "repeat_after_right": 0.5}
    # the feedback the model saw decides, not the hidden reward (flipped feedback runs)
    flipped = [step("a", 0, feedback=1), step("a", 1, feedback=0), step("b", 0)]
    assert repeat_rates(flipped) == {"repeat_after_wrong": 0.0, "repeat_after_right": 1.0}
    # a copier repeats whatever the reward; zero-shot/ICL runs (no answers) have no rate
    copier = [step("x", r) for r in (0, 1, 0, 0, 1, 1, 0)]
    assert repeat_rates(copier) == {"repeat_after_wrong": 1.0, "repeat_after_right": 1.0}
    assert repeat_rates([{"prediction": None, "reward": None}] * 3) == {"repeat_after_wrong": None,
                                                                         "repeat_after_right": None}
    assert summarize(steps, [])["repeat_after_wrong"] == round(2 / 3, 4)


def test_test_temperature_changes_only_the_test_predictions(tiny):
    task = keyword_map(seed=0)
    cfg = EvalConfig(strategy="zero_shot", train_k=10, test_every=5, test_k=8, temperature=1.0)
    steps, tests = _run(tiny, task, cfg, reuse=True)
    hot_steps, hot_tests = _run(tiny, task, cfg.model_copy(update={"temperature": 5.0, "test_temperature": 1.0}),
                                reuse=True)
    assert _deterministic(hot_tests) == _deterministic(tests)   # same test protocol, same draws
    assert [s["prob"] for s in hot_steps] != [s["prob"] for s in steps]   # the training stream explored hotter
    _, greedy_tests = _run(tiny, task, cfg.model_copy(update={"test_temperature": 0.0}), reuse=True)
    _, greedy_again = _run(tiny, task, cfg.model_copy(update={"temperature": 3.0, "test_temperature": 0.0}),
                           reuse=True)
    assert _deterministic(greedy_tests) == _deterministic(greedy_again)


def test_decoding_streams_do_not_depend_on_batching(tiny):
    task = keyword_map(seed=0)
    make = lambda batch_tokens: Predictor(tiny, tiny.tokens, task.template, task.labels, PrefixCache(tiny), 1.0,
                                          batch_tokens=batch_tokens)
    context, user_open = render_context(tiny.tokens, task.template, [], Show(True, "prediction", True))
    queries = [e.text for e in task.test[:9]]
    rngs = lambda: [decode_rng(1, 0, 2, i) for i in range(len(queries))]
    one_pass, _ = make(4096).predict(context, user_open, queries, rngs())
    small, _ = make(40).predict(context, user_open, queries, rngs())
    assert [p.label for p in one_pass] == [p.label for p in small]


@pytest.mark.parametrize("strategy", ["approximate", "explorative"])
def test_continuing_from_a_logged_history_reproduces_the_run(tiny, strategy):
    """What --resume relies on: the protocol continued from the first k logged steps makes the same choices
    (the approximate strategy's contexts are rebuilt by replaying the history)."""
    from icrl_core.icrl_eval import history_from_events

    task = keyword_map(seed=1)
    cfg = EvalConfig(strategy=strategy, train_k=40, test_every=10, test_k=6, p_keep=0.5, max_contexts=3)
    make = lambda: Predictor(tiny, tiny.tokens, task.template, task.labels, PrefixCache(tiny, capacity=4), 1.0)
    full = [e.to_json() for e in run_protocol(make(), task, cfg, 12)]
    steps = [e for e in full if "query" in e]
    k = 23
    resumed = [e.to_json() for e in run_protocol(make(), task, cfg, 12, history_from_events(steps[:k]))]
    tail = [e for e in full if e["step"] >= k]
    assert _deterministic(resumed) == _deterministic(tail)


def test_a_redacted_log_holds_no_query_text_and_resumes_as_the_original(tiny):
    """`icrl redact`'s step events: the query's text becomes its digest, and the protocol continued from them
    (naive: every past query is in the context) makes the same choices as from the full log; a digest that does
    not match the training stream is refused."""
    import hashlib

    from icrl_core.errors import UserError
    from icrl_core.icrl_eval import history_from_events, redact_step_event

    task = keyword_map(seed=1)
    cfg = EvalConfig(strategy="naive", train_k=30, test_every=10, test_k=6)
    make = lambda: Predictor(tiny, tiny.tokens, task.template, task.labels, PrefixCache(tiny, capacity=4), 1.0)
    full = [e.to_json() for e in run_protocol(make(), task, cfg, 12)]
    steps = [e for e in full if "query" in e]
    k = 17
    redacted = [redact_step_event(s) for s in steps[:k]]
    assert all("query" not in r and r["query_sha256"] == hashlib.sha256(s["query"].encode()).hexdigest()[:16]
               for r, s in zip(redacted, steps))
    assert [redact_step_event(r) for r in redacted] == redacted
    resumed = [e.to_json() for e in run_protocol(make(), task, cfg, 12, history_from_events(redacted))]
    assert _deterministic(resumed) == _deterministic([e for e in full if e["step"] >= k])
    redacted[5]["query_sha256"] = "0" * 16
    with pytest.raises(UserError, match="at step 5"):
        next(run_protocol(make(), task, cfg, 12, history_from_events(redacted)))


def test_behaviour_reports_collapse_per_window():
    """Two windows: the first explores (two labels), the second answers one label with certainty."""
    steps = ([{"step": i, "prediction": "a" if i % 2 else "b", "reward": i % 2, "prob": 0.5, "context": []}
              for i in range(4)]
             + [{"step": i, "prediction": "a", "reward": 0, "prob": 1.0, "context": [0, 1]} for i in range(4, 8)])
    tests = [{"step": 7, "accuracy": 0.5, "context_size": 2, "predictions": ["a", "a", "a", "b"]}]
    report = behaviour(steps, tests, window=4)
    first, second = report["windows"]
    assert (first["first_step"], first["last_step"], first["accuracy"]) == (0, 3, 0.5)
    assert first["predictions"] == {"b": 2, "a": 2} and first["rewarded"] == {"a": 2}
    assert first["top_share"] == 0.5 and first["mean_answer_prob"] == 0.5
    assert second["predictions"] == {"a": 4} and second["rewarded"] == {} and second["top_share"] == 1.0
    assert second["mean_context_episodes"] == 2.0
    # first window: after wrong b (steps 0, 2) comes a (no repeat); second: a wrong a repeated 3 times out of 3
    assert first["repeat_after_wrong"] == 0.0 and second["repeat_after_wrong"] == 1.0
    assert report["evaluations"] == [{"step": 7, "accuracy": 0.5, "context_size": 2,
                                      "predictions": {"a": 3, "b": 1}, "top_share": 0.75}]
    supervised = [{"step": 0, "prediction": None, "reward": None}]  # ICL steps predict nothing
    assert behaviour(supervised, tests, window=4)["windows"] == []
    with pytest.raises(UserError):
        behaviour(steps, tests, window=0)

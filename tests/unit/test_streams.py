"""In-context RL streams (icrl_core/streams.py): rendered exactly as the harness renders its contexts, decoded
by the harness's constrained policy, batched generation equal to one stream at a time, and one forward pass over
the finished streams giving the generation's log-probs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from icrl_core.config import DataConfig, ExplorativeStreamContext, LoraAdapter, SyntheticSource
from icrl_core.dataset_build import resolve_sources
from icrl_core.icrl_eval import Predictor, label_distribution, render_context, render_query
from icrl_core.kernels import PrefixCache
from icrl_core.streams import (
    STREAM_VIEW,
    TEACHER_VIEW,
    collate_streams,
    context_values,
    generate_streams,
    mine_preference_pairs,
    sample_stream_task,
    stream_outputs,
    stream_rng,
    teacher_logprobs,
)
from tests.conftest import perturb_lora_b

STEPS = 6


@pytest.fixture(scope="module")
def policy():
    from icrl_core.model import load_policy

    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4), value_head=True)
    perturb_lora_b(policy, std=0.05)
    return policy


@pytest.fixture(scope="module")
def task():
    data = DataConfig(sources=[SyntheticSource(name="keyword_map")], labels_per_episode=3,
                      labels_per_episode_min=2)
    return sample_stream_task(resolve_sources(data, seed=0), data, STEPS, seed=0, key="group-0")


@pytest.fixture(scope="module")
def streams(policy, task):
    return generate_streams(policy, task, [stream_rng(0, 1, 0, g) for g in range(3)], temperature=1.0)


def test_stream_task_follows_the_bootstrap_sampler(task):
    data = DataConfig(sources=[SyntheticSource(name="keyword_map")], labels_per_episode=3,
                      labels_per_episode_min=2)
    sources = resolve_sources(data, seed=0)
    assert 2 <= len(task.labels) <= 3 and len(task.queries) == STEPS
    assert {q.label for q in task.queries} <= set(task.labels)
    assert sample_stream_task(sources, data, STEPS, seed=0, key="group-0") == task  # deterministic
    original = {e.text: e.label for e in sources[0].task.train}
    every_label = {"labels_per_episode": None, "labels_per_episode_min": None}
    plain = [sample_stream_task(sources, data.model_copy(update=every_label), STEPS, 0, f"g{i}") for i in range(8)]
    renamed = data.model_copy(update={**every_label, "permute_labels": True})
    permuted = [sample_stream_task(sources, renamed, STEPS, 0, f"g{i}") for i in range(8)]
    assert all(q.label == original[q.text] for t in plain for q in t.queries)
    assert all(sorted(t.labels) == sorted(sources[0].task.labels) for t in permuted)
    assert any(q.label != original[q.text] for t in permuted for q in t.queries)  # renamed in some group


def test_label_runs_repeat_the_previous_gold_label_at_the_set_rate():
    """ppo.stream.repeat_label orders a stream's queries in label runs: the share of queries with their
    predecessor's label is p + (1 - p) x (chance of a uniform draw landing on it); 0 draws as before."""
    import random as stdlib_random
    from itertools import pairwise

    from icrl_core.streams import label_run_picks
    from icrl_core.task_data import Example

    pool = [Example(f"q{i}", "abcd"[i % 4]) for i in range(400)]
    picks = label_run_picks(pool, 200, stdlib_random.Random(0), 0.6)
    assert len(set(picks)) == 200  # without replacement while the pool lasts
    repeats = sum(pool[a].label == pool[b].label for a, b in pairwise(picks)) / 199
    assert 0.6 + 0.4 * 0.25 - 0.1 < repeats < 0.6 + 0.4 * 0.25 + 0.1
    uniform = label_run_picks(pool, 200, stdlib_random.Random(0), 0.0)
    assert sum(pool[a].label == pool[b].label for a, b in pairwise(uniform)) / 199 < 0.4
    assert label_run_picks(pool[:3], 5, stdlib_random.Random(0), 0.9)  # a pool smaller than the stream reuses

    data = DataConfig(sources=[SyntheticSource(name="keyword_map")], labels_per_episode=3,
                      labels_per_episode_min=2)
    sources = resolve_sources(data, seed=0)
    runs = [sample_stream_task(sources, data, 20, 0, f"g{i}", tests=4, repeat_label=0.9) for i in range(4)]
    assert runs == [sample_stream_task(sources, data, 20, 0, f"g{i}", tests=4, repeat_label=0.9) for i in range(4)]
    pairs = [(a.label, b.label) for t in runs for a, b in pairwise(t.queries)]
    assert sum(a == b for a, b in pairs) / len(pairs) > 0.8
    for t in runs:
        assert len(t.queries) == 20 and len(t.tests) == 4
        assert {q.label for q in t.tests + t.queries} <= set(t.labels)
    assert sample_stream_task(sources, data, STEPS, 0, "group-0", repeat_label=0.0) == sample_stream_task(
        sources, data, STEPS, 0, "group-0")


def test_each_step_sees_the_harness_context_and_the_stream_is_one_sequence(policy, task, streams):
    tokens = policy.tokens
    for stream in streams:
        assert len(stream.steps) == STEPS
        for t, step in enumerate(stream.steps):
            context, user_open = render_context(tokens, task.template, [s.record for s in stream.steps[:t]],
                                                STREAM_VIEW)
            prompt = list(context) + render_query(tokens, task.template, task.queries[t].text, user_open)
            assert stream.context_ids(t) == prompt
            end = step.answer_start + len(step.answer_ids)
            assert tuple(stream.input_ids[step.answer_start:end]) == step.answer_ids
            assert step.record.reward == int(step.record.prediction == task.queries[t].label)
        full, _ = render_context(tokens, task.template, [s.record for s in stream.steps], STREAM_VIEW)
        assert stream.input_ids == list(full)[:len(stream.input_ids)]  # feedback of the last step not included
        assert "is wrong" in tokens.decode(stream.input_ids) or all(stream.rewards)


def test_answers_follow_the_harness_constrained_policy(policy, task, streams):
    """exp(step log-prob) is the harness's p(label) (label_distribution) in the same context."""
    predictor = Predictor(policy, policy.tokens, task.template, list(task.labels), PrefixCache(policy), 1.0)
    for stream in streams[:2]:
        for t, step in enumerate(stream.steps):
            context, user_open = render_context(policy.tokens, task.template,
                                                [s.record for s in stream.steps[:t]], STREAM_VIEW)
            probs = label_distribution(predictor, context, user_open, task.queries[t].text, 1.0)
            label = list(task.labels).index(step.record.prediction)
            assert math.exp(step.logp) == pytest.approx(probs[label], abs=2e-4)


def test_batched_generation_equals_one_stream_at_a_time(policy, task, streams):
    for g, together in enumerate(streams):
        alone, = generate_streams(policy, task, [stream_rng(0, 1, 0, g)], temperature=1.0)
        assert alone.input_ids == together.input_ids
        assert np.allclose([s.logp for s in alone.steps], [s.logp for s in together.steps], atol=1e-4)


def test_one_pass_logprobs_equal_the_generation_logprobs(policy, streams):
    batch = collate_streams(streams, policy.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, entropy, values = stream_outputs(policy, batch, temperature=1.0, with_values=True)
    mask = batch.action_mask
    assert mask.sum() == sum(len(s.decisions) for st in streams for s in st.steps) > 0
    assert torch.allclose(logp[mask], batch.behaviour_logp[mask], atol=1e-4)
    assert (entropy[mask] > 0).all() and (entropy[mask] <= math.log(batch.candidates.shape[-1]) + 1e-5).all()
    assert values.shape == batch.rewards.shape == (len(streams), STEPS)
    # the reference (adapters off) is another policy: its log-probs differ
    with torch.no_grad(), policy.reference():
        ref_logp, _, _ = stream_outputs(policy, batch, temperature=1.0, with_values=False)
    assert not torch.allclose(ref_logp[mask], logp[mask], atol=1e-4)


def test_one_pass_logprobs_carry_gradients_and_a_subset_of_rows_is_the_same(policy, streams):
    batch = collate_streams(streams, policy.tokenizer.pad_token_id)
    part = batch.select(torch.tensor([2, 0]))
    logp, _, _ = stream_outputs(policy, part, temperature=1.0, with_values=False)
    full, _, _ = stream_outputs(policy, batch, temperature=1.0, with_values=False)
    assert torch.allclose(logp[0, :part.action_mask[0].sum()], full[2, :part.action_mask[0].sum()], atol=1e-5)
    logp, entropy, _ = stream_outputs(policy, part, temperature=1.0, with_values=False)
    (logp.sum() + entropy.sum()).backward()  # the entropy over padded candidates too: finite gradients
    grads = [p.grad for n, p in policy.model.named_parameters() if "lora" in n]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    assert all(torch.isfinite(g).all() for g in grads if g is not None)
    policy.model.zero_grad(set_to_none=True)


def test_preference_pairs_are_mined_from_wrong_steps(policy, streams):
    pairs = mine_preference_pairs(streams, policy.tokens)
    wrong = [(st, t) for st in streams for t, s in enumerate(st.steps) if not s.record.reward]
    assert len(pairs) == len(wrong) > 0
    for pair, (stream, t) in zip(pairs, wrong):
        step = stream.steps[t]
        assert pair.prompt_ids == tuple(stream.context_ids(t))
        assert pair.rejected == step.record.prediction != pair.chosen == step.record.gold
        assert pair.rejected_ids == step.answer_ids and pair.chosen_ids != pair.rejected_ids
        assert pair.chosen_ids[-1] == pair.rejected_ids[-1] == policy.tokens.end_of_turn_id


def test_streams_of_tasks_with_different_label_counts_train_with_finite_gradients(policy):
    """Padded candidates (a 2-label stream beside a 3-label one) enter the log-softmax as -inf: the entropy
    and log-probs must keep finite gradients."""
    data = DataConfig(sources=[SyntheticSource(name="keyword_map")], labels_per_episode=3,
                      labels_per_episode_min=2)
    sources = resolve_sources(data, seed=0)
    tasks = [sample_stream_task(sources, data, 3, seed=0, key=f"k{i}") for i in range(20)]
    two = next(t for t in tasks if len(t.labels) == 2)
    three = next(t for t in tasks if len(t.labels) == 3)
    streams = (generate_streams(policy, two, [stream_rng(0, 1, 0, 0)], 1.0, group=0)
               + generate_streams(policy, three, [stream_rng(0, 1, 1, 0)], 1.0, group=1))
    batch = collate_streams(streams, policy.tokenizer.pad_token_id)
    assert not batch.candidate_mask[0, :, 2].any() and batch.candidate_mask[1, 0].all()
    logp, entropy, _ = stream_outputs(policy, batch, temperature=1.0, with_values=False)
    assert torch.allclose(logp[batch.action_mask], batch.behaviour_logp[batch.action_mask], atol=1e-4)
    (logp.sum() + entropy.sum()).backward()
    grads = [p.grad for n, p in policy.model.named_parameters() if "lora" in n and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    policy.model.zero_grad(set_to_none=True)


def test_the_teacher_scores_each_answer_as_the_harness_would_after_the_gold_labelled_context(policy, task, streams):
    """Context distillation's teacher: the same weights shown the ICL view (every past query with its gold label,
    no feedback); exp(teacher log-prob of a stream's answer) is the harness's p(label) in that context, and the
    streams of a group (same task and queries) get one teacher context per step."""
    from icrl_core.icrl_eval import EpisodeRecord

    teacher = teacher_logprobs(policy, streams, temperature=1.0)
    assert teacher.shape == (len(streams), STEPS) and (teacher <= 0).all()
    predictor = Predictor(policy, policy.tokens, task.template, list(task.labels), PrefixCache(policy), 1.0)
    golds = [EpisodeRecord(t, q.text, q.label, q.label, 1, 1) for t, q in enumerate(task.queries)]
    for b, stream in enumerate(streams):
        for t, step in enumerate(stream.steps):
            context, user_open = render_context(policy.tokens, task.template, golds[:t], TEACHER_VIEW)
            probs = label_distribution(predictor, context, user_open, task.queries[t].text, 1.0)
            label = list(task.labels).index(step.record.prediction)
            assert math.exp(teacher[b, t]) == pytest.approx(probs[label], abs=2e-4)
    # the teacher's view differs from the student's: after a wrong answer the student sees 'wrong', the teacher
    # the gold label, so their probabilities differ somewhere
    student = torch.tensor([[s.logp for s in stream.steps] for stream in streams])
    assert not torch.allclose(teacher, student, atol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# Explorative streams (ppo.stream.context.kind=explorative): each step its own context, rewarded steps only

EXPLORATIVE = ExplorativeStreamContext(p_keep=0.6)


@pytest.fixture(scope="module")
def explorative_streams(policy, task):
    return generate_streams(policy, task, [stream_rng(0, 2, 0, g) for g in range(3)], temperature=1.5,
                            context=EXPLORATIVE)


def test_an_explorative_step_sees_a_subset_of_the_rewarded_past_steps_in_time_order(policy, task,
                                                                                    explorative_streams):
    tokens = policy.tokens
    shown_counts = []
    for stream in explorative_streams:
        assert len(stream.sequences) == len(stream.steps) == STEPS
        past = []
        for t, step in enumerate(stream.steps):
            prompt = stream.context_ids(t)
            # some subset of the rewarded past steps, in time order, renders exactly this prompt
            rewarded = [r for r in past if r.reward]
            matches = []
            for mask in range(2 ** len(rewarded)):
                subset = [r for i, r in enumerate(rewarded) if mask >> i & 1]
                context, user_open = render_context(tokens, task.template, subset, STREAM_VIEW)
                if list(context) + render_query(tokens, task.template, task.queries[t].text, user_open) == prompt:
                    matches.append(len(subset))
            assert len(matches) == 1
            shown_counts.append((matches[0], len(rewarded)))
            assert stream.sequences[t] == prompt + list(step.answer_ids) and step.sequence == t
            assert "is wrong" not in tokens.decode(prompt)
            past.append(step.record)
    # p_keep 0.6: some rewarded steps are left out, some are shown
    assert any(0 < shown < total for shown, total in shown_counts) or \
        sum(shown for shown, _ in shown_counts) < sum(total for _, total in shown_counts)
    assert sum(shown for shown, _ in shown_counts) > 0


def test_explorative_streams_are_reproducible_and_batched_equals_alone(policy, task, explorative_streams):
    for g, together in list(enumerate(explorative_streams))[1:2]:  # the middle row of the batch, alone
        alone, = generate_streams(policy, task, [stream_rng(0, 2, 0, g)], temperature=1.5, context=EXPLORATIVE)
        assert alone.sequences == together.sequences
        assert np.allclose([s.logp for s in alone.steps], [s.logp for s in together.steps], atol=1e-4)


def test_one_pass_over_explorative_and_naive_rows_gives_the_generation_logprobs(policy, streams,
                                                                                explorative_streams):
    mixed = [explorative_streams[0], streams[0], explorative_streams[1]]
    batch = collate_streams(mixed, policy.tokenizer.pad_token_id)
    assert batch.input_ids.shape[0] == 2 * STEPS + 1 and len(batch) == 3
    assert batch.row_stream.tolist() == [0] * STEPS + [1] + [2] * STEPS
    with torch.no_grad():
        logp, _, values = stream_outputs(policy, batch, temperature=1.5, with_values=True)
    mask = batch.action_mask
    # the naive stream was decoded at T 1.0: only the explorative rows' log-probs are at this temperature
    for b in (0, 2):
        assert torch.allclose(logp[b][mask[b]], batch.behaviour_logp[b][mask[b]], atol=1e-4)
    assert values.shape == (3, STEPS)
    part = batch.select(torch.tensor([2, 1]))
    assert sorted(part.row_stream.tolist()) == [0] * STEPS + [1] and len(part) == 2
    with torch.no_grad():
        sub, _, sub_values = stream_outputs(policy, part, temperature=1.5, with_values=True)
    n = int(part.action_mask[0].sum())
    assert torch.allclose(sub[0, :n], logp[2, :n], atol=1e-5)
    assert torch.allclose(sub_values[0], values[2], atol=1e-5) and torch.allclose(sub_values[1], values[1], atol=1e-5)
    # the value of an explorative step is read at its own row's last prompt token: rows differ per step
    assert len(set(part.step_row[0].tolist())) == STEPS


def test_preference_pairs_of_explorative_streams_use_each_steps_own_context(policy, explorative_streams):
    pairs = mine_preference_pairs(explorative_streams, policy.tokens)
    wrong = [(st, t) for st in explorative_streams for t, s in enumerate(st.steps) if not s.record.reward]
    assert len(pairs) == len(wrong) > 0
    for pair, (stream, t) in zip(pairs, wrong):
        assert pair.prompt_ids == tuple(stream.sequences[t][:stream.steps[t].answer_start])


def test_explorative_rows_run_in_length_buckets_with_the_numbers_of_one_pass(policy, explorative_streams,
                                                                               monkeypatch):
    """Rows of varied length go through the forward pass in buckets of similar length (less padding); the
    log-probs, values and gradients equal those of one pass over all rows."""
    import icrl_core.streams as streams_module
    from icrl_core.streams import row_buckets

    assert row_buckets([10, 100, 95, 12, 11, 90]) == [[1, 2, 5], [3, 4, 0]]
    assert row_buckets([50, 50, 50]) == [[0, 1, 2]] and row_buckets([7]) == [[0]]
    batch = collate_streams(explorative_streams, policy.tokenizer.pad_token_id)
    assert len(row_buckets(batch.attention_mask.sum(1).tolist())) > 1

    def outputs():
        policy.model.zero_grad(), policy.value_head.zero_grad()
        logp, entropy, values = stream_outputs(policy, batch, temperature=1.5, with_values=True)
        (logp.sum() + entropy.sum() + values.sum()).backward()
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
        return logp.detach(), values.detach(), grads

    bucketed = outputs()
    monkeypatch.setattr(streams_module, "row_buckets", lambda lengths, max_padding=0.25: [list(range(len(lengths)))])
    single = outputs()
    policy.model.zero_grad(set_to_none=True), policy.value_head.zero_grad(set_to_none=True)
    assert torch.allclose(bucketed[0], single[0], atol=1e-5) and torch.allclose(bucketed[1], single[1], atol=1e-5)
    assert bucketed[2].keys() == single[2].keys() and bucketed[2]
    for name, grad in bucketed[2].items():
        assert torch.allclose(grad, single[2][name], atol=1e-5, rtol=1e-4), name


# ---------------------------------------------------------------------------------------------------------------
# Rollouts through an inference engine (ppo.stream.engine: inference)


@pytest.mark.parametrize("context", [None, EXPLORATIVE], ids=["naive", "explorative"])
def test_streams_through_the_torch_engine_equal_the_direct_rollout(policy, task, context):
    """The engine path decodes with the same draws and rule: the same answers, sequences and decisions, the
    decisions' log-probs equal up to float rounding."""
    from icrl_core.inference.torch_backend import TorchEngine

    rngs = lambda: [stream_rng(0, 3, 0, g) for g in range(3)]
    direct = generate_streams(policy, task, rngs(), temperature=1.5, context=context)
    engine = TorchEngine(policy)
    try:
        served = generate_streams(policy, task, rngs(), temperature=1.5, context=context, engine=engine)
    finally:
        engine.close()
    assert engine.tokens_computed > 0  # the engine did the decoding
    for a, b in zip(direct, served):
        assert a.sequences == b.sequences and [s.record for s in a.steps] == [s.record for s in b.steps]
        for x, y in zip(a.steps, b.steps):
            assert (x.answer_start, x.answer_ids, x.sequence) == (y.answer_start, y.answer_ids, y.sequence)
            assert [(d.position, d.candidates, d.chosen) for d in x.decisions] == \
                [(d.position, d.candidates, d.chosen) for d in y.decisions]
            assert np.allclose([d.logp for d in x.decisions], [d.logp for d in y.decisions], atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Burn-in (ppo.stream.burn_in): the first queries answered into the context, not trained

BURN_IN = 2


@pytest.mark.parametrize("context", [None, EXPLORATIVE], ids=["naive", "explorative"])
def test_a_burned_in_stream_is_the_tail_of_the_whole_stream(policy, task, context):
    """The same draws with burn_in k: the first k answers are made as in the whole stream (same decoding draws,
    same context draws), so the steps are the whole stream's steps k.. with the same contexts, answers and
    log-probs, and the collated batch scores exactly those steps."""
    def rngs():
        return [stream_rng(0, 3, 0, g) for g in range(2)]

    whole = generate_streams(policy, task, rngs(), temperature=1.5, context=context)
    burned = generate_streams(policy, task, rngs(), temperature=1.5, context=context, burn_in=BURN_IN)
    for full, tail in zip(whole, burned):
        assert tail.burn_in == BURN_IN and len(tail.steps) == STEPS - BURN_IN
        assert [s.record for s in tail.steps] == [s.record for s in full.steps[BURN_IN:]]
        for t, step in enumerate(tail.steps):
            assert tail.context_ids(t) == full.context_ids(BURN_IN + t)
            assert step.answer_ids == full.steps[BURN_IN + t].answer_ids
            assert step.logp == pytest.approx(full.steps[BURN_IN + t].logp, abs=1e-4)
        if context is None:  # naive: one sequence, the whole stream's, burned-in answers included
            assert tail.input_ids == full.input_ids
        else:  # explorative: only the trained steps have rows
            assert tail.sequences == full.sequences[BURN_IN:]
    batch = collate_streams(burned, policy.tokenizer.pad_token_id)
    assert batch.rewards.shape == (2, STEPS - BURN_IN)
    assert batch.rewards.tolist() == [[s.reward for s in full.steps[BURN_IN:]] for full in whole]
    with torch.no_grad():
        logp, _, _ = stream_outputs(policy, batch, temperature=1.5, with_values=False)
    mask = batch.action_mask
    assert mask.sum() == sum(len(s.decisions) for st in burned for s in st.steps) > 0
    assert torch.allclose(logp[mask], batch.behaviour_logp[mask], atol=1e-4)


@pytest.mark.parametrize("context", [None, ExplorativeStreamContext(p_keep=1.0)], ids=["naive", "explorative"])
def test_a_shared_burn_in_is_the_first_streams_and_every_stream_branches_from_it(policy, task, context):
    """shared_burn_in: the first stream is the stream it would be alone (the burn-in is its own, by its draws);
    every stream's first trained step starts from its history (here: every past episode shown, so the same
    context), and the streams go their own ways after it."""
    def rngs():
        return [stream_rng(0, 7, 0, g) for g in range(3)]

    burn_in = STEPS - 2
    alone = generate_streams(policy, task, rngs()[:1], temperature=1.5, context=context, burn_in=burn_in)[0]
    branched = generate_streams(policy, task, rngs(), temperature=1.5, context=context, burn_in=burn_in,
                                shared_burn_in=True)
    assert [s.record for s in branched[0].steps] == [s.record for s in alone.steps]
    assert all(len(b.steps) == STEPS - burn_in and b.burn_in == burn_in for b in branched)
    assert all(b.context_ids(0) == alone.context_ids(0) for b in branched)
    assert "correct answer" in policy.tokens.decode(alone.context_ids(0))  # the burn-in is in it
    assert len({tuple(s.record.prediction for s in b.steps) for b in branched}) > 1 or \
        len({tuple(b.context_ids(1)) for b in branched}) > 1
    batch = collate_streams(branched, policy.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _, _ = stream_outputs(policy, batch, temperature=1.5, with_values=False)
    assert torch.allclose(logp[batch.action_mask], batch.behaviour_logp[batch.action_mask], atol=1e-4)


@pytest.mark.parametrize("context", [None, EXPLORATIVE], ids=["naive", "explorative"])
def test_a_burn_in_temperature_makes_the_context_and_the_trained_steps_keep_theirs(policy, task, context):
    """burn_in_temperature: the burn-in answers are the first answers of a whole stream sampled at that
    temperature (the same draws), the trained steps are sampled and scored at ppo.temperature; unset, it is
    ppo.temperature (the stream of the burn-in test above)."""
    def rngs():
        return [stream_rng(0, 3, 0, g) for g in range(2)]

    cold = generate_streams(policy, task, rngs(), temperature=0.3, context=context)
    mixed = generate_streams(policy, task, rngs(), temperature=3.0, context=context, burn_in=BURN_IN,
                             burn_in_temperature=0.3)
    hot = generate_streams(policy, task, rngs(), temperature=3.0, context=context, burn_in=BURN_IN)
    same = generate_streams(policy, task, rngs(), temperature=3.0, context=context, burn_in=BURN_IN,
                            burn_in_temperature=3.0)
    for c, m, h, s in zip(cold, mixed, hot, same):
        assert m.context_ids(0) == c.context_ids(BURN_IN)  # the burn-in: the cold stream's first answers
        assert [x.record for x in s.steps] == [x.record for x in h.steps] and s.sequences == h.sequences
    if context is None:  # naive contexts show every burn-in answer: the temperature changed them
        assert any(m.context_ids(0) != h.context_ids(0) for m, h in zip(mixed, hot))
    batch = collate_streams(mixed, policy.tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _, _ = stream_outputs(policy, batch, temperature=3.0, with_values=False)
    assert torch.allclose(logp[batch.action_mask], batch.behaviour_logp[batch.action_mask], atol=1e-4)
    from icrl_core.errors import UserError

    with pytest.raises(UserError, match="temperature must be > 0"):
        generate_streams(policy, task, rngs(), temperature=1.0, burn_in=BURN_IN, burn_in_temperature=0.0)


def test_the_teacher_of_a_burned_in_stream_scores_its_steps_after_every_earlier_gold_label(policy, task, streams):
    burned = generate_streams(policy, task, [stream_rng(0, 1, 0, g) for g in range(3)], temperature=1.0,
                              burn_in=BURN_IN)
    assert [[s.record for s in b.steps] for b in burned] == [[s.record for s in w.steps[BURN_IN:]] for w in streams]
    whole = teacher_logprobs(policy, streams, temperature=1.0)
    tail = teacher_logprobs(policy, burned, temperature=1.0)
    assert tail.shape == (3, STEPS - BURN_IN)
    assert torch.allclose(tail, whole[:, BURN_IN:], atol=1e-5)


def test_burn_in_must_leave_a_step_and_is_a_ppo_stage_option(policy, task):
    from pydantic import ValidationError

    from icrl_core.config import DPOConfig, StreamConfig
    from icrl_core.errors import UserError

    with pytest.raises(UserError, match="leaves no step"):
        generate_streams(policy, task, [stream_rng(0, 1, 0, 0)], temperature=1.0, burn_in=STEPS)
    with pytest.raises(ValidationError, match="burn_in is a ppo-stage option"):
        DPOConfig(stream=StreamConfig(burn_in=4))
    with pytest.raises(ValidationError):
        StreamConfig(burn_in=-1)


def test_explorative_contexts_keep_the_harness_window_cap(policy, task):
    """An explorative step shows at most the harness's cap of episodes for the window (icrl_eval's
    max_context_examples over the stream's queries), so a long stream fits a small window where showing every
    kept episode would not; with room for all of them the cap is the stream's length (nothing changes)."""
    from icrl_core.streams import explorative_max_examples

    assert explorative_max_examples(policy.tokens, task, 2048) == STEPS
    keep_all = ExplorativeStreamContext(p_keep=1.0)
    rngs = [stream_rng(0, 4, 0, g) for g in range(2)]
    uncapped = generate_streams(policy, task, rngs, temperature=1.0, context=keep_all, max_tokens=4096)
    longest = max(len(st.context_ids(t)) for st in uncapped for t in range(STEPS))
    window = longest - 8  # the longest context no longer fits
    cap = explorative_max_examples(policy.tokens, task, window)
    assert 0 < cap < STEPS

    def shown(stream, t):  # episodes in a step's context: each kept (rewarded) one ends with this feedback
        return policy.tokens.decode(stream.context_ids(t)).count("is the correct answer")

    assert max(shown(st, t) for st in uncapped for t in range(STEPS)) > cap
    capped = generate_streams(policy, task, [stream_rng(0, 4, 0, g) for g in range(2)], temperature=1.0,
                              context=keep_all, max_tokens=window, burn_in=1)
    for stream in capped:
        for t in range(len(stream.steps)):
            assert shown(stream, t) <= cap and len(stream.context_ids(t)) < window


# ---------------------------------------------------------------------------------------------------------------
# What a stream's context is worth (ppo.stream.test_reward)


@pytest.mark.parametrize("context", [None, ExplorativeStreamContext(p_keep=0.6)], ids=["naive", "explorative"])
def test_a_streams_test_value_is_the_harness_expected_accuracy_of_its_last_context(policy, context):
    """context_values: held-out queries drawn after the stream's (same labels, none of them a stream query), each
    scored after the stream's context after its last step (naive: every episode, burned-in ones included;
    explorative: every rewarded one); v is the mean harness p(gold) there."""
    data = DataConfig(sources=[SyntheticSource(name="keyword_map")], labels_per_episode=3,
                      labels_per_episode_min=2)
    sources = resolve_sources(data, seed=0)
    task = sample_stream_task(sources, data, STEPS, seed=0, key="group-0", tests=5)
    assert sample_stream_task(sources, data, STEPS, seed=0, key="group-0").tests == ()
    assert len(task.tests) == 5 and {t.label for t in task.tests} <= set(task.labels)
    assert not {t.text for t in task.tests} & {q.text for q in task.queries}
    streams = generate_streams(policy, task, [stream_rng(0, 3, 0, g) for g in range(2)], temperature=1.5,
                               context=context, burn_in=2, shared_burn_in=True)
    values = context_values(policy, streams, temperature=1.0)
    predictor = Predictor(policy, policy.tokens, task.template, list(task.labels), PrefixCache(policy), 1.0)
    for stream, value in zip(streams, values, strict=True):
        assert len(stream.history) == STEPS and stream.test_value == value and 0 < value < 1
        if context is None:
            assert stream.shown_at_end == list(range(STEPS))
        else:  # every rewarded episode (no p_keep draw), in time order
            assert stream.shown_at_end == [i for i, r in enumerate(stream.history) if r.reward]
        shown = [stream.history[i] for i in stream.shown_at_end]
        ids, user_open = render_context(policy.tokens, task.template, shown, STREAM_VIEW)
        expected = [label_distribution(predictor, ids, user_open, t.text, 1.0)[list(task.labels).index(t.label)]
                    for t in task.tests]
        assert value == pytest.approx(sum(expected) / len(expected), abs=2e-4)
    with pytest.raises(ValueError, match="held-out tests"):
        context_values(policy, generate_streams(policy, sample_stream_task(sources, data, 2, 0, "g"),
                                             [stream_rng(0, 0, 0, 0)], temperature=1.0), temperature=1.0)

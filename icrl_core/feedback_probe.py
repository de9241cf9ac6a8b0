"""Does a model read the reward feedback in its context? The feedback-sensitivity probe.

For `queries` test queries whose gold label is not `target`, a context of n past attempts (training queries
whose gold label is not `target` either; the same attempts for a query in both conditions) all answered
`target` is rendered as the in-context RL harness renders a naive history, once with every attempt marked
wrong ("The answer 'X' is wrong! You can do better!") and once marked right. The probe reads the probability
the harness's constrained decoding gives each label (`label_distribution`, temperature 1) and reports, per n:

    p_target_wrong = mean_q p(target | n attempts answered target, all marked wrong)
    p_target_right = mean_q p(target | n attempts answered target, all marked right)
    feedback_effect = p_target_right - p_target_wrong          in [-1, 1]

A model that reads the feedback moves away from a label its context marks wrong (effect near +1 when the
right-marked context pulls it to `target`); a model that copies its previous answers gives `target` the same
probability either way (effect near 0). The second case predicts the collapse of naive in-context RL: once a
few attempts give one label, the model keeps giving it, however often it is told it is wrong. n = 0 (no
context) is the baseline. Mean p(gold) is reported beside each condition, and each query's p(target) and p(gold).

Moving off a label marked wrong is half of reading feedback; the other half is where the probability goes. So
the probe also reports, per n, whether the gold label gains from the wrong-marked context:

    gold_after_wrong = mean_q p(gold | n attempts marked wrong) - mean_q p(gold | no context)

(positive: the eliminated label's mass moves towards the right answer; a model that only stops repeating
itself spreads it over the other wrong labels and can end below its no-context p(gold)).

The effects' 95% intervals are paired percentile bootstraps over the queries (`effect_interval`): the same
queries (and attempts) appear in both conditions, so what is resampled is each query's difference, e.g.
p(target | right) - p(target | wrong).

Costs one forward pass per query and condition over a cached context (a few seconds per 40 queries for
SmolLM2-135M on a CPU core).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from icrl_core.errors import UserError
from icrl_core.icrl_eval import EpisodeRecord, Predictor, Show, label_distribution, render_context
from icrl_core.task_data import ClassificationTask, Example

# A naive in-context RL context: the ICRL system prompt, the model's predictions, a feedback turn after each.
NAIVE_SHOW = Show(system_with_feedback=True, answer="prediction", feedback=True)


@dataclass(frozen=True)
class Condition:
    attempts: int            # n past attempts in context
    feedback: int | None     # 0: all marked wrong, 1: all marked right, None: no context (n = 0)

    @property
    def name(self) -> str:
        return f"n{self.attempts}" + {None: "", 0: "_wrong", 1: "_right"}[self.feedback]


def conditions(counts: Sequence[int]) -> list[Condition]:
    """n = 0 once, then each n > 0 with wrong and with right feedback."""
    out = [Condition(0, None)]
    for n in sorted(set(counts) - {0}):
        out += [Condition(n, 0), Condition(n, 1)]
    return out


def probe_examples(task: ClassificationTask, target: str, n_queries: int, seed: int) -> tuple[list[Example],
                                                                                           list[Example]]:
    """(queries, pool of past attempts): test and training examples whose gold label is not `target`."""
    if target not in task.labels:
        raise UserError(f"target label '{target}' is not a label of task '{task.name}'; its labels: "
                        f"{', '.join(task.labels)}")
    queries = [e for e in task.test_set(len(task.test), seed) if e.label != target][:n_queries]
    pool = [e for e in task.train if e.label != target]
    if not queries or not pool:
        raise UserError(f"task '{task.name}' has no test or training example whose label is not '{target}'")
    return queries, pool


def past_attempts(pool: Sequence[Example], target: str, condition: Condition, query_index: int,
                  seed: int) -> list[EpisodeRecord]:
    """The context of one query: `condition.attempts` pool examples (fixed by query index and seed, so the wrong
    and right conditions show the same ones), each answered `target` with the condition's feedback."""
    if condition.attempts > len(pool):
        raise UserError(f"{condition.attempts} past attempts asked for, the pool has {len(pool)} examples")
    past = random.Random(seed * 1_000_003 + query_index).sample(list(pool), condition.attempts)
    return [EpisodeRecord(step, e.text, e.label, target, condition.feedback, condition.feedback)
            for step, e in enumerate(past)]


def effect_interval(right: Sequence[float], wrong: Sequence[float], seed: int, resamples: int = 2000,
                    level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(right - wrong), resampling queries (pairs) with replacement.
    right, wrong: (Q,) each query's p(target) under the two feedbacks."""
    diffs = np.asarray(right, dtype=np.float64) - np.asarray(wrong, dtype=np.float64)   # (Q,)
    draws = np.random.default_rng(seed).integers(0, len(diffs), size=(resamples, len(diffs)))
    means = diffs[draws].mean(axis=1)                                                    # (resamples,)
    tail = 100 * (1 - level) / 2
    return float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


def feedback_sensitivity(predictor: Predictor, task: ClassificationTask, target: str,
                         counts: Sequence[int] = (1, 4), n_queries: int = 40, seed: int = 0,
                         on_query: Callable[[], None] | None = None) -> dict:
    """The probe (module docstring): per condition the mean p(target) and p(gold) over the queries and each
    query's values, and per n > 0 the feedback effect and the gold gain after wrong, each with its 95% interval. `on_query` is called after each
    (query, condition) pair (progress bars)."""
    queries, pool = probe_examples(task, target, n_queries, seed)
    target_index = task.labels.index(target)
    results: dict[str, dict] = {}
    for condition in conditions(counts):
        p_target, p_gold = [], []
        for index, query in enumerate(queries):
            records = past_attempts(pool, target, condition, index, seed)
            context_ids, user_open = render_context(predictor.tokens, predictor.template, records, NAIVE_SHOW)
            p = label_distribution(predictor, context_ids, user_open, query.text, temperature=1.0)
            p_target.append(float(p[target_index]))
            p_gold.append(float(p[task.labels.index(query.label)]))
            if on_query:
                on_query()
        results[condition.name] = {**asdict(condition), "p_target": float(np.mean(p_target)),
                                   "p_gold": float(np.mean(p_gold)), "queries": len(queries),
                                   "p_target_per_query": p_target, "p_gold_per_query": p_gold}
    attempt_counts = sorted(set(counts) - {0})
    effect = {str(n): results[f"n{n}_right"]["p_target"] - results[f"n{n}_wrong"]["p_target"]
              for n in attempt_counts}
    interval = {str(n): effect_interval(results[f"n{n}_right"]["p_target_per_query"],
                                        results[f"n{n}_wrong"]["p_target_per_query"], seed)
                for n in attempt_counts}
    gold = {str(n): results[f"n{n}_wrong"]["p_gold"] - results["n0"]["p_gold"] for n in attempt_counts}
    gold_interval = {str(n): effect_interval(results[f"n{n}_wrong"]["p_gold_per_query"],
                                             results["n0"]["p_gold_per_query"], seed)
                     for n in attempt_counts}
    return {"task": task.name, "target": target, "queries": len(queries), "seed": seed, "conditions": results,
            "feedback_effect": effect, "feedback_effect_ci95": interval,
            "gold_after_wrong": gold, "gold_after_wrong_ci95": gold_interval}


def probe_size(counts: Sequence[int], n_queries: int) -> int:
    """(query, condition) pairs the probe scores."""
    return len(conditions(counts)) * n_queries

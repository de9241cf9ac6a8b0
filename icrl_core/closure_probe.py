"""Does a model answer a label its context lacks? The label-closure probe.

In explorative in-context RL a test query is answered after a context of rewarded episodes; when the query's gold
label has no episode there, the model must give a label it has not been shown. For each label X of a task and
each of `queries` probe queries (training examples, so held-out test queries never enter a choice), a context of
n episodes is drawn from the other training examples whose label is not X, rendered as the harness renders
rewarded attempts in the explorative view (the answer, then "'Y' is the correct answer! Good job!"). The probe
reads the harness's label distribution (`label_distribution`, temperature 1) and reports, per label X:

    absent_recall  = mean_{q: gold X}  p(X | context without X, q)
    present_recall = mean_{q: gold X}  p(X | the same context with its first episode replaced by one of label X, q)
    false_alarm    = mean_{q: gold != X} p(X | context without X, q)

and their means over the labels. A model closed over its context's labels gives absent_recall near 0 (it never
tries a label it has not seen, so explorative runs do not discover it and naive runs copy their first answers);
a model that reads the query gives the absent label mass when the query fits it (absent_recall well above
false_alarm). present_recall is the ordinary in-context use of one example, the reference.

Costs one forward pass per (query, condition) over a context of n episodes (a few minutes for 6 labels x 20
queries x 3 conditions at n = 20 on a CPU core for SmolLM2-135M).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from icrl_core.errors import UserError
from icrl_core.icrl_eval import EpisodeRecord, Predictor, Show, label_distribution, render_context
from icrl_core.task_data import ClassificationTask, Example

# The explorative view: the ICRL system prompt, rewarded attempts (the answer is the gold label), feedback turns.
EXPLORATIVE_SHOW = Show(system_with_feedback=True, answer="prediction", feedback=True)


@dataclass(frozen=True)
class ClosureDraw:
    """One probe query with its context (episodes without `label`) and the episode of `label` that replaces the
    context's first one in the present condition."""

    label: str
    query: Example
    context: list[Example]
    label_example: Example


def closure_draws(task: ClassificationTask, label: str, n_queries: int, episodes: int, seed: int,
                  ) -> tuple[list[ClosureDraw], list[ClosureDraw]]:
    """(draws whose query has gold `label`, draws whose query has another gold label): n_queries each, from the
    training split; every context holds `episodes` examples of other labels than `label`, none of them the query."""
    if label not in task.labels:
        raise UserError(f"label '{label}' is not a label of task '{task.name}'")
    if episodes < 1:
        raise UserError(f"the closure probe needs at least one context episode, got {episodes}")
    rng = random.Random(f"{seed}:{label}")
    own = [e for e in task.train if e.label == label]
    others = [e for e in task.train if e.label != label]
    if len(own) < n_queries + 1 or len(others) < n_queries + episodes:
        raise UserError(f"task '{task.name}' has too few training examples of label '{label}' ({len(own)}) or of "
                        f"the other labels ({len(others)}) for {n_queries} queries and {episodes} episodes")
    own_queries = rng.sample(own, n_queries + 1)
    other_queries = rng.sample(others, n_queries)
    label_example = own_queries.pop()

    def draw(query: Example) -> ClosureDraw:
        pool = [e for e in others if e is not query]
        return ClosureDraw(label, query, rng.sample(pool, episodes), label_example)

    return [draw(q) for q in own_queries], [draw(q) for q in other_queries]


def rewarded(examples: list[Example]) -> list[EpisodeRecord]:
    """Examples as rewarded attempts: answered with their gold label, feedback positive."""
    return [EpisodeRecord(i, e.text, e.label, e.label, 1, 1) for i, e in enumerate(examples)]


def label_closure(predictor: Predictor, task: ClassificationTask, n_queries: int = 20, episodes: int = 20,
                  seed: int = 0, on_query: Callable[[], None] | None = None) -> dict:
    """The probe (module docstring): per label and averaged over the labels."""
    per_label = {}
    for index, label in enumerate(task.labels):
        positives, negatives = closure_draws(task, label, n_queries, episodes, seed)

        def p_label(context: list[Example], query: Example, index: int = index) -> float:
            ids, user_open = render_context(predictor.tokens, task.template, rewarded(context), EXPLORATIVE_SHOW)
            p = label_distribution(predictor, ids, user_open, query.text, temperature=1.0)
            if on_query:
                on_query()
            return float(p[index])

        absent = [p_label(d.context, d.query) for d in positives]
        present = [p_label([d.label_example] + d.context[1:], d.query) for d in positives]
        false_alarm = [p_label(d.context, d.query) for d in negatives]
        per_label[label] = {"absent_recall": float(np.mean(absent)), "present_recall": float(np.mean(present)),
                            "false_alarm": float(np.mean(false_alarm)), "queries": n_queries}
    means = {key: float(np.mean([row[key] for row in per_label.values()]))
             for key in ("absent_recall", "present_recall", "false_alarm")}
    return {"task": task.name, "episodes": episodes, "queries": n_queries, "seed": seed, **means,
            "labels": per_label}

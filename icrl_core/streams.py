"""In-context RL streams as RL rollouts: the policy learns from the reward feedback in its own context.

A stream is one rollout: T queries of a few-way task drawn from the training tasks (the bootstrap's sampler:
`data.labels_per_episode` labels, real or opaque names, `data.permute_labels`). At step t the policy sees the
system prompt and every past (query, its own answer, feedback) turn, negative feedback included, rendered
exactly as the in-context RL harness renders its contexts (`icrl_eval.render_context` / `render_query` with the
naive strategy's view: every past episode, feedback shown). It answers by constrained decoding over the label
trie (the harness's rule: at each branching node one uniform draw inverted through softmax(logits[children] / T),
`icrl_eval.sample_child`), so trying a label that was never rewarded is one action among the others. The reward
is 1 for the gold label, else 0, and the feedback turn joins the context.

G streams of a group share the task and the query order (a group baseline compares answers to the same query);
they are generated together in one KV cache (`rollout.BatchedCache`), each stream's cache only growing.

Which past steps a step sees is `ppo.stream.context`: naive (every past step, the default) or explorative (the
harness's explorative strategy: rewarded past steps only, each kept with probability p_keep, drawn afresh at each
step). A naive stream is one token sequence whose prefixes are exactly the contexts of its steps, so ONE forward
pass over it gives every step's answer log-probs for the update (`stream_outputs`); an explorative stream's steps
each have their own sequence (context, query, answer), scored in the same pass as rows of their own:

    log pi(a_t | s_t) = sum over the decisions j of step t of log softmax(z_j[children_j] / T)[chosen_j]

where z_j is the LM head at the token before the decided one, restricted to the trie children of the node
decided there (forced tokens: one child, log-prob 0, no action). V(s_t) is the value head at the last prompt token
of step t (the position that predicts the answer's first token; the answer's own tokens would let the critic see
the action, making it a Q-value and a biased baseline).

Shapes: B streams, L tokens, T steps, A decisions (actions) of a stream, K the largest number of children, H the
hidden size.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from icrl_core.chat import Tokens
from icrl_core.config import DataConfig, NaiveStreamContext, StreamContext
from icrl_core.dataset_build import ResolvedSource, episode_labels, episode_rng
from icrl_core.errors import UserError
from icrl_core.icrl_eval import (
    EpisodeRecord,
    Explorative,
    Show,
    candidate_sequences,
    child_distribution,
    max_context_examples,
    render_context,
    render_query,
    sample_child,
)
from icrl_core.kernels import ROOT, LabelTrie
from icrl_core.prompting import PromptTemplate
from icrl_core.rollout import BatchedCache
from icrl_core.task_data import ClassificationTask, Example

# What the policy sees of its past steps: the harness's in-context RL view (system prompt with the feedback
# sentence, its own answers, the feedback turn after each).
STREAM_VIEW = Show(system_with_feedback=True, answer="prediction", feedback=True)


# ---------------------------------------------------------------------------------------------------------------
# Tasks


@dataclass(frozen=True)
class StreamTask:
    """The task of a group of streams: its candidate labels (the trie), template and the T queries in order;
    `tests`: held-out queries of the same labels scored after the streams' last step (`context_values`)."""

    name: str
    labels: tuple[str, ...]
    template: PromptTemplate
    queries: tuple[Example, ...]
    tests: tuple[Example, ...] = ()


def label_run_picks(pool: Sequence[Example], steps: int, rng: random.Random, repeat_label: float) -> list[int]:
    """Indices into `pool` of `steps` queries in label runs: after the first, each query has its predecessor's
    gold label with probability `repeat_label` (an unused example of that label while any is left), otherwise it
    is a uniform draw of the unused pool (as without runs). Runs last 1 / (1 - repeat_label) queries on average
    (plus chance repeats), so the feedback on one query tells the policy about the next one's label: a label
    marked wrong is probably wrong again, one marked right probably right."""
    by_label: dict[str, list[int]] = {}
    for i, example in enumerate(pool):
        by_label.setdefault(example.label, []).append(i)
    unused = set(range(len(pool)))
    picks: list[int] = []
    for _ in range(steps):
        if picks and rng.random() < repeat_label:
            same = by_label[pool[picks[-1]].label]
            candidates = [i for i in same if i in unused] or same
        else:
            candidates = sorted(unused) or list(range(len(pool)))
        pick = rng.choice(candidates)
        picks.append(pick)
        unused.discard(pick)
    return picks


def sample_stream_task(sources: Sequence[ResolvedSource], data: DataConfig, steps: int, seed: int, key: str,
                       split: str = "train", tests: int = 0, repeat_label: float = 0.0) -> StreamTask:
    """A task for one group, drawn like a bootstrap episode: a source by weight, its label subset
    (`episode_labels`: all labels, or `data.labels_per_episode`), a label renaming with `data.permute_labels`,
    then `steps` queries of those labels from the split's pool, and after them `tests` held-out ones (all without
    replacement while the pool lasts). Deterministic in (seed, key); tests=0 draws what it always drew.
    `repeat_label` > 0 orders the `steps` queries in label runs (`label_run_picks`); the tests are then uniform
    draws of the examples the steps left."""
    tasks = [s for s in sources if s.task is not None]
    if not tasks:
        raise UserError("stream rollouts need a task or synthetic source in data.sources (file sources carry no "
                        "label set to decode over)")
    rng = episode_rng(seed, key)
    source = rng.choices(tasks, weights=[s.weight for s in tasks])[0]
    task = source.task
    subset = episode_labels(task, rng, data)
    rename = dict(zip(task.labels, rng.sample(task.labels, len(task.labels)))) if data.permute_labels else {}
    allowed = set(subset)
    pool = [e for e in source.pools[split] if e.label in allowed]
    if not pool:
        raise UserError(f"task '{task.name}': its {split} split has no example of the labels {subset}")
    wanted = steps + tests
    if repeat_label > 0:
        picks = label_run_picks(pool, steps, rng, repeat_label)
        left = sorted(set(range(len(pool))) - set(picks))
        picks += rng.sample(left, tests) if len(left) >= tests else [rng.randrange(len(pool)) for _ in range(tests)]
    else:
        picks = rng.sample(range(len(pool)), wanted) if len(pool) >= wanted else [rng.randrange(len(pool))
                                                                                  for _ in range(wanted)]
    drawn = tuple(Example(pool[i].text, rename.get(pool[i].label, pool[i].label)) for i in picks)
    labels = tuple(rename.get(label, label) for label in subset)
    return StreamTask(task.name, labels, task.template, drawn[:steps], drawn[steps:])


# ---------------------------------------------------------------------------------------------------------------
# Streams


@dataclass(frozen=True)
class Decision:
    """One choice of constrained decoding: at stream index `position` the model read the next-token logits of
    the `candidates` (trie children) and the behaviour policy picked `candidates[chosen]` with log-prob `logp`."""

    position: int
    candidates: tuple[int, ...]
    chosen: int
    logp: float


@dataclass
class StreamStep:
    record: EpisodeRecord     # query, gold, prediction, reward, feedback (as the harness logs a step)
    answer_start: int         # index in its sequence of the answer's first token (the prompt is ids[:answer_start])
    answer_ids: tuple[int, ...]
    decisions: list[Decision]  # positions index the step's sequence
    sequence: int = 0         # which of the stream's sequences holds the step (naive: all in sequence 0)
    # the gold label has no rewarded episode in the step's context (a right answer would be a discovery)
    gold_absent: bool = False

    @property
    def reward(self) -> float:
        return float(self.record.reward)

    @property
    def novel(self) -> bool:
        """Answered right with a label no rewarded episode of its context holds (`discovery_rewards`)."""
        return bool(self.record.reward) and self.gold_absent

    @property
    def logp(self) -> float:
        """log of the answer's probability under the behaviour policy (the sum over its decisions)."""
        return sum(d.logp for d in self.decisions)


@dataclass
class Stream:
    task: StreamTask
    group: int
    # naive: one sequence, up to the last answer's end-of-turn token; explorative: one per step (its context,
    # query and answer up to its end of turn)
    sequences: list[list[int]]
    steps: list[StreamStep] = field(default_factory=list)
    # the leading queries of task.queries answered before the steps (ppo.stream.burn_in): their episodes are in
    # the steps' contexts, the steps are task.queries[burn_in:]
    burn_in: int = 0
    # every episode of the stream, burned-in ones included, and the context its held-out test queries see after
    # the last step (naive: every episode; explorative: every rewarded one, at most the window cap)
    history: list[EpisodeRecord] = field(default_factory=list)
    shown_at_end: list[int] = field(default_factory=list)
    # the expected accuracy of that context on task.tests (`context_values`); None: not measured
    test_value: float | None = None

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.steps]

    @property
    def input_ids(self) -> list[int]:
        """The token sequence of a naive stream (every step's context is a prefix of it)."""
        if len(self.sequences) != 1:
            raise ValueError("this stream's steps have contexts of their own (ppo.stream.context explorative): "
                             "it is not one sequence")
        return self.sequences[0]

    def context_ids(self, step: int) -> list[int]:
        """The prompt of `step`: what the policy saw before answering it."""
        record = self.steps[step]
        return self.sequences[record.sequence][:record.answer_start]


def restricted_logits(head, rows: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """LM-head logits of the candidate tokens only: out[n, k] = h_n . W[candidates[n, k]] (+ b).
    rows (N, H), candidates (N, K) long -> (N, K) float32 on the head's device. The 49k-token head is never
    computed."""
    rows, candidates = rows.to(head.weight.device), candidates.to(head.weight.device)
    weight = head.weight[candidates]                                   # (N, K, H)
    logits = (rows[:, None, :].to(weight.dtype) * weight).sum(-1).float()
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias[candidates].float()
    return logits


def stream_rng(seed: int, iteration: int, group: int, stream: int, redraw: int = 0) -> np.random.Generator:
    """The decoding draws of one stream (one uniform per decision, as the harness draws); `redraw` > 0: those of
    the group's redrawn task (ppo.stream.redraws), independent of the first draw's."""
    return np.random.default_rng([seed, iteration, group, stream, *([redraw] if redraw else [])])


def _walk_trie(cache: BatchedCache, hidden: torch.Tensor, trie: LabelTrie, head, rngs: Sequence[np.random.Generator],
               temperature: float, starts: Sequence[int]) -> tuple[list[list[int]], list[list[Decision]], list[int]]:
    """Decode one answer per row of `cache` (its rows fed their prompts; hidden (n, H) their last positions):
    walk the label trie, deciding at each branching node with the row's rng (the harness's rule), feeding each
    chosen token except a finished row's last. starts: each row's prompt length (decision positions index the
    row's sequence). -> (answer token ids, decisions, leaf node) per row."""
    n = len(rngs)
    node = [ROOT] * n
    answer: list[list[int]] = [[] for _ in range(n)]
    decisions: list[list[Decision]] = [[] for _ in range(n)]
    active = list(range(n))
    while active:
        branching = [g for g in active if len(trie.children[node[g]]) > 1]
        choice = {g: 0 for g in active}
        if branching:
            kids = [trie.children[node[g]] for g in branching]
            width = max(len(k) for k in kids)
            cand = torch.tensor([[trie.token[c] for c in k] + [trie.token[k[0]]] * (width - len(k))
                                 for k in kids], dtype=torch.long)
            logits = restricted_logits(head, hidden[branching], cand).cpu()
            for g, ks, row in zip(branching, kids, logits):
                values = row[:len(ks)].double().numpy()
                pick = sample_child(values, temperature, rngs[g])
                prob = float(child_distribution(values, temperature)[pick])
                choice[g] = pick
                decisions[g].append(Decision(starts[g] + len(answer[g]) - 1, tuple(trie.token[c] for c in ks),
                                             pick, math.log(prob)))
        for g in active:
            node[g] = trie.children[node[g]][choice[g]]
            answer[g].append(trie.token[node[g]])
        active = [g for g in active if not trie.is_leaf(node[g])]
        if active:  # the chosen tokens enter the cache; finished rows feed padding
            out = cache.feed([[answer[g][-1]] if g in active else [] for g in range(n)], logits=False)
            for row, g in enumerate(active):
                hidden[g] = out[row]
    return answer, decisions, node


def _walk_engine(engine, adapter: str | None, prompts: Sequence[Sequence[int]], shared: Sequence[int],
                 trie: LabelTrie, rngs: Sequence[np.random.Generator], temperature: float
                 ) -> tuple[list[list[int]], list[list[Decision]], list[int]]:
    """`_walk_trie` through an inference engine (icrl_core/inference): one `walk_tries` request per row, the
    same decision rule and draws (one per branching node, from the row's rng, in root-down order), the
    decisions' log-probs from the engine's node scores. prompts: each row's whole prompt; shared: the length of
    its context part (the engine's prefix-reuse hint). -> (answer token ids, decisions, leaf node) per row."""
    from icrl_core.inference.base import TrieRequest

    decisions: list[list[Decision]] = [[] for _ in prompts]

    def choose(row: int, node: int, scores: np.ndarray) -> int:
        values = np.asarray(scores, dtype=np.float64)
        pick = sample_child(values, temperature, rngs[row])
        prob = float(child_distribution(values, temperature)[pick])
        # the token before the decided one: the prompt's last (root) or the answer's depth-th so far
        decisions[row].append(Decision(len(prompts[row]) + trie.depth[node] - 1,
                                       tuple(trie.token[c] for c in trie.children[node]), pick, math.log(prob)))
        return pick

    requests = [TrieRequest(tuple(prompt), trie, adapter, shared_length=length)
                for prompt, length in zip(prompts, shared)]
    leaves = engine.walk_tries(requests, choose)
    answers = []
    for leaf in leaves:
        path, node = [], leaf
        while node != ROOT:
            path.append(trie.token[node])
            node = trie.parent[node]
        answers.append(path[::-1])
    return answers, decisions, leaves


def explorative_max_examples(tokens: Tokens, task: StreamTask, window: int) -> int:
    """How many episodes an explorative step of `task` may show: the harness's cap
    (`icrl_eval.max_context_examples`: the longest queries answered with the longest label and followed by the
    longer feedback, plus the longest query and answer, fit `window` tokens) over the stream's own queries, and
    never more than its queries. Streams whose kept episodes never reach it (12 queries) are not affected."""
    own = ClassificationTask(task.name, list(task.labels), list(task.queries), [], task.template)
    return min(len(task.queries), max_context_examples(own, tokens, STREAM_VIEW, window))


@torch.no_grad()
def generate_streams(policy, task: StreamTask, rngs: Sequence[np.random.Generator], temperature: float,
                     group: int = 0, max_tokens: int | None = None, context: StreamContext | None = None,
                     engine=None, adapter: str | None = None, burn_in: int = 0,
                     shared_burn_in: bool = False, burn_in_temperature: float | None = None) -> list[Stream]:
    """Run len(rngs) streams of `task` together: at each step render every stream's context (`context`: which
    past steps it shows; default naive, all of them) + query, walk the label trie deciding at each branching node
    with that stream's rng, reward the label, add the episode to its history. Naive streams share one KV cache in
    which each row only grows; explorative steps start a fresh one (their contexts are new subsets).

    The first `burn_in` queries are answered the same way and their episodes join the histories, but they are
    not steps of the returned streams (nothing of them is scored or credited): the steps see the context a
    stream has after `burn_in` answers of its own (R2D2's burn-in), without paying the update for them. With
    `shared_burn_in` only the first stream answers them (its draws), and every stream branches from that one
    history at the first trained step: the burn-in is decoded once, and the streams' steps start from the same
    context, so a group baseline compares their answers from the same state.
    `burn_in_temperature` (None: `temperature`) samples the burn-in answers: the trained steps may explore at a
    higher temperature than the one that made their context.

    With `engine` (an InferenceEngine, `ppo.stream.engine: inference`) the answers are decoded by it instead,
    `adapter` naming the weights it serves (None: the engine's own, e.g. a torch engine around `policy`): the
    same draws and decision rule, so the same answers up to the float rounding of another computation; the
    token sequences, rewards and decisions are recorded as above for the update, which `policy` computes."""
    if temperature <= 0 or (burn_in_temperature is not None and burn_in_temperature <= 0):
        raise UserError("stream rollouts sample their answers: the temperature must be > 0")
    if not 0 <= burn_in < len(task.queries):
        raise UserError(f"burn_in={burn_in} leaves no step of a {len(task.queries)}-query stream to train on")
    context = context or NaiveStreamContext()
    policy.eval()
    tokens: Tokens = policy.tokens
    template = task.template
    labels = list(task.labels)
    trie = LabelTrie.build(candidate_sequences(tokens, template, labels))
    head = policy.causal_lm.lm_head
    n = len(rngs)
    max_tokens = max_tokens or policy.context_window
    # explorative: each stream's context draws come from its own rng (drawn once, before its decoding draws); at
    # most the harness's window cap of episodes, so a long (burned-in) stream's contexts always fit
    cap = explorative_max_examples(tokens, task, max_tokens) if context.kind == "explorative" else 0
    selectors = ([Explorative(max_examples=cap, seed=int(rng.integers(2**31)), p_keep=context.p_keep)
                  for rng in rngs] if context.kind == "explorative" else None)
    histories: list[list[EpisodeRecord]] = [[] for _ in range(n)]
    fed: list[list[int]] = [[] for _ in range(n)]
    sequences: list[list[list[int]]] = [[] for _ in range(n)]
    steps: list[list[StreamStep]] = [[] for _ in range(n)]
    cache = None  # naive: one cache whose rows only grow (explorative: a fresh one per step; an engine: its own)
    for t, example in enumerate(task.queries):
        rows = [0] if shared_burn_in and t < burn_in else list(range(n))  # the streams decoding step t
        if shared_burn_in and t == burn_in and t > 0:  # branch: every stream from the first one's history
            histories = [list(histories[0]) for _ in range(n)]
            fed, cache = [[] for _ in range(n)], None  # naive: each row prefills the shared context once
        if cache is None and selectors is None and engine is None:
            cache = BatchedCache(policy, len(rows))
        news, shared, shown_labels = [], [], {}
        for g in rows:
            shown = (histories[g] if selectors is None
                     else [histories[g][i] for i in selectors[g].select(histories[g], t)])
            shown_labels[g] = {episode.prediction for episode in shown if episode.reward}
            context_ids, user_open = render_context(tokens, template, shown, STREAM_VIEW)
            prompt = list(context_ids) + render_query(tokens, template, example.text, user_open)
            shared.append(len(context_ids))
            if len(prompt) + trie.max_depth > max_tokens:
                raise UserError(f"a stream of {len(task.queries)} steps outgrows the {max_tokens}-token window at "
                                f"step {t}: use fewer ppo.stream.steps (or ppo.stream.burn_in)")
            if selectors is None:
                if prompt[:len(fed[g])] != fed[g]:  # the chat rendering must be concatenative (chat.Conversation)
                    raise RuntimeError("a stream's context is not an extension of its previous context")
                news.append(prompt[len(fed[g]):])
            else:
                news.append(prompt)
            fed[g] = prompt
        prompts = [fed[g] for g in rows]
        row_rngs = [rngs[g] for g in rows]
        step_temperature = temperature if t >= burn_in or burn_in_temperature is None else burn_in_temperature
        starts = [len(ids) for ids in prompts]
        if engine is not None:
            answer, decisions, leaf = _walk_engine(engine, adapter, prompts, shared, trie, row_rngs,
                                                   step_temperature)
        else:
            if selectors is not None:
                cache = BatchedCache(policy, len(rows))
            hidden = cache.feed(news, logits=False)                   # (rows, H): every row fed its prompt
            answer, decisions, leaf = _walk_trie(cache, hidden, trie, head, row_rngs, step_temperature, starts)
        for i, g in enumerate(rows):
            label = labels[trie.label_of_leaf[leaf[i]]]
            reward = int(label == example.label)
            record = EpisodeRecord(t, example.text, example.label, label, reward, reward)
            histories[g].append(record)
            absent = example.label not in shown_labels[g]
            if selectors is None:
                if t >= burn_in:
                    steps[g].append(StreamStep(record, starts[i], tuple(answer[i]), decisions[i],
                                               gold_absent=absent))
                fed[g] = fed[g] + answer[i][:-1]  # the cache holds these; the end of turn comes with the next block
            elif t >= burn_in:
                steps[g].append(StreamStep(record, starts[i], tuple(answer[i]), decisions[i],
                                           sequence=len(sequences[g]), gold_absent=absent))
                sequences[g].append(fed[g] + answer[i])
    if selectors is None:
        sequences = [[fed[g] + [steps[g][-1].answer_ids[-1]]] for g in range(n)]
    # what each view shows after the last step; explorative: every rewarded episode (p_keep 1, at most the window
    # cap), so the group's contexts there differ by their answers and not by p_keep's draws
    end = len(task.queries)
    every_rewarded = (Explorative(max_examples=cap, seed=selectors[0].seed, p_keep=1.0) if selectors is not None
                      else None)
    shown = [list(range(len(histories[g]))) if selectors is None else every_rewarded.select(histories[g], end)
             for g in range(n)]
    return [Stream(task, group, sequences[g], steps[g], burn_in, histories[g], shown[g]) for g in range(n)]


# ---------------------------------------------------------------------------------------------------------------
# What a stream's context is worth (ppo.stream.test_reward)


@torch.no_grad()
def context_values(policy, streams: Sequence[Stream], temperature: float) -> list[float]:
    """v of each stream: the mean, over its task's held-out queries x_j (task.tests, gold y_j), of

        v = 1/M sum_j pi(y_j | c_end, x_j)

    where c_end is the stream's context after its last step (`Stream.shown_at_end`: naive every episode,
    explorative every rewarded one, rendered as the steps' contexts are) and pi the constrained decoding at
    `temperature` (`path_logprob`): the expected test accuracy of that context, as the harness measures it, under
    the policy as it is now. Each stream's context is scored once and shared by its M queries (the exact torch
    engine's prefix cache). Sets `stream.test_value`."""
    from icrl_core.inference.base import TrieRequest
    from icrl_core.inference.torch_backend import TorchEngine

    if not streams or not streams[0].task.tests:
        raise ValueError("context_values needs streams whose task has held-out tests "
                         "(ppo.stream.test_reward.queries)")
    policy.eval()
    tokens: Tokens = policy.tokens
    engine = TorchEngine(policy)
    values = []
    try:
        for stream in streams:
            task = stream.task
            labels = list(task.labels)
            answers = candidate_sequences(tokens, task.template, labels)
            trie = LabelTrie.build(answers)
            shown = [stream.history[i] for i in stream.shown_at_end]
            context, user_open = render_context(tokens, task.template, shown, STREAM_VIEW)
            requests = [TrieRequest(tuple(context) + tuple(render_query(tokens, task.template, x.text, user_open)),
                                    trie, shared_length=len(context)) for x in task.tests]
            scores = engine.trie_logprobs(requests)
            probs = [math.exp(path_logprob(trie, scores[j], answers[labels.index(test.label)], temperature))
                     for j, test in enumerate(task.tests)]
            stream.test_value = sum(probs) / len(probs)
            values.append(stream.test_value)
    finally:
        engine.close()
    return values


# ---------------------------------------------------------------------------------------------------------------
# The in-context-learning teacher (context distillation)

# What the teacher sees: the ICL upper bound's view (system prompt without the feedback sentence, every past query
# answered with its gold label, no feedback turn).
TEACHER_VIEW = Show(system_with_feedback=False, answer="gold", feedback=False)


def path_logprob(trie: LabelTrie, scores: dict[int, np.ndarray], answer_ids: Sequence[int],
                 temperature: float) -> float:
    """log p(answer) under constrained decoding at `temperature`: the sum, over the branching nodes on the answer's
    path, of log softmax(scores[node] / T)[the child taken]. scores: node -> its children's scores (trie order)."""
    node, total = ROOT, 0.0
    for token in answer_ids:
        children = trie.children[node]
        index = next(i for i, child in enumerate(children) if trie.token[child] == token)
        if len(children) > 1:
            total += math.log(float(child_distribution(scores[node], temperature)[index]))
        node = children[index]
    return total


@torch.no_grad()
def teacher_logprobs(policy, streams: Sequence[Stream], temperature: float) -> torch.Tensor:
    """log pi_teacher(a_t) of every stream step (B, T), 0 past a stream's end: the policy's own weights shown the
    TEACHER_VIEW of every query before step t's (burned-in ones included), then its query, scoring the label the
    stream answered there.

    The G streams of a group share the task and the query order, and the teacher's context holds gold labels
    only, so step t's teacher context is the same for the whole group: the label trie is scored once per group
    and step, through the exact torch engine (its prefix cache reuses each step's context for the next)."""
    from icrl_core.inference.base import TrieRequest
    from icrl_core.inference.torch_backend import TorchEngine

    policy.eval()
    tokens: Tokens = policy.tokens
    engine = TorchEngine(policy)  # serves the policy as it is now (adapters on): same weights, other context
    out = torch.zeros((len(streams), max(len(s.steps) for s in streams)))
    members: dict[int, list[int]] = {}
    for b, stream in enumerate(streams):
        members.setdefault(stream.group, []).append(b)
    try:
        for rows in members.values():
            task = streams[rows[0]].task
            trie = LabelTrie.build(candidate_sequences(tokens, task.template, list(task.labels)))
            golds = [EpisodeRecord(t, q.text, q.label, q.label, 1, 1) for t, q in enumerate(task.queries)]
            first = streams[rows[0]].burn_in  # a group's streams share it: burned-in queries are not scored
            requests = []
            for t, query in enumerate(task.queries[first:], start=first):
                context, user_open = render_context(tokens, task.template, golds[:t], TEACHER_VIEW)
                prompt = tuple(context) + tuple(render_query(tokens, task.template, query.text, user_open))
                requests.append(TrieRequest(prompt, trie, shared_length=len(context)))
            scores = engine.trie_logprobs(requests)
            for b in rows:
                for t, step in enumerate(streams[b].steps):
                    out[b, t] = path_logprob(trie, scores[t], step.answer_ids, temperature)
    finally:
        engine.close()
    return out


# ---------------------------------------------------------------------------------------------------------------
# Streams as tensors, and the one-pass log-probs


@dataclass
class StreamBatch:
    """Padded streams. Token rows: input_ids, attention_mask (R, L), row_stream (R,) the stream of each row (a
    naive stream is one row, an explorative one a row per step). Per decision (B, A): action_row (its row),
    positions (index in that row of the token whose output predicts the decided token), chosen (index into the
    candidates), action_step (step of the decision), behaviour_logp, action_mask; candidates, candidate_mask
    (B, A, K). Per step (B, T): step_row, value_positions (last prompt token), rewards, answer_actions (decisions
    of the step), step_mask. groups (B,)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    row_stream: torch.Tensor
    action_row: torch.Tensor
    positions: torch.Tensor
    candidates: torch.Tensor
    candidate_mask: torch.Tensor
    chosen: torch.Tensor
    action_step: torch.Tensor
    behaviour_logp: torch.Tensor
    action_mask: torch.Tensor
    step_row: torch.Tensor
    value_positions: torch.Tensor
    rewards: torch.Tensor
    answer_actions: torch.Tensor
    step_mask: torch.Tensor
    groups: torch.Tensor

    def __len__(self) -> int:
        """The number of streams."""
        return self.positions.shape[0]

    def select(self, index: torch.Tensor) -> StreamBatch:
        """Streams `index` (in that order) and their rows, trimmed to their longest row and decision count."""
        index = index.long()
        rows = torch.nonzero(torch.isin(self.row_stream, index)).squeeze(1)
        new_row = torch.full((len(self.row_stream),), -1, dtype=torch.long)
        new_row[rows] = torch.arange(len(rows))
        new_stream = torch.full((len(self),), -1, dtype=torch.long)
        new_stream[index] = torch.arange(len(index))
        length = int(self.attention_mask[rows].sum(1).max())
        actions = max(int(self.action_mask[index].sum(1).max()), 1)
        return StreamBatch(
            self.input_ids[rows, :length], self.attention_mask[rows, :length], new_stream[self.row_stream[rows]],
            new_row[self.action_row[index, :actions]], self.positions[index, :actions],
            self.candidates[index, :actions], self.candidate_mask[index, :actions], self.chosen[index, :actions],
            self.action_step[index, :actions], self.behaviour_logp[index, :actions],
            self.action_mask[index, :actions], new_row[self.step_row[index]], self.value_positions[index],
            self.rewards[index], self.answer_actions[index], self.step_mask[index], self.groups[index])


def collate_streams(streams: Sequence[Stream], pad_id: int) -> StreamBatch:
    """Right-pad streams' sequences into rows of a StreamBatch. A padded decision gets one valid dummy candidate
    so its (masked-out) log-softmax stays finite; padded decisions and steps point at their stream's first row."""
    batch = len(streams)
    first_row = [0]
    for stream in streams:
        first_row.append(first_row[-1] + len(stream.sequences))
    sequences = [ids for stream in streams for ids in stream.sequences]
    length = max(len(ids) for ids in sequences)
    n_steps = max(len(s.steps) for s in streams)
    flat = [[(t, d) for t, step in enumerate(s.steps) for d in step.decisions] for s in streams]
    n_actions = max(max(len(f) for f in flat), 1)
    width = max((len(d.candidates) for f in flat for _, d in f), default=1)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), length), dtype=torch.long)
    for r, ids in enumerate(sequences):
        input_ids[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[r, :len(ids)] = 1
    row_stream = torch.tensor([b for b, stream in enumerate(streams) for _ in stream.sequences], dtype=torch.long)
    action_row = torch.tensor(first_row[:-1], dtype=torch.long)[:, None].repeat(1, n_actions)
    positions = torch.zeros((batch, n_actions), dtype=torch.long)
    candidates = torch.zeros((batch, n_actions, width), dtype=torch.long)
    candidate_mask = torch.zeros((batch, n_actions, width), dtype=torch.bool)
    candidate_mask[:, :, 0] = True
    chosen = torch.zeros((batch, n_actions), dtype=torch.long)
    action_step = torch.zeros((batch, n_actions), dtype=torch.long)
    behaviour = torch.zeros((batch, n_actions))
    action_mask = torch.zeros((batch, n_actions), dtype=torch.bool)
    step_row = torch.tensor(first_row[:-1], dtype=torch.long)[:, None].repeat(1, n_steps)
    value_positions = torch.zeros((batch, n_steps), dtype=torch.long)
    rewards = torch.zeros((batch, n_steps))
    answer_actions = torch.zeros((batch, n_steps))
    step_mask = torch.zeros((batch, n_steps), dtype=torch.bool)
    for b, stream in enumerate(streams):
        for a, (t, decision) in enumerate(flat[b]):
            k = len(decision.candidates)
            action_row[b, a] = first_row[b] + stream.steps[t].sequence
            positions[b, a] = decision.position
            candidates[b, a, :k] = torch.tensor(decision.candidates, dtype=torch.long)
            candidate_mask[b, a, :k] = True
            chosen[b, a] = decision.chosen
            action_step[b, a] = t
            behaviour[b, a] = decision.logp
            action_mask[b, a] = True
        for t, step in enumerate(stream.steps):
            step_row[b, t] = first_row[b] + step.sequence
            value_positions[b, t] = step.answer_start - 1
            rewards[b, t] = step.reward
            answer_actions[b, t] = len(step.decisions)
            step_mask[b, t] = True
    groups = torch.tensor([s.group for s in streams], dtype=torch.long)
    return StreamBatch(input_ids, attention, row_stream, action_row, positions, candidates, candidate_mask, chosen,
                       action_step, behaviour, action_mask, step_row, value_positions, rewards, answer_actions,
                       step_mask, groups)


def row_buckets(lengths: Sequence[int], max_padding: float = 0.25) -> list[list[int]]:
    """Rows grouped for separate passes so that little of a pass is padding: rows sorted longest first, each
    bucket taking the next row while its padded size (rows x its longest) stays within (1 + max_padding) x its
    real tokens. -> lists of row indices (every row once)."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    buckets: list[list[int]] = []
    current: list[int] = []
    real = 0
    for r in order:
        if current and (len(current) + 1) * lengths[current[0]] > (1 + max_padding) * (real + lengths[r]):
            buckets.append(current)
            current, real = [], 0
        current.append(r)
        real += lengths[r]
    if current:
        buckets.append(current)
    return buckets


def _row_states(policy, batch: StreamBatch, with_values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The hidden state at every decision's position, (B * A, H), and the value head at every step's value
    position, (B * T,) (None without a value head), from forward passes over the rows: one pass over all of them
    when each stream is one row (naive); when streams have several rows (explorative), one pass per `row_buckets`
    bucket, which keeps padding (and its compute) low since explorative contexts vary in length."""
    n_rows = batch.input_ids.shape[0]
    lengths = batch.attention_mask.sum(1)
    buckets = row_buckets(lengths.tolist()) if n_rows > len(batch) else [list(range(n_rows))]
    action_row, positions = batch.action_row.reshape(-1), batch.positions.reshape(-1)
    step_row, value_positions = batch.step_row.reshape(-1), batch.value_positions.reshape(-1)
    states = values = None
    for bucket in buckets:
        index = torch.tensor(bucket)
        length = int(lengths[index].max())
        mask = batch.attention_mask[index, :length]
        _, bucket_values, hidden = policy.forward(batch.input_ids[index, :length], mask,
                                                  logits_at=torch.zeros_like(mask, dtype=torch.bool),
                                                  with_values=with_values)              # hidden (r, l, H)
        local = torch.full((n_rows,), -1, dtype=torch.long)
        local[index] = torch.arange(len(bucket))
        take = torch.nonzero(local[action_row] >= 0).squeeze(1)                      # decisions of these rows
        part = hidden[local[action_row[take]].to(hidden.device), positions[take].to(hidden.device)]
        if states is None:
            states = hidden.new_zeros((len(action_row), hidden.shape[-1]))
        states = states.index_copy(0, take.to(hidden.device), part)
        if bucket_values is not None:
            take = torch.nonzero(local[step_row] >= 0).squeeze(1)
            part = bucket_values.cpu()[local[step_row[take]], value_positions[take]]
            values = (torch.zeros(len(step_row), dtype=part.dtype) if values is None else values).index_copy(
                0, take, part)
    return states, values


def stream_outputs(policy, batch: StreamBatch, temperature: float, with_values: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logp, entropy) of every decision under the constrained policy, each (B, A), and V(s_t) per step (B, T)
    (None without a value head); zero where masked. One forward pass over the streams' rows (`_row_states`).

        logp_j    = log softmax(z_j[children_j] / T)[chosen_j]
        entropy_j = -sum_k p_jk log p_jk  over the children"""
    rows, values = _row_states(policy, batch, with_values)                            # (B * A, H), (B * T,)
    n_batch, n_actions, width = batch.candidates.shape
    # The per-decision logits (B, A, K) come back to the CPU, where the losses on them run (autograd carries the
    # gradient back to the device): the heavy pass runs on the policy's device, the RL code is device-free.
    logits = restricted_logits(policy.causal_lm.lm_head, rows,
                               batch.candidates.reshape(n_batch * n_actions, width)).cpu()
    logits = logits.view(n_batch, n_actions, width)
    logits = (logits / temperature).masked_fill(~batch.candidate_mask, float("-inf"))
    log_probs = torch.log_softmax(logits, dim=-1)
    logp = log_probs.gather(-1, batch.chosen[:, :, None]).squeeze(-1)
    # p log p with 0 at the padded candidates (masked_fill, not where: 0 * -inf would poison the gradient)
    entropy = -(log_probs.exp() * log_probs.masked_fill(~batch.candidate_mask, 0.0)).sum(-1)
    maskf = batch.action_mask.to(logp.dtype)
    value = None
    if values is not None:
        value = values.view(batch.step_row.shape) * batch.step_mask.to(values.dtype)
    return logp * maskf, entropy * maskf, value


# ---------------------------------------------------------------------------------------------------------------
# Preference pairs from the policy's own streams


@dataclass(frozen=True)
class PreferencePair:
    """One context (a stream step's prompt) with a right answer (the gold label) and a wrong one (the label the
    policy gave there). chosen_ids / rejected_ids: the answers' tokens, end of turn included."""

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]
    chosen: str
    rejected: str


def mine_preference_pairs(streams: Sequence[Stream], tokens: Tokens) -> list[PreferencePair]:
    """(right, wrong) answer pairs in the same context: every stream step the policy answered wrong gives
    (prompt of that step, gold label, the policy's label). Steps it answered right give none (no wrong answer
    was observed in that context)."""
    pairs = []
    for stream in streams:
        template = stream.task.template
        for index, step in enumerate(stream.steps):
            record = step.record
            if record.reward:
                continue
            gold_ids, = candidate_sequences(tokens, template, [record.gold])
            pairs.append(PreferencePair(tuple(stream.context_ids(index)), tuple(gold_ids), step.answer_ids,
                                        record.gold, record.prediction))
    return pairs

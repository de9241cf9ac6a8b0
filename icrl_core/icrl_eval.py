"""The in-context RL protocol of Monea et al. (2024), "LLMs Are In-Context Reinforcement Learners".

Each step t:
  1. draw training query x_t (a fixed shuffled stream, `training_seed`);
  2. build a context from past episodes with the strategy (its randomness: numpy `default_rng(seed + t)`, as the
     paper's context generators do);
  3. predict a label y_t by constrained decoding: only valid label token sequences followed by end-of-turn, each
     token sampled from softmax(logits[valid children] / T) (T = 0: argmax);
  4. reward r_t = 1[y_t == gold]; the feedback shown in context is r_t, flipped with probability
     `flip_feedback_prob` (draw: `default_rng(seed + t).random()`, as the paper does), or left out
     (`omit_feedback`);
  5. at step 0, whenever (t + 1) % test_every == 0, and at the last step, predict the `test_k` test queries with
     the same context (test predictions never enter the history);
  6. append the episode (x_t, y_t, feedback) to the history.
Supervised ICL (`icrl` off) shows gold labels without feedback and makes no training predictions.

Everything here is pure: the model is reached through an inference engine (icrl_core/inference/: the torch
engine caches prefixes and packs candidates into tree passes, icrl_core.kernels). The protocol is a generator of step and test events; `tasks/icrl_eval.py` writes them.
Everything a resumed run needs is in its step log: strategies are replayed from the history (their random draws
are seeded per step), so a resumed run makes the same choices as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from icrl_core.chat import Conversation, Tokens
from icrl_core.config import EvalConfig
from icrl_core.errors import UserError
from icrl_core.inference.base import Choose, InferenceEngine, TrieRequest, branching_nodes
from icrl_core.inference.torch_backend import choose_expand, needed_nodes, walk_batch  # noqa: F401 (harness API)
from icrl_core.kernels import ROOT, LabelTrie, PrefixCache, TreeScorer
from icrl_core.prompting import PromptTemplate
from icrl_core.task_data import ClassificationTask, Example

# Independent random streams of constrained decoding (numpy SeedSequence entropy [seed + step, stream, index]).
# The context and flip draws use default_rng(seed + step) itself, exactly like the paper.
TRAIN_DECODE_STREAM = 1
TEST_DECODE_STREAM = 2


# ---------------------------------------------------------------------------------------------------------------
# History


@dataclass(frozen=True)
class EpisodeRecord:
    """One past step: the query, the model's prediction, its true reward and the feedback shown in context.
    In supervised ICL `prediction`, `reward` and `feedback` are None (the gold label is shown instead)."""

    step: int
    query: str
    gold: str
    prediction: str | None
    reward: int | None
    feedback: int | None


# ---------------------------------------------------------------------------------------------------------------
# Context strategies (src/icl/context_generators.py of lil-lab/icrl). One registry, small objects.


def _usable(record: EpisodeRecord, supervised: bool) -> bool:
    """Only-positive strategies keep episodes whose shown feedback is positive; gold episodes always count."""
    return supervised or record.feedback == 1


@dataclass
class Strategy:
    """Chooses which past episodes (history indices, in time order) form the context at a step."""

    max_examples: int
    seed: int
    supervised: bool = False

    def select(self, history: Sequence[EpisodeRecord], step: int) -> list[int]:
        raise NotImplementedError


@dataclass
class ZeroShot(Strategy):
    """No context at all."""

    def select(self, history, step):
        return []


@dataclass
class Naive(Strategy):
    """The paper's random_biased_end: keep each past episode with probability p_keep (one binomial draw per
    episode; p_keep 1 keeps all, the paper's naive runs), then the most recent `max_examples` of the kept.

    `evict` > 1 is a protocol variant for speed: once the context is full, the oldest `evict` episodes leave at
    once, and the context grows again for evict - 1 steps (it holds between max_examples - evict + 1 and
    max_examples episodes). The paper's sliding window (evict = 1) changes every position each step, so no cached
    key/value survives past the system prompt; a block eviction keeps the context a growing prefix between
    evictions, which the prefix cache reuses. Stateless: the start is a function of the number of kept episodes."""

    p_keep: float = 1.0
    only_positive: bool = False
    evict: int = 1

    def select(self, history, step):
        kept = [i for i, r in enumerate(history) if not self.only_positive or _usable(r, self.supervised)]
        if self.p_keep < 1:
            keep = np.random.default_rng(self.seed + step).binomial(1, self.p_keep, size=len(kept))
            kept = [i for i, flag in zip(kept, keep) if flag]
        if not self.max_examples:
            return []
        overflow = len(kept) - self.max_examples
        if overflow <= 0:
            return kept
        evict = min(self.evict, self.max_examples)
        return kept[-(-overflow // evict) * evict:]


@dataclass
class NaivePlus(Naive):
    """The paper's random_biased_end_only_positive: naive over positive episodes only (use a higher temperature
    to explore)."""

    only_positive: bool = True


@dataclass
class Explorative(Strategy):
    """The paper's random_unbiased_only_positive: keep each positive episode with probability p_keep (one
    binomial draw per episode), shuffle the kept ones, take the first `max_examples`, restore time order."""

    p_keep: float = 0.1
    only_positive: bool = True

    def select(self, history, step):
        rng = np.random.default_rng(self.seed + step)
        candidates = [i for i, r in enumerate(history) if not self.only_positive or _usable(r, self.supervised)]
        keep = rng.binomial(1, self.p_keep, size=len(candidates))
        chosen = rng.permutation(np.flatnonzero(keep == 1))[:self.max_examples]
        return [candidates[i] for i in np.sort(chosen)]


@dataclass
class SupervisedICL(Explorative):
    """The paper's ICL runs (random_unbiased, p_keep=1): a random subset of at most `max_examples` past episodes,
    in time order, all of them shown with their gold label."""

    p_keep: float = 1.0
    only_positive: bool = False


@dataclass
class Approximate(Strategy):
    """The paper's approximate_only_positive: `max_contexts` contexts grow over time; each new positive episode
    joins each non-full context with probability p_keep, and a context's log-probability accumulates
    log p_keep or log(1 - p_keep) for each such draw. One context is used per step, chosen uniformly or with
    probability proportional to exp(log-probability) ('likelihood', the paper's 'exact').

    Deviation: the paper re-offers its most recent *positive* episode at every step, so after a negative step a
    context can receive the same episode twice; here only the episode of the previous step is offered, once."""

    p_keep: float = 0.1
    max_contexts: int = 8
    sampling: str = "uniform"
    contexts: list[list[int]] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    _offered: int = 0  # history length already offered to the contexts

    def __post_init__(self):
        self.contexts = [[] for _ in range(self.max_contexts)]
        self.log_probs = [0.0] * self.max_contexts

    def select(self, history, step):
        if not 0 <= len(history) - self._offered <= 1:
            raise RuntimeError("Approximate.select must see every step in order (replay the history on resume)")
        rng = np.random.default_rng(self.seed + step)
        if history and len(history) > self._offered:
            index = len(history) - 1
            if _usable(history[index], self.supervised):
                for c, context in enumerate(self.contexts):
                    if len(context) >= self.max_examples:
                        continue
                    if rng.binomial(1, self.p_keep):
                        context.append(index)
                        self.log_probs[c] += math.log(self.p_keep)
                    else:
                        self.log_probs[c] += math.log1p(-self.p_keep) if self.p_keep < 1 else -math.inf
            self._offered = len(history)
        self.chosen = self._choose(rng)
        return list(self.contexts[self.chosen])

    def _choose(self, rng) -> int:
        if self.sampling == "uniform":
            return int(rng.choice(range(self.max_contexts)))
        logp = np.asarray(self.log_probs)
        probs = np.exp(logp - np.logaddexp.reduce(logp))
        return int(rng.choice(range(self.max_contexts), p=probs))


STRATEGIES: dict[str, Callable[..., Strategy]] = {
    "zero_shot": ZeroShot,
    "naive": Naive,
    "naive_plus": NaivePlus,
    "explorative": Explorative,
    "approximate": Approximate,
    "icl": SupervisedICL,
}


def is_supervised(cfg: EvalConfig) -> bool:
    """Supervised ICL (gold labels, no feedback, no training predictions): strategy 'icl' or icrl=false."""
    if cfg.strategy == "icl":
        if cfg.icrl is True:
            raise UserError("icrl_eval.strategy=icl (the paper's random_unbiased) is supervised ICL; it cannot run "
                        "with icrl_eval.icrl=true")
        return True
    return cfg.icrl is False


def make_strategy(cfg: EvalConfig, max_examples: int) -> Strategy:
    supervised = is_supervised(cfg)
    common = {"max_examples": max_examples, "seed": cfg.seed, "supervised": supervised}
    if cfg.strategy == "zero_shot":
        return ZeroShot(**common)
    if cfg.strategy == "approximate":
        return Approximate(**common, p_keep=cfg.p_keep_of("approximate"), max_contexts=cfg.max_contexts,
                           sampling=cfg.approximate_sampling)
    if cfg.strategy in ("naive", "naive_plus"):
        return STRATEGIES[cfg.strategy](**common, p_keep=cfg.p_keep_of(cfg.strategy), evict=cfg.evict_episodes)
    return STRATEGIES[cfg.strategy](**common, p_keep=cfg.p_keep_of(cfg.strategy))


# ---------------------------------------------------------------------------------------------------------------
# Prompt rendering: the same Conversation pieces as icrl_core.episodes._render (training episodes)


@dataclass(frozen=True)
class Show:
    """What the context shows of each past episode."""

    system_with_feedback: bool  # ICRL system prompt (also with omitted feedback, as in the paper)
    answer: str                 # 'prediction' (ICRL) or 'gold' (supervised)
    feedback: bool              # a feedback user turn after each prediction


def show_for(cfg: EvalConfig) -> Show:
    if cfg.strategy == "zero_shot":
        return Show(False, "gold", False)
    if is_supervised(cfg):
        return Show(False, "gold", False)
    return Show(True, "prediction", not cfg.omit_feedback)


def render_context(tokens: Tokens, template: PromptTemplate, episodes: Sequence[EpisodeRecord],
                   show: Show) -> tuple[list[int], bool]:
    """(token ids of system prompt + context episodes, whether the last user message is still open)."""
    conv = Conversation(tokens, separator=template.separator)
    conv.system(template.system(show.system_with_feedback))
    for record in episodes:
        answer = record.prediction if show.answer == "prediction" else record.gold
        conv.user(template.query(record.query))
        conv.assistant_answer(template.answer_prefix, answer)
        if show.feedback:
            conv.user(template.feedback(answer, record.feedback))
    return conv.ids, conv.user_open


def render_query(tokens: Tokens, template: PromptTemplate, query: str, user_open: bool) -> list[int]:
    """Token ids appended after a context: the query (joining an open feedback message) and the assistant turn
    opened up to the answer prefix ('Intent:'). Candidates continue from here."""
    conv = Conversation(tokens, separator=template.separator, user_open=user_open)
    conv.user(template.query(query))
    conv.assistant_prompt(template.answer_prefix)
    return conv.ids


def candidate_sequences(tokens: Tokens, template: PromptTemplate, labels: Sequence[str]) -> list[tuple[int, ...]]:
    """Each label as the paper's constrained decoding sees it: ' label' + end-of-turn."""
    conv = Conversation(tokens)
    return [conv.answer_ids(template.answer_prefix, label) for label in labels]


# ---------------------------------------------------------------------------------------------------------------
# Maximum number of in-context episodes (the paper's find_maximum_number_examples)


def max_context_examples(task: ClassificationTask, tokens: Tokens, show: Show, window: int) -> int:
    """Largest n such that a context of the n longest queries (train and test), each answered with the longest
    label and followed by the longer feedback, plus the longest query and the longest answer, fits `window`
    tokens. Binary search, as the paper's find_max_examples_given_max_window (which keeps a 5% margin and
    adds 1; here the fit is exact because every position is computed by us)."""
    template = task.template
    texts = sorted({e.text for e in task.train + task.test},
                   key=lambda t: (-len(tokens.encode(template.query(t))), t))
    answers = candidate_sequences(tokens, template, task.labels)
    longest_label = task.labels[max(range(len(answers)), key=lambda i: len(answers[i]))]
    longest_answer = max(len(a) for a in answers)
    feedback = max((0, 1), key=lambda r: len(tokens.encode(template.feedback(longest_label, r))))

    def prompt_length(n: int) -> int:
        episodes = [EpisodeRecord(i, texts[i], longest_label, longest_label, feedback, feedback) for i in range(n)]
        ids, user_open = render_context(tokens, template, episodes, show)
        return len(ids) + len(render_query(tokens, template, texts[0], user_open)) + longest_answer

    if prompt_length(0) > window:
        raise UserError(f"even a prompt without context ({prompt_length(0)} tokens) does not fit the window "
                        f"of {window} tokens")
    low, high = 0, len(texts)
    while low < high:
        mid = (low + high + 1) // 2
        if prompt_length(mid) <= window:
            low = mid
        else:
            high = mid - 1
    return low


# ---------------------------------------------------------------------------------------------------------------
# Constrained decoding over a cached context


def child_distribution(logits: np.ndarray, temperature: float) -> np.ndarray:
    """p = softmax(logits / T) over the allowed children (T = 0: all mass on the argmax)."""
    if temperature == 0:
        p = np.zeros(len(logits))
        p[int(np.argmax(logits))] = 1.0
        return p
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return p / p.sum()


def sample_child(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Index of the chosen child: argmax when T = 0, else one uniform draw inverted through the CDF of
    softmax(logits / T) (one draw per decision keeps the streams independent of batching)."""
    if temperature == 0:
        return int(np.argmax(logits))
    cdf = np.cumsum(child_distribution(logits, temperature))
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))


@dataclass
class Prediction:
    label: int
    prob: float  # probability of the whole label under constrained decoding at the given temperature


def sampler(temperature: float, rngs: Sequence[np.random.Generator], probs: list[float]) -> Choose:
    """The harness's choice at a branching node for an engine's walk: `sample_child` with request i's own random
    stream; multiplies probs[i] by the chosen child's probability."""
    def choose(i: int, node: int, scores: np.ndarray) -> int:
        pick = sample_child(scores, temperature, rngs[i])
        probs[i] *= float(child_distribution(scores, temperature)[pick])
        return pick
    return choose


def decode_batch(scorer: TreeScorer, queries: Sequence[Sequence[int]], trie: LabelTrie, temperature: float,
                 rngs: Sequence[np.random.Generator], expand: str) -> list[Prediction]:
    """Constrained decoding of several queries appended after one cached context (the torch engine's
    `walk_batch` with the harness's sampler; expand 'trie' or 'path')."""
    probs = [1.0] * len(queries)
    leaves = walk_batch(scorer, queries, trie, sampler(temperature, rngs, probs), expand)
    return [Prediction(trie.label_of_leaf[node], prob) for node, prob in zip(leaves, probs)]


def label_distribution(predictor: Predictor, context_ids: Sequence[int], user_open: bool, query: str,
                       temperature: float = 1.0) -> np.ndarray:
    """p(label) of every label (shape [labels]) when `query` follows the cached context and is answered by the
    harness's constrained decoding at `temperature`: the product, along the label's path in the trie, of
    softmax(logits / T) over the children at each branching node (a node with one child decides nothing).
    The engine scores the whole trie (`trie_logprobs`)."""
    trie = predictor.trie
    query_ids = render_query(predictor.tokens, predictor.template, query, user_open)
    (scores,) = predictor.engine.trie_logprobs([predictor.request(context_ids, query_ids)])
    step_prob: dict[int, float] = {}  # trie node -> probability of choosing it at its parent
    for node in branching_nodes(trie):
        for child, p in zip(trie.children[node], child_distribution(scores[node], temperature)):
            step_prob[child] = float(p)
    probs = np.zeros(len(predictor.labels))
    for leaf, label in trie.label_of_leaf.items():
        p, node = 1.0, leaf
        while node != ROOT:
            p *= step_prob.get(node, 1.0)
            node = trie.parent[node]
        probs[label] = p
    return probs


@dataclass
class Predictor:
    """Constrained decoding of the task's labels after cached contexts, through an inference engine.

    Given a policy and a PrefixCache (and no engine), it makes the torch engine over them; `engine` serves
    requests for the model `adapter` (None: the base model) instead."""

    policy: object
    tokens: Tokens
    template: PromptTemplate
    labels: list[str]
    cache: PrefixCache | None
    temperature: float
    expand: str = "auto"
    batch_tokens: int = 1024
    engine: InferenceEngine | None = None
    adapter: str | None = None
    trie: LabelTrie = field(init=False)

    def __post_init__(self):
        self.trie = LabelTrie.build(candidate_sequences(self.tokens, self.template, self.labels))
        if self.engine is None:
            from icrl_core.inference.torch_backend import TorchEngine

            self.engine = TorchEngine(self.policy, cache=self.cache, expand=self.expand,
                                      batch_tokens=self.batch_tokens, adapter=self.adapter)
        self.expand = choose_expand(self.trie, getattr(self.engine, "expand", self.expand))

    def request(self, context_ids: Sequence[int], query_ids: Sequence[int]) -> TrieRequest:
        return TrieRequest(tuple(context_ids) + tuple(query_ids), self.trie, self.adapter, len(context_ids))

    def predict(self, context_ids: Sequence[int], user_open: bool, queries: Sequence[str],
                rngs: Sequence[np.random.Generator], temperature: float | None = None,
                ) -> tuple[list[Prediction], int]:
        """(predictions, tokens computed). The engine reuses the cached context and packs the queries into passes
        (torch: of about `batch_tokens` new tokens; without reuse each query recomputes the whole prompt, the
        reference baseline). `temperature` overrides the predictor's for this call (the test predictions' own)."""
        temperature = self.temperature if temperature is None else temperature
        requests = [self.request(context_ids, render_query(self.tokens, self.template, q, user_open))
                    for q in queries]
        probs = [1.0] * len(queries)
        before = self.engine.tokens_computed
        leaves = self.engine.walk_tries(requests, sampler(temperature, rngs, probs))
        computed = self.engine.tokens_computed - before
        return [Prediction(self.trie.label_of_leaf[leaf], p) for leaf, p in zip(leaves, probs)], computed


def decode_rng(seed: int, step: int, stream: int, index: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed + step, stream, index])


def flip_draw(seed: int, step: int) -> float:
    """The paper's generate_random_float(seed + step)."""
    return float(np.random.default_rng(seed + step).random())


# ---------------------------------------------------------------------------------------------------------------
# The protocol


@dataclass
class StepEvent:
    step: int
    query: str
    gold: str
    prediction: str | None
    reward: int | None
    feedback: int | None
    prob: float | None
    context: list[int]          # history indices (= steps) of the in-context episodes
    context_tokens: int         # tokens of system prompt + context
    prompt_tokens: int          # context + query: what recomputing the whole prompt would feed
    tokens_computed: int        # tokens fed through the model for this step (new prefix + query + candidates)
    seconds: float

    def to_record(self) -> EpisodeRecord:
        return EpisodeRecord(self.step, self.query, self.gold, self.prediction, self.reward, self.feedback)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class EvaluationEvent:
    step: int
    accuracy: float
    predictions: list[str]
    context_size: int
    context_tokens: int
    prompt_tokens: int          # sum over test queries of context + query tokens (the no-reuse cost)
    tokens_computed: int
    seconds: float

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class DebugEvent:
    step: int
    prompt: str


def evaluation_steps(train_k: int, test_every: int) -> list[int]:
    """Step 0, every step t with (t + 1) % test_every == 0 (the paper's rule), and the last step."""
    steps = {0, train_k - 1} | {t for t in range(train_k) if (t + 1) % test_every == 0}
    return sorted(s for s in steps if 0 <= s < train_k)


# A redacted step event holds `query_sha256` instead of `query`; its history record holds this prefix + the digest
# until run_protocol puts the text back from the training stream.
REDACTED_QUERY = "sha256:"


def query_digest(text: str) -> str:
    """The first 16 hex digits of the SHA-256 of a query's text (UTF-8): names the query without holding it."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def redact_step_event(event: dict) -> dict:
    """A logged step event without its query text (`query_sha256` in its place), for a run log that must not hold
    a dataset's text (e.g. one committed to a repository). `run_protocol` resumes from it as from the original:
    the text comes back from the training stream, checked against the digest."""
    if "query" not in event:
        return dict(event)
    redacted = {k: v for k, v in event.items() if k != "query"}
    return {"step": event["step"], "query_sha256": query_digest(event["query"]), **redacted}


def history_from_events(events: Sequence[dict]) -> list[EpisodeRecord]:
    """The history from logged step events (resume); a redacted event's query is its digest until replayed."""
    return [EpisodeRecord(e["step"], e["query"] if "query" in e else REDACTED_QUERY + e["query_sha256"], e["gold"],
                          e["prediction"], e["reward"], e["feedback"])
            for e in events]


def run_protocol(predictor: Predictor, task: ClassificationTask, cfg: EvalConfig, max_examples: int,
                 history: Sequence[EpisodeRecord] = (), clock: Callable[[], float] = time.perf_counter,
                 ) -> Iterator[StepEvent | EvaluationEvent | DebugEvent]:
    """Run (or continue, given the logged `history`) the protocol; yield each step's events as they happen:
    an EvaluationEvent (at test steps) before its StepEvent. The strategy is replayed over the given history."""
    supervised = is_supervised(cfg)
    show = show_for(cfg)
    train: list[Example] = task.training_stream(cfg.train_k, cfg.training_seed)
    test: list[Example] = task.test_set(cfg.test_k, cfg.test_seed)
    strategy = make_strategy(cfg, max_examples)
    history = list(history)
    for step, record in enumerate(history):  # replay: stateful strategies see every step again
        text = train[step].text
        if record.step != step or record.query not in (text, REDACTED_QUERY + query_digest(text)):
            raise UserError(f"the step log does not match this configuration at step {step} (different task, "
                            "train_k or training_seed?)")
        history[step] = replace(record, query=text)  # a redacted log's text comes back from the stream
        strategy.select(history[:step], step)
    tests = set(evaluation_steps(cfg.train_k, cfg.test_every))
    tokens, template = predictor.tokens, predictor.template
    for step in range(len(history), cfg.train_k):
        started = clock()
        example = train[step]
        context = strategy.select(history, step)
        context_ids, user_open = render_context(tokens, template, [history[i] for i in context], show)
        prediction = reward = feedback = prob = None
        computed = 0
        if not supervised:
            (pred,), computed = predictor.predict(context_ids, user_open, [example.text],
                                                  [decode_rng(cfg.seed, step, TRAIN_DECODE_STREAM)])
            prediction, prob = task.labels[pred.label], pred.prob
            reward = int(prediction == example.label)
            feedback = reward
            if cfg.flip_feedback_prob > 0 and flip_draw(cfg.seed, step) < cfg.flip_feedback_prob:
                feedback = 1 - reward
        query_ids = render_query(tokens, template, example.text, user_open)
        if step < cfg.debug_k:
            yield DebugEvent(step, tokens.decode(list(context_ids) + query_ids))
        step_seconds = clock() - started
        if step in tests:
            test_started = clock()
            rngs = [decode_rng(cfg.seed, step, TEST_DECODE_STREAM, i) for i in range(len(test))]
            preds, test_computed = predictor.predict(context_ids, user_open, [e.text for e in test], rngs,
                                                     cfg.test_temperature)
            labels = [task.labels[p.label] for p in preds]
            accuracy = sum(lb == e.label for lb, e in zip(labels, test)) / len(test)
            test_prompt = sum(len(context_ids) + len(render_query(tokens, template, e.text, user_open))
                              for e in test)
            yield EvaluationEvent(step, accuracy, labels, len(context), len(context_ids), test_prompt, test_computed,
                            clock() - test_started)
        event = StepEvent(step, example.text, example.label, prediction, reward, feedback, prob, context,
                          len(context_ids), len(context_ids) + len(query_ids), computed, step_seconds)
        history.append(event.to_record())
        yield event


# repeat_after_wrong at or above this reads as a collapse: every recorded naive run on trec_coarse sat either at
# 0.99-1.0 (one answer throughout) or at 0.46-0.74 (kept switching), none between (experiments/icrl_stream_rl).
COLLAPSED_REPEAT_AFTER_WRONG = 0.95


def repeat_rates(steps: Sequence[dict]) -> dict:
    """How often the next answer repeats the last one, after the last answer's feedback said wrong and after it
    said right (the feedback the model saw; it equals the reward unless flip_feedback_prob > 0):

        repeat_after_wrong = #{t : feedback_t = 0 and answer_{t+1} = answer_t} / #{t : feedback_t = 0}

    and likewise for feedback 1. Near 1.0 after wrong answers the run has collapsed to copying one answer, and its
    test accuracy is that label's test share, not in-context learning. None when a run has no such step pair
    (zero-shot and ICL runs answer no training query)."""
    answered = [s for s in steps if s.get("prediction") is not None and s.get("reward") is not None]
    pairs = {0: [0, 0], 1: [0, 0]}   # feedback -> [repeats, pairs]
    for last, step in itertools.pairwise(answered):
        counts = pairs[int(last.get("feedback", last["reward"]) > 0)]
        counts[0] += step["prediction"] == last["prediction"]
        counts[1] += 1
    return {f"repeat_after_{name}": round(repeats / total, 4) if total else None
            for name, (repeats, total) in (("wrong", pairs[0]), ("right", pairs[1]))}


def summarize(steps: Sequence[dict], tests: Sequence[dict]) -> dict:
    """Run metrics: running train accuracy, regret (cumulative errors), how often an answer is repeated after
    wrong and after right feedback (repeat_rates), test accuracy at each evaluation, tokens processed and wall time
    (from the logged events)."""
    rewards = [s["reward"] for s in steps if s.get("reward") is not None]
    return {
        **repeat_rates(steps),
        "steps": len(steps),
        "train_accuracy": (sum(rewards) / len(rewards)) if rewards else None,
        "regret": (len(rewards) - sum(rewards)) if rewards else None,
        "test_accuracy": {int(t["step"]): t["accuracy"] for t in tests},
        "final_test_accuracy": tests[-1]["accuracy"] if tests else None,
        "tokens_processed": sum(s["tokens_computed"] for s in steps) + sum(t["tokens_computed"] for t in tests),
        "train_tokens_processed": sum(s["tokens_computed"] for s in steps),
        "test_tokens_processed": sum(t["tokens_computed"] for t in tests),
        "seconds": sum(s["seconds"] for s in steps) + sum(t["seconds"] for t in tests),
    }


def behaviour(steps: Sequence[dict], tests: Sequence[dict], window: int) -> dict:
    """How a run behaved, to tell learning from collapse: per window of `window` training steps, the accuracy,
    how often each label was predicted and rewarded, the mean probability of the sampled answer (near 1: the
    policy no longer explores), how often an answer after wrong feedback repeats the last one (repeat_rates; near
    1: copying whatever the reward) and the mean context size; per evaluation, the test accuracy and the test answers'
    label counts. `top_share` is the most predicted label's share (1.0: every answer is one label)."""
    if window < 1:
        raise UserError(f"window must be >= 1, got {window}")
    predicted = [s for s in steps if s.get("prediction") is not None]
    windows = []
    for start in range(0, len(predicted), window):
        chunk = predicted[start:start + window]
        counts = Counter(s["prediction"] for s in chunk)
        windows.append({
            "first_step": chunk[0]["step"], "last_step": chunk[-1]["step"],
            "accuracy": sum(s["reward"] for s in chunk) / len(chunk),
            "predictions": dict(counts.most_common()),
            "rewarded": dict(Counter(s["prediction"] for s in chunk if s["reward"]).most_common()),
            "top_share": counts.most_common(1)[0][1] / len(chunk),
            # pairs within the window: the step before its first one counts in the previous window
            "repeat_after_wrong": repeat_rates(chunk)["repeat_after_wrong"],
            "mean_answer_prob": float(np.mean([s["prob"] for s in chunk])) if "prob" in chunk[0] else None,
            "mean_context_episodes": float(np.mean([len(s.get("context", [])) for s in chunk])),
        })
    evaluations = []
    for t in tests:
        counts = Counter(t["predictions"])
        evaluations.append({"step": t["step"], "accuracy": t["accuracy"], "context_size": t["context_size"],
                            "predictions": dict(counts.most_common()),
                            "top_share": counts.most_common(1)[0][1] / len(t["predictions"]) if counts else None})
    return {"windows": windows, "evaluations": evaluations}

"""Stage 1: build ICRL training episodes (pure: sources + seed + config -> episodes; no I/O but reading sources).

Sources (config `data.sources`, mixed by weight):
- `task`: a labelled classification task (`load_task`): exemplars are gold (text, label) pairs; each query's
  preferred answer is its gold label, the rejected answer a wrong label (sampled, or the model's own wrong
  prediction with `data.rejected=model`, see `model_rejected_answers`).
- `synthetic`: a task generated in code from the seed (keyword_map, modular_sum), same construction.
- `file`: a user's episodes JSONL, validated with `read_episodes` (a bad file raises before anything is built).

Episodic randomization: per episode, k ~ U[k_exemplars_min, k_exemplars] and n ~ U[n_queries_min, n_queries];
exemplars are shuffled. Each episode has its own RNG seeded from (seed, episode_id), so an episode does not
change when others are added or removed.

Learnable in context: with probability `data.query_support` a query gets a *support exemplar*: an example with
the same key as the query. The key is the keyword for keyword_map (the label is a function of the keyword, so
the context then holds the answer), the label for every other task (a same-intent example, the closest thing
to "the answer is in the context" a real task has). `data.permute_labels` gives each episode its own random
relabeling of the label names, so the answer can only come from the context.

Rejected answers are random wrong labels; with `data.hard_negatives` = p, a wrong label that the context shows
is chosen with probability p (a hard negative: an answer that "copy a label from the context" would give).

`data.exemplar_style=feedback`: exemplars are past attempts with rewards, correct (reward 1) with probability
`feedback_accuracy`, otherwise a wrong label (reward 0); `render_episode` writes the feedback after each one
exactly as the in-context RL harness does ("'X' is the correct answer! Good job!" / "The answer 'X' is wrong!
You can do better!"). With `data.collapsed_history` = p, an episode is instead, with probability p, a collapsed
history: every attempt gives the same random label of the episode (rewarded where it is the gold label), as the
context of a naive in-context RL run that has collapsed onto one label looks; its queries keep their gold answers.

Split: an episode is in validation when the first 8 bytes of sha256(episode_id), read as a fraction, are below
`val_fraction` (stable across runs and across changes to other episodes). Task/synthetic validation episodes
are drawn from the task's test examples and training episodes from its training examples, so no query text is
shared between the splits.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from icrl_core.chat import Tokens
from icrl_core.config import DataConfig, FileSource, SyntheticSource, TaskSource
from icrl_core.episodes import Episode, Exemplar, Query, read_episodes, render_episode
from icrl_core.errors import EpisodeTooLongError, UserError
from icrl_core.task_data import SYNTHETIC_TASKS, ClassificationTask, Example, load_task

SPLITS = ("train", "val")


# ---------------------------------------------------------------------------------------------------------------
# Sources


@dataclass
class ResolvedSource:
    """A configured source with its data loaded: a task (task/synthetic) or a list of episodes (file)."""

    name: str  # e.g. "synthetic:keyword_map", "task:banking77", "file:my.jsonl"
    weight: float
    task: ClassificationTask | None = None
    episodes: list[Episode] | None = None
    pools: dict[str, list[Example]] = field(default_factory=dict)  # split -> examples episodes draw from

    @property
    def labels(self) -> list[str] | None:
        return self.task.labels if self.task is not None else None


def resolve_sources(data: DataConfig, seed: int) -> list[ResolvedSource]:
    """Load every source. Raises `UserError` (e.g. `EpisodeFileError` listing every bad line) before anything
    is built, so a bad input never leaves a partial dataset behind."""
    resolved = []
    for source in data.sources:
        if isinstance(source, FileSource):
            resolved.append(ResolvedSource(f"file:{source.path}", source.weight,
                                           episodes=read_episodes(source.path)))
            continue
        if isinstance(source, SyntheticSource) and source.name not in SYNTHETIC_TASKS:
            raise UserError(f"data.sources: '{source.name}' is not a synthetic task; synthetic tasks: "
                            f"{', '.join(SYNTHETIC_TASKS)} (use kind: task for the classification datasets)")
        assert isinstance(source, (TaskSource, SyntheticSource))
        task = load_task(source.name, data.tasks_dir, seed=seed, prompt=data.prompt_of(source.name))
        resolved.append(ResolvedSource(f"{source.kind}:{source.name}", source.weight, task=task,
                                       pools={"train": task.train, "val": task.test}))
    names = [s.name for s in resolved]
    if len(set(names)) != len(names):
        raise UserError(f"data.sources lists the same source twice: {names}")
    return resolved


def allocate(weights: Sequence[float], total: int) -> list[int]:
    """Split `total` episodes in proportion to `weights` (largest remainder, ties to the earlier source)."""
    norm = sum(weights)
    exact = [w / norm * total for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def split_of(episode_id: str, val_fraction: float) -> str:
    """'val' when the hash of the id, as a fraction in [0, 1), is below `val_fraction`."""
    digest = hashlib.sha256(episode_id.encode("utf-8")).digest()
    return "val" if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else "train"


def episode_rng(seed: int, episode_id: str) -> random.Random:
    """An RNG of its own for each episode (stable when other episodes change)."""
    return random.Random(hashlib.sha256(f"{seed}:{episode_id}".encode()).hexdigest())


# ---------------------------------------------------------------------------------------------------------------
# Task episodes


def _keyword_of(example: Example) -> str:
    # keyword_map inputs read "I saw a <keyword> <filler>." (icrl_core.task_data.keyword_map)
    words = example.text.split()
    return words[3].rstrip(".") if len(words) > 3 else example.text


# Task name -> what an exemplar must share with a query to reveal its answer. Default: the label.
SUPPORT_KEYS: dict[str, Callable[[Example], str]] = {"keyword_map": _keyword_of}


def support_key(task_name: str) -> Callable[[Example], str]:
    return SUPPORT_KEYS.get(task_name, lambda example: example.label)


def _index_by_key(pool: list[Example], key: Callable[[Example], str]) -> dict[str, list[int]]:
    index: dict[str, list[int]] = defaultdict(list)
    for i, example in enumerate(pool):
        index[key(example)].append(i)
    return index


def draw_count(rng: random.Random, low: int | None, high: int) -> int:
    return high if low is None else rng.randint(min(low, high), high)


def episode_labels(task: ClassificationTask, rng: random.Random, data: DataConfig) -> list[str]:
    """The labels an episode draws from: all of the task's, or a random subset (`data.labels_per_episode`)."""
    if data.labels_per_episode is None or data.labels_per_episode >= len(task.labels):
        return list(task.labels)
    count = draw_count(rng, data.labels_per_episode_min, data.labels_per_episode)
    return rng.sample(task.labels, min(count, len(task.labels)))


def dirichlet(rng: random.Random, alpha: float, size: int) -> list[float]:
    """A draw from the symmetric Dirichlet(alpha) on `size` categories (normalised Gamma(alpha) draws)."""
    draws = [rng.gammavariate(alpha, 1.0) for _ in range(size)]
    total = sum(draws)
    return [d / total for d in draws] if total > 0 else [1.0 / size] * size


def make_task_episode(task: ClassificationTask, pool: list[Example], key_index: dict[str, list[int]],
                      episode_id: str, rng: random.Random, data: DataConfig,
                      label_index: dict[str, list[int]] | None = None) -> Episode:
    """One episode from a classification task: k exemplars (support exemplars first, then random ones, then
    shuffled) and n queries from `pool`; preferred = gold label, rejected = a random wrong label.

    With `data.labels_per_episode`, everything is drawn from the examples of a random label subset; with
    `data.label_skew`, the random exemplars follow Dirichlet label proportions (`label_index`: label -> pool
    indices, needed by both)."""
    k = draw_count(rng, data.k_exemplars_min, data.k_exemplars)
    n = draw_count(rng, data.n_queries_min, data.n_queries)
    subset = episode_labels(task, rng, data)
    if label_index is None and (len(subset) < len(task.labels) or data.label_skew is not None):
        label_index = _index_by_key(pool, lambda example: example.label)
    allowed = (range(len(pool)) if len(subset) == len(task.labels)
               else [i for lb in subset for i in label_index[lb]])  # type: ignore[index]
    if len(allowed) < n + k:
        raise UserError(f"task '{task.name}': {len(allowed)} examples cannot make an episode of {k} exemplars and "
                        f"{n} queries")
    rename = dict(zip(task.labels, rng.sample(task.labels, len(task.labels)))) if data.permute_labels else None

    def label(example: Example) -> str:
        return rename[example.label] if rename else example.label

    key = support_key(task.name)
    query_idx = rng.sample(allowed, n)
    used = set(query_idx)
    exemplar_idx: list[int] = []
    for qi in query_idx:
        if len(exemplar_idx) >= k or rng.random() >= data.query_support:
            continue
        candidates = [i for i in key_index[key(pool[qi])] if i not in used]
        if candidates:
            pick = rng.choice(candidates)
            exemplar_idx.append(pick)
            used.add(pick)
    weights = dirichlet(rng, data.label_skew, len(subset)) if data.label_skew is not None else None
    while len(exemplar_idx) < k:
        pick = rng.choice(allowed)
        if weights is not None:
            same_label = label_index[rng.choices(subset, weights)[0]]  # type: ignore[index]
            if not used.issuperset(same_label):  # else that label is used up: any allowed example
                pick = rng.choice(same_label)
        if pick not in used:
            exemplar_idx.append(pick)
            used.add(pick)
    rng.shuffle(exemplar_idx)

    # the episode's labels (a permutation renames labels within the same set)
    labels = list(task.labels) if len(subset) == len(task.labels) else [label(Example("", lb)) for lb in subset]

    def wrong_label(gold: str) -> str:
        return rng.choice([lb for lb in labels if lb != gold])

    # a collapsed history: every attempt gives one label (drawn only when enabled, so other builds are unchanged)
    collapsed = (rng.choice(labels) if data.exemplar_style == "feedback" and data.collapsed_history > 0
                 and rng.random() < data.collapsed_history else None)
    exemplars = []
    for i in exemplar_idx:
        gold = label(pool[i])
        if collapsed is not None:
            exemplars.append(Exemplar(prompt=pool[i].text, answer=collapsed, reward=float(collapsed == gold)))
        elif data.exemplar_style == "feedback":
            correct = rng.random() < data.feedback_accuracy
            exemplars.append(Exemplar(prompt=pool[i].text, answer=gold if correct else wrong_label(gold),
                                      reward=1.0 if correct else 0.0))
        else:
            exemplars.append(Exemplar(prompt=pool[i].text, answer=gold))
    in_context = sorted({ex.answer for ex in exemplars})

    def rejected_label(gold: str) -> str:
        # a hard negative: a label the context shows, so only the query's own evidence tells it apart
        hard = [lb for lb in in_context if lb != gold]
        if data.hard_negatives > 0 and hard and rng.random() < data.hard_negatives:
            return rng.choice(hard)
        return wrong_label(gold)

    queries = [Query(prompt=pool[i].text, preferred_answer=label(pool[i]),
                     rejected_answer=rejected_label(label(pool[i]))) for i in query_idx]
    return Episode(episode_id=episode_id, task_type=task.name, exemplars=exemplars, queries=queries,
                   metadata={"k": k, "n": n} | ({"collapsed_label": collapsed} if collapsed is not None else {}))


# ---------------------------------------------------------------------------------------------------------------
# Building


@dataclass
class BuiltEpisode:
    episode: Episode
    source: str
    split: str


def build_episodes(sources: list[ResolvedSource], data: DataConfig, seed: int,
                   progress: Callable[[Iterable], Iterable] = lambda it: it) -> list[BuiltEpisode]:
    """`data.num_episodes` episodes mixed from `sources` by weight (file sources give at most what they hold)."""
    if min(data.k_exemplars, data.k_exemplars_min if data.k_exemplars_min is not None else data.k_exemplars) < 1:
        raise UserError("data.k_exemplars (and k_exemplars_min) must be >= 1: an ICRL episode needs at least one "
                        "exemplar")
    counts = allocate([s.weight for s in sources], data.num_episodes)
    jobs: list[tuple[ResolvedSource, int]] = [(s, i) for s, c in zip(sources, counts) for i in range(c)]
    key_indexes: dict[tuple[str, str], dict[str, list[int]]] = {}
    label_indexes: dict[tuple[str, str], dict[str, list[int]]] = {}
    file_orders: dict[str, list[Episode]] = {}
    built = []
    for source, index in progress(jobs):
        if source.episodes is not None:
            order = file_orders.get(source.name)
            if order is None:  # a seeded shuffle of the file, taken from the front
                order = list(source.episodes)
                random.Random(f"{seed}:{source.name}").shuffle(order)
                file_orders[source.name] = order
            if index >= len(order):
                continue
            episode = order[index]
            built.append(BuiltEpisode(episode, source.name, split_of(episode.episode_id, data.val_fraction)))
            continue
        assert source.task is not None
        episode_id = f"{source.task.name}-{seed}-{index:06d}"
        split = split_of(episode_id, data.val_fraction)
        pool = source.pools[split]
        cache_key = (source.name, split)
        if cache_key not in key_indexes:
            key_indexes[cache_key] = _index_by_key(pool, support_key(source.task.name))
            label_indexes[cache_key] = _index_by_key(pool, lambda example: example.label)
        episode = make_task_episode(source.task, pool, key_indexes[cache_key], episode_id,
                                    episode_rng(seed, episode_id), data, label_indexes[cache_key])
        built.append(BuiltEpisode(episode, source.name, split))
    seen: dict[str, str] = {}
    for item in built:
        other = seen.setdefault(item.episode.episode_id, item.source)
        if other != item.source:
            raise UserError(f"episode_id '{item.episode.episode_id}' occurs in {other} and {item.source}; rename the "
                            "file's episodes")
    return built


def model_rejected_answers(built: list[BuiltEpisode], sources: list[ResolvedSource],
                           predict: Callable[[Episode, list[str]], list[str]]) -> tuple[list[BuiltEpisode], dict]:
    """`data.rejected=model`: replace each query's rejected answer by the model's own prediction when it is
    wrong; keep the sampled one when the model is right. `predict(episode, labels)` returns one label per query.
    File episodes keep their own rejected answers (their label set is unknown)."""
    labels_of = {s.name: s.labels for s in sources}
    stats = Counter()
    out = []
    for item in built:
        labels = labels_of.get(item.source)
        if labels is None:
            out.append(item)
            continue
        episode = item.episode
        predictions = predict(episode, labels)
        queries = []
        for query, predicted in zip(episode.queries, predictions):
            if predicted != query.preferred_answer:
                query = Query(prompt=query.prompt, preferred_answer=query.preferred_answer, rejected_answer=predicted)
                stats["model_wrong"] += 1
            else:
                stats["model_right"] += 1
            queries.append(query)
        out.append(BuiltEpisode(episode.model_copy(update={"queries": queries}), item.source, item.split))
    return out, dict(stats)


# ---------------------------------------------------------------------------------------------------------------
# Token budget and the dataset card


@dataclass
class BudgetResult:
    kept: list[BuiltEpisode]
    tokens: dict[str, int]  # episode_id -> rendered length
    shaved: list[str]  # ids of episodes that lost exemplars
    too_long: list[str]  # messages of episodes dropped because their queries alone do not fit


def apply_budget(built: list[BuiltEpisode], tokens: Tokens, max_tokens: int, train_exemplars: bool = True,
                 progress: Callable[[Iterable], Iterable] = lambda it: it) -> BudgetResult:
    """Render every episode with the model's tokenizer; drop exemplars from the front of episodes over the
    budget (the stored episode is the shaved one, so the file holds exactly what is trained on); drop episodes
    whose queries alone do not fit."""
    kept, lengths, shaved, too_long = [], {}, [], []
    for item in progress(built):
        try:
            rendered = render_episode(item.episode, tokens, max_tokens, train_exemplars=train_exemplars)
        except EpisodeTooLongError as exc:
            too_long.append(str(exc))
            continue
        episode = item.episode
        if rendered.shaved:
            shaved.append(episode.episode_id)
            episode = episode.model_copy(update={"exemplars": list(episode.exemplars[rendered.exemplars_dropped:])})
        kept.append(BuiltEpisode(episode, item.source, item.split))
        lengths[episode.episode_id] = len(rendered.input_ids)
    return BudgetResult(kept, lengths, shaved, too_long)


def dataset_card(result: BudgetResult, data: DataConfig, seed: int, tokenizer_name: str,
                 extra: dict | None = None) -> dict:
    """Counts per source/task/split, tokens, shaved episodes, k/n histograms, label balance of preferred and
    rejected answers, and (feedback style) the share of positive exemplars."""
    per_source = Counter(item.source for item in result.kept)
    per_task = Counter(item.episode.task_type or "-" for item in result.kept)
    per_split = Counter(item.split for item in result.kept)
    k_hist = Counter(len(item.episode.exemplars) for item in result.kept)
    n_hist = Counter(len(item.episode.queries) for item in result.kept)
    preferred = Counter(q.preferred_answer for item in result.kept for q in item.episode.queries)
    rejected = Counter(q.rejected_answer for item in result.kept for q in item.episode.queries)
    rewards = [ex.reward for item in result.kept for ex in item.episode.exemplars if ex.reward is not None]
    hard = [q.rejected_answer in {ex.answer for ex in item.episode.exemplars}
            for item in result.kept for q in item.episode.queries]
    lengths = list(result.tokens.values())
    by_split = defaultdict(int)
    for item in result.kept:
        by_split[item.split] += result.tokens[item.episode.episode_id]
    card = {
        "episodes": len(result.kept),
        "seed": seed,
        "tokenizer": tokenizer_name,
        "episode_tokens_budget": data.episode_tokens,
        "splits": {s: per_split.get(s, 0) for s in SPLITS},
        "per_source": dict(sorted(per_source.items())),
        "per_task": dict(sorted(per_task.items())),
        "queries": sum(n_hist[n] * n for n in n_hist),
        "tokens": {"total": sum(lengths), "per_split": dict(by_split), "mean": round(sum(lengths) / len(lengths), 1)
                   if lengths else 0, "min": min(lengths, default=0), "max": max(lengths, default=0)},
        "shaved_episodes": len(result.shaved),
        "dropped_too_long": len(result.too_long),
        "k_histogram": {str(k): v for k, v in sorted(k_hist.items())},
        "n_histogram": {str(n): v for n, v in sorted(n_hist.items())},
        "label_balance": {"preferred": dict(preferred.most_common()), "rejected": dict(rejected.most_common())},
        "exemplar_style": data.exemplar_style,
        "positive_exemplar_share": round(sum(r > 0 for r in rewards) / len(rewards), 4) if rewards else None,
        "rejected_in_context_share": round(sum(hard) / len(hard), 4) if hard else None,
        "query_support": data.query_support,
        "permute_labels": data.permute_labels,
        "rejected": data.rejected,
    }
    card.update(extra or {})
    return card


def card_markdown(card: dict) -> str:
    """The card as a short Markdown page (the JSON card is the machine-readable one)."""

    def table(title: str, counts: dict, head: str = "value") -> list[str]:
        rows = [f"### {title}", "", f"| {head} | episodes |", "|---|---|"]
        rows += [f"| {k} | {v} |" for k, v in counts.items()]
        return rows + [""]

    tok = card["tokens"]
    lines = [
        "# Dataset card", "",
        f"- episodes: {card['episodes']} (train {card['splits']['train']}, val {card['splits']['val']}), "
        f"queries: {card['queries']}",
        f"- tokens ({card['tokenizer']}): total {tok['total']}, mean {tok['mean']}, min {tok['min']}, max {tok['max']} "
        f"(budget {card['episode_tokens_budget']})",
        f"- shaved episodes: {card['shaved_episodes']}; dropped (queries alone too long): {card['dropped_too_long']}",
        f"- exemplar style: {card['exemplar_style']}"
        + (f" (positive share {card['positive_exemplar_share']})" if card["positive_exemplar_share"] is not None
           else ""),
        f"- query support probability: {card['query_support']}; per-episode label permutation: "
        f"{card['permute_labels']}; rejected answers: {card['rejected']} (shown in the context for "
        f"{card['rejected_in_context_share']} of queries)", "",
    ]
    lines += table("Per source", card["per_source"], "source")
    lines += table("Per task", card["per_task"], "task")
    lines += table("Exemplars per episode (k)", card["k_histogram"], "k")
    lines += table("Queries per episode (n)", card["n_histogram"], "n")
    top = dict(list(card["label_balance"]["preferred"].items())[:20])
    lines += ["### Preferred answers (top 20)", "", "| label | queries |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in top.items()] + [""]
    return "\n".join(lines)


def group_by_split(kept: list[BuiltEpisode]) -> dict[str, list[Episode]]:
    """Episodes per split, in build order."""
    by_split: dict[str, list[Episode]] = {s: [] for s in SPLITS}
    for item in kept:
        by_split[item.split].append(item.episode)
    return by_split


# ---------------------------------------------------------------------------------------------------------------
# The model's own predictions (data.rejected=model)


def label_log_likelihoods(policy, prompt_ids: Sequence[int], candidates: Sequence[Sequence[int]]):
    """log p(candidate | prompt) = sum_j log p(c_j | prompt, c_<j) for each candidate token sequence.

    One pass over the prompt with a KV cache, then all candidates in one batch on the repeated cache
    (right-padded, so padding never influences a real token). Returns a float tensor (C,)."""
    import torch

    with torch.no_grad():
        device = policy.device
        prompt = torch.tensor([list(prompt_ids)], device=device)
        out = policy.causal_lm(input_ids=prompt, use_cache=True)
        first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)  # (V,) predicts each candidate's token 0
        cache = out.past_key_values
        n_cand, width = len(candidates), max(len(c) for c in candidates)
        ids = torch.full((n_cand, width), policy.tokenizer.pad_token_id, dtype=torch.long)
        valid = torch.zeros((n_cand, width), dtype=torch.bool)
        for i, cand in enumerate(candidates):
            ids[i, :len(cand)] = torch.tensor(list(cand))
            valid[i, :len(cand)] = True
        ids, valid = ids.to(device), valid.to(device)
        cache.batch_repeat_interleave(n_cand)
        seen_prompt = torch.ones((n_cand, prompt.shape[1]), dtype=torch.long, device=device)
        attention = torch.cat([seen_prompt, valid.long()], dim=1)
        logits = policy.causal_lm(input_ids=ids, attention_mask=attention, past_key_values=cache).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1)  # (C, L-1, V): predicts candidate tokens 1..L-1
        token_logp = torch.cat([first[ids[:, :1]], logp.gather(-1, ids[:, 1:, None]).squeeze(-1)], dim=1)
        return (token_logp * valid).sum(dim=1).cpu()


def policy_predictor(policy, train_exemplars: bool = True) -> Callable[[Episode, list[str]], list[str]]:
    """predict(episode, labels) -> the most likely label for each query, each query seen in its episode's
    context (earlier queries with their preferred answers, as rendered for training)."""
    from icrl_core.chat import Conversation
    from icrl_core.prompting import template_for

    tokens = policy.tokens

    def predict(episode: Episode, labels: list[str]) -> list[str]:
        template = template_for(episode.task_type)
        conv = Conversation(tokens, separator=template.separator)
        candidates = [conv.answer_ids(template.answer_prefix, label) for label in labels]
        rendered = render_episode(episode, tokens, 10**9, template, train_exemplars)
        out = []
        for span in rendered.queries:
            scores = label_log_likelihoods(policy, rendered.input_ids[:span.start], candidates)
            out.append(labels[int(scores.argmax())])
        return out

    return predict

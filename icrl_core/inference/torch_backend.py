"""The `torch` inference engine: the exact reference (transformers on `model.device`, fp32; inputs are built on
the CPU and moved in kernels.model_forward, scores come back to the CPU).

Requests are grouped by model (adapter) and shared context (`shared_length`); each group's context is prepared in
a pool of key/value caches (kernels.PrefixCache: only tokens after the longest cached prefix are computed) and
its requests' own tokens (the queries) are appended as branches of one tree pass (kernels.TreeScorer), followed
by the candidate answers: the whole needed trie ('trie') or, pass by pass, only the chosen path ('path'). Every
number equals what a plain left-to-right pass over the whole prompt gives (kernels' docstring), so predictions
are those of recomputing every prompt from scratch (`reuse=False` does exactly that: the baseline).

Concurrency: each calling thread (an evaluation stream) has its own prefix caches and token counter, so several
streams share one copy of the weights; torch releases the GIL inside its kernels, so streams on different cores
run in parallel. With `fuse_streams` the passes of the streams registered by `stream()` are fused into one
ragged pass (icrl_core/inference/fused.py): faster on a CPU, not bit-identical (exact=False).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from icrl_core.inference.base import Choose, ContinuationRequest, TrieRequest
from icrl_core.kernels import ROOT, LabelTrie, PrefixCache, TreeScorer, chain_nodes, model_forward


def needed_nodes(trie: LabelTrie) -> list[int]:
    """Inner trie nodes whose hidden state is needed: those with a branching node at or below them. A chain that
    never branches again is decided already, so it is not fed."""
    branching_below = [False] * len(trie.token)
    for node in reversed(range(1, len(trie.token))):
        if len(trie.children[node]) > 1:
            branching_below[node] = True
        if branching_below[node] and trie.parent[node] > 0:
            branching_below[trie.parent[node]] = True
    return [n for n in trie.inner_nodes if branching_below[n]]


def choose_expand(trie: LabelTrie, expand: str) -> str:
    """'auto': the full trie when it adds at most 32 nodes per query, else token paths."""
    if expand != "auto":
        return expand
    return "trie" if len(needed_nodes(trie)) <= 32 else "path"


def _place_queries(scorer: TreeScorer, queries: Sequence[Sequence[int]], trie: LabelTrie, full_trie: bool,
                   ) -> tuple[list[tuple[int, int]], list[dict[int, int]]]:
    """(nodes to feed, per query {trie node -> scorer node}): each query as a chain after the prefix, its last
    token standing for the trie's root, and (full_trie) the trie's needed nodes below it."""
    needed = needed_nodes(trie) if full_trie else []
    nodes: list[tuple[int, int]] = []
    where: list[dict[int, int]] = []
    for query in queries:
        first = len(scorer) + len(nodes)
        nodes += chain_nodes(query, first)
        placed = {ROOT: first + len(query) - 1}
        for trie_node in needed:  # parents come before their children
            placed[trie_node] = len(scorer) + len(nodes)
            nodes.append((trie.token[trie_node], placed[trie.parent[trie_node]]))
        where.append(placed)
    return nodes, where


def _scores(values: torch.Tensor) -> np.ndarray:
    return values.double().numpy()


def walk_batch(scorer: TreeScorer, queries: Sequence[Sequence[int]], trie: LabelTrie, choose: Choose,
               expand: str) -> list[int]:
    """Constrained decoding of several queries appended after one cached context; the leaf each query reaches.

    expand='trie': one pass feeds every query and its needed trie nodes (each query's trie hangs under its last
    token); then the walk down the trie reads logits that are all computed already.
    expand='path': one pass feeds the queries; each further pass feeds, per unfinished query, the chosen token
    chain down to its next branching node. Cheaper than the full trie when there are many labels.
    `choose(query index, node, scores)` picks a child at each branching node (scores: the children's logits)."""
    nodes, where = _place_queries(scorer, queries, trie, expand == "trie")
    scorer.extend(nodes)
    current = [ROOT] * len(queries)
    done = [False] * len(queries)
    while not all(done):
        # Decide every query that has logits at its current node.
        pending = [q for q in range(len(queries)) if not done[q]]
        ready = [q for q in pending if current[q] in where[q]]
        if ready:
            kids = [trie.children[current[q]] for q in ready]
            logits = scorer.candidate_logits([where[q][current[q]] for q in ready],
                                              [[trie.token[k] for k in ks] for ks in kids])
            for q, ks, lg in zip(ready, kids, logits):
                pick = choose(q, current[q], _scores(lg)) if len(ks) > 1 else 0  # one child: nothing to decide
                node = ks[pick]
                while len(trie.children[node]) == 1:  # forced: only one way on
                    node = trie.children[node][0]
                current[q] = node
                done[q] = trie.is_leaf(node)
            continue
        # expand == 'path': feed the chosen chains down to each query's next branching node.
        feed: list[tuple[int, int]] = []
        for q in pending:
            chain = []
            node = current[q]
            while node not in where[q]:
                chain.append(node)
                node = trie.parent[node]
            for trie_node in reversed(chain):
                where[q][trie_node] = len(scorer) + len(feed)
                feed.append((trie.token[trie_node], where[q][trie.parent[trie_node]]))
        scorer.extend(feed)
    return current


def score_batch(scorer: TreeScorer, queries: Sequence[Sequence[int]], trie: LabelTrie) -> list[dict[int, np.ndarray]]:
    """Per query, {branching node -> its children's logits}: one pass feeds every query and its needed trie nodes."""
    nodes, where = _place_queries(scorer, queries, trie, True)
    scorer.extend(nodes)
    branching = [node for node in where[0] if len(trie.children[node]) > 1] if where else []
    out = []
    for placed in where:
        logits = scorer.candidate_logits([placed[node] for node in branching],
                                         [[trie.token[k] for k in trie.children[node]] for node in branching])
        out.append({node: _scores(values) for node, values in zip(branching, logits)})
    return out


@dataclass
class _Stream:
    """What one calling thread owns: its prefix caches (one pool per model) and its token counter."""

    caches: dict
    tokens_computed: int = 0


class TorchEngine:
    """The exact reference engine (module docstring). `policies`: the loaded models by adapter key (None: the base
    model); a request naming another adapter folder loads it (policy_from_config) once."""

    name = "torch"
    exact = True
    concurrent = True

    def __init__(self, policy, *, adapter: str | None = None, cache_entries: int = 2, reuse: bool = True,
                 chunk_tokens: int = 1024, batch_tokens: int = 1024, expand: str = "auto", model_config=None,
                 cache: PrefixCache | None = None, fuse_streams: bool = False):
        from icrl_core.inference.fused import StreamBatcher, supports_ragged

        if fuse_streams and not supports_ragged(policy):
            raise ValueError("inference.fuse_streams needs a Llama-architecture model")
        self.batcher = StreamBatcher() if fuse_streams else None
        self.exact = not fuse_streams
        self._forward = self.batcher.forward if self.batcher else model_forward
        self.policies = {adapter: policy}
        self.cache_entries = cache_entries
        self.reuse = cache.reuse if cache is not None else reuse
        self.chunk_tokens = cache.chunk_tokens if cache is not None else chunk_tokens
        self.batch_tokens = batch_tokens
        self.expand = expand
        self.model_config = model_config
        self._local = threading.local()
        self._lock = threading.Lock()
        self._given_cache = (adapter, cache)  # a caller-made pool (tests, probes) serves its thread's requests
        self._streams: list[_Stream] = []

    @classmethod
    def from_config(cls, config, policy=None) -> TorchEngine:
        """An engine for config.model (its init_adapter as the default model) with the icrl_eval cache settings."""
        cfg = config.icrl_eval
        adapter = str(config.model.init_adapter) if config.model.init_adapter is not None else None
        if policy is None:
            policy = _load_policy(config.model, adapter)
        entries = cfg.cache_entries or (cfg.max_contexts + 1 if cfg.strategy == "approximate" else 2)
        return cls(policy, adapter=adapter, cache_entries=entries, reuse=cfg.reuse_cache,
                   chunk_tokens=cfg.chunk_tokens, batch_tokens=cfg.batch_tokens, expand=cfg.expand,
                   model_config=config.model, fuse_streams=config.inference.fuse_streams)

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Serve the calling thread as one evaluation stream: with fuse_streams its passes join the fused ones
        (the batcher waits for registered streams); on exit its prefix caches are dropped."""
        if self.batcher:
            self.batcher.register()
        try:
            yield
        finally:
            if self.batcher:
                self.batcher.unregister()
            self.forget()

    # -- per-thread state ------------------------------------------------------------------------------------

    def _stream(self) -> _Stream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = _Stream({})
            with self._lock:
                if self._given_cache[1] is not None:  # the first thread to ask gets the caller-made pool
                    stream.caches[self._given_cache[0]] = self._given_cache[1]
                    self._given_cache = (None, None)
                self._streams.append(stream)
            self._local.stream = stream
        return stream

    @property
    def tokens_computed(self) -> int:
        """Tokens fed through the model for the calling thread's requests (a running total)."""
        return self._stream().tokens_computed

    def policy(self, adapter: str | None):
        if adapter not in self.policies:
            with self._lock:
                if adapter not in self.policies:
                    if self.model_config is None:
                        raise ValueError(f"no model for adapter {adapter!r} (the engine has no model config)")
                    self.policies[adapter] = _load_policy(self.model_config, adapter)
        return self.policies[adapter]

    def prefix_cache(self, adapter: str | None) -> PrefixCache:
        stream = self._stream()
        if adapter not in stream.caches:
            stream.caches[adapter] = PrefixCache(self.policy(adapter), capacity=self.cache_entries,
                                                 reuse=self.reuse, chunk_tokens=self.chunk_tokens,
                                                 forward=self._forward)
        return stream.caches[adapter]

    def forget(self) -> None:
        """Drop the calling thread's prefix caches (a stream that has finished)."""
        stream = self._stream()
        stream.caches.clear()

    # -- the interface ---------------------------------------------------------------------------------------

    def _batches(self, requests: Sequence, per_request_cost) -> list[tuple[str | None, tuple[int, ...], list[int]]]:
        """(adapter, context, request indices) passes: requests grouped by model and context (first-seen order),
        packed into passes of about `batch_tokens` new tokens (one request per pass without reuse: the baseline
        feeds every prompt on its own)."""
        groups: dict[tuple, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault((request.adapter, _split(request)[0]), []).append(index)
        passes = []
        for (adapter, context), indices in groups.items():
            batch: list[int] = []
            budget = 0
            for index in indices:
                cost = per_request_cost(requests[index])
                if batch and (budget + cost > self.batch_tokens or not self.reuse):
                    passes.append((adapter, context, batch))
                    batch, budget = [], 0
                batch.append(index)
                budget += cost
            passes.append((adapter, context, batch))
        return passes

    def _scorer(self, adapter: str | None, context: tuple[int, ...]) -> TreeScorer:
        entry, computed = self.prefix_cache(adapter).prepare(context)
        self._stream().tokens_computed += computed
        return TreeScorer(self.policy(adapter), entry.cache, len(context), forward=self._forward)

    def walk_tries(self, requests: Sequence[TrieRequest], choose: Choose) -> list[int]:
        leaves: list[int | None] = [None] * len(requests)
        if not requests:
            return []
        expand = {id(r.trie): choose_expand(r.trie, self.expand) for r in requests}

        def cost(request):
            nodes = len(needed_nodes(request.trie)) if expand[id(request.trie)] == "trie" else request.trie.max_depth
            return len(_split(request)[1]) + nodes

        for adapter, context, batch in self._batches(requests, cost):
            for trie, members in _by_trie(requests, batch):
                with self._scorer(adapter, context) as scorer:
                    reached = walk_batch(scorer, [_split(requests[i])[1] for i in members], trie,
                                         lambda q, node, scores, m=members: choose(m[q], node, scores),
                                         expand[id(trie)])
                    self._stream().tokens_computed += scorer.computed
                for i, leaf in zip(members, reached):
                    leaves[i] = leaf
        return leaves

    def trie_logprobs(self, requests: Sequence[TrieRequest]) -> list[dict[int, np.ndarray]]:
        out: list[dict | None] = [None] * len(requests)
        cost = lambda request: len(_split(request)[1]) + len(needed_nodes(request.trie))
        for adapter, context, batch in self._batches(requests, cost):
            for trie, members in _by_trie(requests, batch):
                with self._scorer(adapter, context) as scorer:
                    scored = score_batch(scorer, [_split(requests[i])[1] for i in members], trie)
                    self._stream().tokens_computed += scorer.computed
                for i, scores in zip(members, scored):
                    out[i] = scores
        return out

    @torch.no_grad()
    def continuation_logprobs(self, requests: Sequence[ContinuationRequest]) -> list[list[np.ndarray]]:
        """Each request in its own tree pass: its own tokens as a chain after the cached context, then every
        continuation as a chain below the last prompt token; the vocabulary-wide head at those nodes."""
        out = []
        for request in requests:
            context, own = _split(request)
            with self._scorer(request.adapter, context) as tree:
                nodes = chain_nodes(own, 0)
                root = len(nodes) - 1
                chains = []
                for continuation in request.continuations:
                    chains.append(list(range(len(nodes), len(nodes) + len(continuation))))
                    nodes += chain_nodes(continuation, len(nodes), parent=root)
                tree.extend(nodes)
                rows = [root] + [n for chain in chains for n in chain]
                head = self.policy(request.adapter).causal_lm.lm_head
                logprobs = torch.log_softmax(head(tree.hidden_rows(rows)).float(), dim=-1)  # (len(rows), V)
                self._stream().tokens_computed += tree.computed
            row_of = {node: r for r, node in enumerate(rows)}
            scores = []
            for continuation, chain in zip(request.continuations, chains):
                # token t is predicted at its parent: the last prompt token for t = 0, else chain node t - 1
                at = [row_of[root]] + [row_of[n] for n in chain[:-1]]
                scores.append(logprobs[at, list(continuation)].double().cpu().numpy())
            out.append(scores)
        return out

    def close(self) -> None:
        with self._lock:
            for stream in self._streams:
                stream.caches.clear()


def _split(request) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(context to cache, the request's own tokens): at `shared_length`, keeping at least one own token (the tree
    hangs under the last prompt token)."""
    ids = tuple(request.prompt_ids)
    if not ids:
        raise ValueError("empty prompt")
    shared = len(ids) - 1 if request.shared_length is None else min(request.shared_length, len(ids) - 1)
    return ids[:shared], ids[shared:]


def _by_trie(requests: Sequence[TrieRequest], batch: list[int]) -> list[tuple[LabelTrie, list[int]]]:
    """The batch's requests grouped by trie (one pass scores one trie's candidates)."""
    groups: dict[int, tuple[LabelTrie, list[int]]] = {}
    for i in batch:
        groups.setdefault(id(requests[i].trie), (requests[i].trie, []))[1].append(i)
    return list(groups.values())


def _load_policy(model_config, adapter: str | None):
    """The frozen model of `model_config`, with `adapter` (a saved adapter folder) loaded if given."""
    from pathlib import Path

    from icrl_core.config import FrozenAdapter
    from icrl_core.model import policy_from_config

    if adapter is None:
        return policy_from_config(model_config.model_copy(update={"init_adapter": None}), adapter=FrozenAdapter())
    return policy_from_config(model_config, init_adapter=Path(adapter))

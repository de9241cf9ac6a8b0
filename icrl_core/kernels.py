"""Compute kernels of the in-context RL harness: key/value-cache prefix reuse and packed candidate scoring.

Two facts make evaluation cheap on a CPU, and both are exact (no approximation of the model):

1. The key/value (KV) entries of a token depend only on the tokens before it. A pool of caches (`PrefixCache`)
   keeps the KV of recent prompts; a new prompt reuses the longest common token prefix with any of them and
   computes only the rest. Growing contexts (naive, approximate) then cost only their new episode per step.
2. Tokens may be appended after a cached prefix as a *tree* rather than a sequence (`TreeScorer`): each new token
   attends to the whole prefix plus its own ancestors, with position id = prefix length + depth. A token's KV
   and output then equal what a plain left-to-right pass over (prefix + its ancestors + itself) would give. So
   all candidate labels (a trie of label token sequences) are scored in one pass, and several test queries,
   each followed by its trie, share one pass over one cached context.

Shapes: a prompt is `ids` (T,); the cache holds the prefix (P tokens); a tree pass appends N nodes, with mask
(1, 1, N, P + M) where M >= N counts every node appended so far in the session. H = hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Self

import numpy as np
import torch

ROOT = 0  # the trie's root node (no token): the position right after the prompt


# ---------------------------------------------------------------------------------------------------------------
# Candidate labels as a trie


@dataclass(frozen=True)
class LabelTrie:
    """The token sequences of all candidate answers as a trie. Node 0 is the root; every other node is one token.

    `children[n]` lists child node ids; a node is a leaf when it ends a sequence (the end-of-turn token ends
    every label, so no label is a proper prefix of another and leaves are exactly the label ends)."""

    token: tuple[int, ...]           # token id of each node (-1 for the root)
    parent: tuple[int, ...]          # parent node id (-1 for the root)
    depth: tuple[int, ...]           # 0 for the root
    children: tuple[tuple[int, ...], ...]
    label_of_leaf: dict[int, int]    # leaf node -> index of the label it ends

    @classmethod
    def build(cls, sequences: Sequence[Sequence[int]]) -> LabelTrie:
        token, parent, depth, children = [-1], [-1], [0], [[]]
        label_of_leaf: dict[int, int] = {}
        for index, sequence in enumerate(sequences):
            if not sequence:
                raise ValueError("empty candidate token sequence")
            node = ROOT
            for tok in sequence:
                nxt = next((c for c in children[node] if token[c] == tok), None)
                if nxt is None:
                    nxt = len(token)
                    token.append(int(tok))
                    parent.append(node)
                    depth.append(depth[node] + 1)
                    children.append([])
                    children[node].append(nxt)
                node = nxt
            if children[node] or node in label_of_leaf:
                raise ValueError(f"candidate {index} is a prefix of (or equal to) another candidate")
            label_of_leaf[node] = index
        for node, kids in enumerate(children):
            if kids and node in label_of_leaf:
                raise ValueError("a candidate is a prefix of another candidate")
        return cls(tuple(token), tuple(parent), tuple(depth), tuple(tuple(k) for k in children), label_of_leaf)

    def is_leaf(self, node: int) -> bool:
        return not self.children[node]

    @property
    def inner_nodes(self) -> list[int]:
        """Non-root, non-leaf nodes in creation order (parents before children): what a full-trie pass feeds."""
        return [n for n in range(1, len(self.token)) if self.children[n]]

    @property
    def max_depth(self) -> int:
        return max(self.depth)


# ---------------------------------------------------------------------------------------------------------------
# Prefix cache pool


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass
class CacheEntry:
    ids: np.ndarray  # (P,) int64: the tokens whose KV the cache holds
    cache: object    # transformers DynamicCache holding P positions
    last_used: int = 0


def _new_cache(policy):
    from transformers import DynamicCache

    return DynamicCache(config=policy.causal_lm.config)


def _cache_length(cache) -> int:
    return int(cache.get_seq_length()) if cache is not None else 0


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions (this transformers version crops by a negative count)."""
    extra = _cache_length(cache) - length
    if extra > 0:
        cache.crop(-extra)


def clone_cache_prefix(policy, cache, length: int):
    """A new cache holding copies of the first `length` positions of `cache` (copying is ~100x cheaper than
    recomputing those positions)."""
    fresh = _new_cache(policy)
    if length == 0:
        return fresh
    for index, layer in enumerate(cache.layers):
        fresh.update(layer.keys[..., :length, :].clone(), layer.values[..., :length, :].clone(), index)
    return fresh


@torch.no_grad()
def model_forward(policy, ids: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor | None = None,
                  ) -> torch.Tensor:
    """One pass of the backbone appending `ids` (1, n) at `positions` (1, n) to `cache`; final hidden states (n, H).
    `mask` (1, 1, n, P + n) bool: which cached and new positions each new token sees (None: causal). Inputs
    are built on the CPU and moved to the policy's device here."""
    device = policy.device
    ids, positions = ids.to(device), positions.to(device)
    mask = mask.to(device) if mask is not None else None
    out = policy.causal_lm.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                                 use_cache=True)
    return out.last_hidden_state[0]


@torch.no_grad()
def extend_cache(policy, cache, ids: Sequence[int], chunk_tokens: int, forward=model_forward) -> None:
    """Append `ids` to `cache` by plain causal passes of at most `chunk_tokens` tokens (bounds the size of the
    attention mask and of the activations). `forward`: how a pass is run (`model_forward`, or an engine's
    scheduler that fuses passes of several streams)."""
    for start in range(0, len(ids), chunk_tokens):
        piece = torch.tensor([list(ids[start:start + chunk_tokens])], dtype=torch.long)
        past = _cache_length(cache)
        positions = torch.arange(past, past + piece.shape[1]).unsqueeze(0)
        forward(policy, piece, positions, cache)


class PrefixCache:
    """A pool of KV caches of recent prompts. `prepare(ids)` returns a cache holding exactly `ids`, computing only
    the tokens after the longest common prefix with a pooled prompt.

    Policy: the entry with the longest common prefix wins (ties: one that needs no cropping, then the most
    recent). If the prompt extends it, it is extended in place; otherwise, while the pool has room, the shared
    prefix is copied into a new entry (so the other prompt stays cached); when full, the entry is cropped in
    place. With `reuse=False` nothing is kept: every prompt is computed from scratch (the reference baseline).
    """

    def __init__(self, policy, capacity: int = 2, reuse: bool = True, chunk_tokens: int = 1024,
                 forward=model_forward):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.policy = policy
        self.forward = forward
        self.capacity = capacity
        self.reuse = reuse
        self.chunk_tokens = chunk_tokens
        self.entries: list[CacheEntry] = []
        self._clock = 0
        self.tokens_computed = 0  # running total of prefix tokens fed through the model

    def clear(self) -> None:
        self.entries.clear()

    def prepare(self, ids: Sequence[int]) -> tuple[CacheEntry, int]:
        """(entry holding exactly `ids`, number of tokens computed now)."""
        target = np.asarray(ids, dtype=np.int64)
        self._clock += 1
        if not self.reuse:
            entry = CacheEntry(target, _new_cache(self.policy), self._clock)
            extend_cache(self.policy, entry.cache, target.tolist(), self.chunk_tokens, self.forward)
            self.tokens_computed += len(target)
            return entry, len(target)
        entry, shared = self._best_entry(target)
        if entry is None:
            entry = CacheEntry(target[:0], _new_cache(self.policy))
            shared = 0
            self._add(entry)
        elif shared < len(entry.ids):
            if len(self.entries) < self.capacity:
                entry = CacheEntry(entry.ids[:shared], clone_cache_prefix(self.policy, entry.cache, shared))
                self._add(entry)
            else:
                crop_cache(entry.cache, shared)
                entry.ids = entry.ids[:shared]
        new = target[shared:].tolist()
        if new:
            try:
                extend_cache(self.policy, entry.cache, new, self.chunk_tokens, self.forward)
            except BaseException:
                self.entries = [e for e in self.entries if e is not entry]  # its cache may be half-extended
                raise
        entry.ids = target
        entry.last_used = self._clock
        self.tokens_computed += len(new)
        return entry, len(new)

    def _best_entry(self, target: np.ndarray) -> tuple[CacheEntry | None, int]:
        best, best_key = None, None
        for entry in self.entries:
            shared = common_prefix_length(entry.ids, target)
            key = (shared, shared == len(entry.ids), entry.last_used)
            if best_key is None or key > best_key:
                best, best_key = entry, key
        return best, (best_key[0] if best_key else 0)

    def _add(self, entry: CacheEntry) -> None:
        if len(self.entries) >= self.capacity:
            self.entries.remove(min(self.entries, key=lambda e: e.last_used))
        self.entries.append(entry)

    @property
    def cached_tokens(self) -> int:
        return sum(len(e.ids) for e in self.entries)


# ---------------------------------------------------------------------------------------------------------------
# Tree attention after a cached prefix


@dataclass
class TreeScorer:
    """Append tokens after a cached prefix as a forest (each node has a parent node or the prefix end, -1) and
    read next-token logits at any appended node, restricted to given candidate tokens.

    Use as a context manager: on exit the cache is cropped back to the prefix, so the entry stays reusable."""

    policy: object
    cache: object
    prefix_length: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)  # (n, H) per pass
    computed: int = 0
    forward: object = model_forward   # how a pass is run (see extend_cache)
    _ancestors: np.ndarray | None = None  # (M, M) bool: ancestors-or-self among appended nodes

    def __enter__(self) -> Self:
        if _cache_length(self.cache) != self.prefix_length:
            raise RuntimeError("the cache does not hold exactly the prefix")
        return self

    def __exit__(self, *exc) -> None:
        crop_cache(self.cache, self.prefix_length)

    def __len__(self) -> int:
        return len(self.tokens)

    @torch.no_grad()
    def extend(self, nodes: Sequence[tuple[int, int]]) -> list[int]:
        """Append (token, parent) nodes in one forward pass; a parent is an earlier node id (possibly one appended
        in this same call, listed before) or -1 for the prefix end. Returns the new node ids."""
        if not nodes:
            return []
        start = len(self.tokens)
        total = start + len(nodes)
        ancestors = np.zeros((total, total), dtype=bool)
        if self._ancestors is not None:
            ancestors[:start, :start] = self._ancestors
        for offset, (token, parent) in enumerate(nodes):
            node = start + offset
            if not -1 <= parent < node:
                raise ValueError(f"node {node}: parent {parent} is not an earlier node")
            if parent >= 0:
                ancestors[node, :node] = ancestors[parent, :node]
            ancestors[node, node] = True
            self.tokens.append(int(token))
            self.parents.append(int(parent))
            self.depths.append(self.depths[parent] + 1 if parent >= 0 else 0)
        self._ancestors = ancestors
        n = len(nodes)
        # Rows: the new nodes; columns: the whole prefix, then every appended node (the cache order).
        mask = torch.ones((1, 1, n, self.prefix_length + total), dtype=torch.bool)
        mask[0, 0, :, self.prefix_length:] = torch.from_numpy(ancestors[start:total])
        ids = torch.tensor([self.tokens[start:total]], dtype=torch.long)
        positions = torch.tensor([[self.prefix_length + d for d in self.depths[start:total]]], dtype=torch.long)
        self.hidden.append(self.forward(self.policy, ids, positions, self.cache, mask))
        self.computed += n
        return list(range(start, total))

    def hidden_rows(self, nodes: Sequence[int]) -> torch.Tensor:
        """Final hidden states (n, H) of the given appended nodes (for a full-vocabulary head where needed)."""
        flat = torch.cat(self.hidden, dim=0) if len(self.hidden) > 1 else self.hidden[0]
        if len(self.hidden) > 1:
            self.hidden = [flat]
        return flat[torch.as_tensor(list(nodes), dtype=torch.long, device=flat.device)]

    @torch.no_grad()
    def candidate_logits(self, nodes: Sequence[int], candidates: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Next-token logits at each node, only for its candidate token ids: logits[k] = h_node . W[cand_k] (+ b).
        The LM head over the whole vocabulary (49k x H per position) is never computed. Returned on the CPU."""
        rows = self.hidden_rows(nodes)                         # (n, H)
        head = self.policy.causal_lm.lm_head
        device = head.weight.device
        flat = torch.as_tensor([c for cands in candidates for c in cands], dtype=torch.long, device=device)
        weight = head.weight[flat]  # (sum k, H)
        owner = torch.repeat_interleave(torch.arange(len(nodes), device=device),
                                        torch.tensor([len(c) for c in candidates], device=device))
        logits = (rows[owner].to(weight.dtype) * weight).sum(-1).float()  # (sum k,)
        if getattr(head, "bias", None) is not None:
            logits = logits + head.bias[flat].float()
        return list(torch.split(logits.cpu(), [len(c) for c in candidates]))


def chain_nodes(token_ids: Sequence[int], first_id: int, parent: int = -1) -> list[tuple[int, int]]:
    """(token, parent) pairs of a left-to-right chain whose first node will get id `first_id`."""
    nodes = []
    for offset, token in enumerate(token_ids):
        nodes.append((int(token), parent if offset == 0 else first_id + offset - 1))
    return nodes

"""The inference-engine interface: what the evaluation harness, the probes and the RL rollouts need from a model.

Three operations, each over a batch of requests from one or several callers:

* `trie_logprobs`: score every candidate answer (a `LabelTrie` of token sequences) after a prompt: per branching
  trie node, the log-probabilities of its children. Sampling, greedy decoding and label distributions under the
  constraint are pure functions of these (`walk_scores`, `path_probability`):

      p(child k | node) = softmax(score[node] / T)[k]      (T = 0: all mass on the argmax)

  which equals softmax(logits / T) restricted to the children, so a score may be shifted by one constant per
  node: a backend returns true log-probabilities or plain logits, whichever is cheaper.
* `walk_tries`: constrained decoding. For each request, start at the root; at each branching node call
  `choose(request_index, node, scores)` (the caller samples with its own random stream) and follow the chosen
  child; forced single-child chains are followed without a call. A backend may expand only the chosen paths.
* `continuation_logprobs`: true log-probabilities (full vocabulary softmax, temperature 1) of every token of
  every given continuation after a prompt (the multiple-choice forgetting probe; continuations may be prefixes of
  one another).

Prefix reuse is the backend's business: `shared_length` hints where a prompt's context (shared with other
requests and with later calls) ends and its per-request part (the query) begins.

Backends: `torch` (icrl_core/inference/torch_backend.py, the exact reference: identical to recomputing every
prompt from scratch in fp32) and `vllm` (icrl_core/inference/vllm_backend.py). Chosen by `inference.backend`
(icrl_core/inference/config.py); `engine_from_config` builds one. Pure: no orchestration package, no vllm import
at module level.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from icrl_core.kernels import ROOT, LabelTrie

# (request index, trie node, scores of the node's children in the trie's child order) -> chosen child position
Choose = Callable[[int, int, np.ndarray], int]


@dataclass(frozen=True)
class TrieRequest:
    """Score (or walk) the candidate answers of `trie` after `prompt_ids`."""

    prompt_ids: tuple[int, ...]      # everything before the answer's first token (context + query + answer prefix)
    trie: LabelTrie                  # the candidate answers' token sequences
    adapter: str | None = None       # None: the base model; else an adapter folder (Policy.save_adapter's layout)
    shared_length: int | None = None  # hint: prompt_ids[:shared_length] is a context shared with other requests
    #                                   and later calls (cache it); the rest is this request's own. None: all


@dataclass(frozen=True)
class ContinuationRequest:
    """Log-probabilities of each continuation's tokens after `prompt_ids`."""

    prompt_ids: tuple[int, ...]
    continuations: tuple[tuple[int, ...], ...]
    adapter: str | None = None
    shared_length: int | None = None


@runtime_checkable
class InferenceEngine(Protocol):
    name: str              # "torch" | "vllm"
    exact: bool            # True: results identical to recomputing every prompt from scratch (fp32)
    concurrent: bool       # True: several threads (evaluation streams) may call it at once; it may batch them
    tokens_computed: int   # running total of tokens fed through the model (for the step logs; 0 if unknown)

    def trie_logprobs(self, requests: Sequence[TrieRequest]) -> list[dict[int, np.ndarray]]:
        """Per request: {branching trie node -> scores of its children, in the trie's child order}: log-probabilities
        (full vocabulary softmax, temperature 1) up to one additive constant per node. Non-branching nodes may be
        present too."""
        ...

    def walk_tries(self, requests: Sequence[TrieRequest], choose: Choose) -> list[int]:
        """Per request, the leaf reached by constrained decoding with `choose` (module docstring). Per request,
        `choose` is called root-down; calls of different requests may interleave."""
        ...

    def continuation_logprobs(self, requests: Sequence[ContinuationRequest]) -> list[list[np.ndarray]]:
        """Per request, per continuation: (len(continuation),) true log-probabilities of its tokens."""
        ...

    def close(self) -> None:
        ...


# ---------------------------------------------------------------------------------------------------------------
# Pure helpers every backend and caller shares


def branching_nodes(trie: LabelTrie) -> list[int]:
    """Trie nodes with more than one child: the only places where constrained decoding decides anything."""
    return [n for n in range(len(trie.token)) if len(trie.children[n]) > 1]


def follow_forced(trie: LabelTrie, node: int) -> int:
    """Follow single-child links from `node` down to the next branching node or leaf."""
    while len(trie.children[node]) == 1:
        node = trie.children[node][0]
    return node


def walk_scores(trie: LabelTrie, scores: dict[int, np.ndarray], choose: Callable[[int, np.ndarray], int]) -> int:
    """The leaf reached by walking `trie` from the root with all branching nodes' `scores` known (what a backend
    without path expansion does for `walk_tries`)."""
    node = follow_forced(trie, ROOT)
    while not trie.is_leaf(node):
        node = follow_forced(trie, trie.children[node][choose(node, scores[node])])
    return node


def walk_with_trie_logprobs(engine: InferenceEngine, requests: Sequence[TrieRequest], choose: Choose) -> list[int]:
    """`walk_tries` from `trie_logprobs` (score every branching node, then walk)."""
    scored = engine.trie_logprobs(requests)
    return [walk_scores(r.trie, s, lambda node, values, i=i: choose(i, node, values))
            for i, (r, s) in enumerate(zip(requests, scored))]


# ---------------------------------------------------------------------------------------------------------------
# Backends

BACKENDS = {"torch": "icrl_core.inference.torch_backend:TorchEngine",
            "vllm": "icrl_core.inference.vllm_backend:VllmEngine"}


def engine_class(backend: str) -> type:
    """The engine class of `backend` (imported on demand: a backend's heavy dependencies load only when chosen)."""
    module, name = BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module), name)


def engine_from_config(config, policy=None) -> InferenceEngine:
    """The engine `config.inference.backend` names, built by its `from_config(config, policy)`: `config` is the
    PipelineConfig (model, icrl_eval and inference sections); `policy` an already loaded Policy of config.model
    that a backend may use instead of loading the weights again (the torch backend does)."""
    return engine_class(config.inference.backend).from_config(config, policy)

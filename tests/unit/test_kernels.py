"""KV-cache prefix reuse and tree-packed candidate scoring give the logits of plain left-to-right passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icrl_core.kernels import (
    ROOT,
    LabelTrie,
    PrefixCache,
    TreeScorer,
    chain_nodes,
    clone_cache_prefix,
    common_prefix_length,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _full_logits(policy, ids: list[int]) -> torch.Tensor:
    """Reference: one plain causal pass, no cache; (T, V) logits."""
    with torch.no_grad():
        return policy.causal_lm(torch.tensor([ids])).logits[0].double()


def _text_ids(policy, text: str) -> list[int]:
    return policy.tokenizer.encode(text, add_special_tokens=False)


def test_label_trie_structure_and_errors():
    trie = LabelTrie.build([(5, 6, 2), (5, 7, 2), (8, 2)])
    assert trie.children[ROOT] == (1, 6)
    assert [trie.token[n] for n in trie.inner_nodes] == [5, 6, 7, 8]
    assert sorted(trie.label_of_leaf.values()) == [0, 1, 2]
    assert trie.max_depth == 3
    with pytest.raises(ValueError, match="prefix"):
        LabelTrie.build([(5, 6), (5, 6, 7)])
    with pytest.raises(ValueError, match="prefix"):
        LabelTrie.build([(5, 6), (5, 6)])


def test_common_prefix_length():
    a = np.array([1, 2, 3, 4])
    assert common_prefix_length(a, np.array([1, 2, 9])) == 2
    assert common_prefix_length(a, a[:2]) == 2
    assert common_prefix_length(a, np.array([], dtype=np.int64)) == 0


def test_tree_packed_scoring_equals_sequential_passes(tiny):
    prefix = _text_ids(tiny, "<|im_start|>system\nAnswer.<|im_end|>\n<|im_start|>user\nQuery: hello there")
    queries = [_text_ids(tiny, "\n\nQuery: where is my card?<|im_end|>\n<|im_start|>assistant\nIntent:"),
               _text_ids(tiny, "\n\nQuery: my phone is lost<|im_end|>\n<|im_start|>assistant\nIntent:")]
    labels = [_text_ids(tiny, f" {lb}") + [2] for lb in ("card arrival", "card linking", "lost phone", "lost")]
    trie = LabelTrie.build(labels)
    cache = PrefixCache(tiny)
    entry, computed = cache.prepare(prefix)
    assert computed == len(prefix)
    with TreeScorer(tiny, entry.cache, len(prefix)) as scorer:
        nodes, placed = [], []
        for query in queries:  # each query followed by its whole trie, all in one pass
            first = len(nodes)
            nodes += chain_nodes(query, first)
            where = {ROOT: first + len(query) - 1}
            for node in trie.inner_nodes:
                where[node] = len(nodes)
                nodes.append((trie.token[node], where[trie.parent[node]]))
            placed.append(where)
        scorer.extend(nodes)
        for q, query in enumerate(queries):
            for label in labels:
                reference = _full_logits(tiny, prefix + query + label[:-1])[len(prefix) + len(query) - 1:]
                node = ROOT
                for depth, token in enumerate(label):
                    kids = trie.children[node]
                    cands = [trie.token[k] for k in kids]
                    got = scorer.candidate_logits([placed[q][node]], [cands])[0].double()
                    assert torch.allclose(got, reference[depth][cands], atol=1e-4), (q, label, depth)
                    node = next(k for k in kids if trie.token[k] == token)
    assert entry.cache.get_seq_length() == len(prefix)  # cropped back on exit


def test_prefix_cache_reuses_extends_and_forks(tiny):
    base = _text_ids(tiny, "<|im_start|>system\nAnswer the questions.<|im_end|>\n")
    a = base + _text_ids(tiny, "<|im_start|>user\nQuery: one two three")
    b = a + _text_ids(tiny, " four five")
    c = base + _text_ids(tiny, "<|im_start|>user\nQuery: something else")
    cache = PrefixCache(tiny, capacity=2)
    assert cache.prepare(a)[1] == len(a)
    entry_b, n_b = cache.prepare(b)
    assert n_b == len(b) - len(a)                       # extended in place
    entry_c, n_c = cache.prepare(c)
    shared = common_prefix_length(np.array(b), np.array(c))
    assert n_c == len(c) - shared and entry_c is not entry_b  # forked: b stays cached
    assert cache.prepare(b)[1] == 0
    assert cache.prepare(c)[1] == 0
    # Cached states give the same next-token logits as a fresh pass.
    for ids in (b, c):
        entry, _ = cache.prepare(ids)
        probe = _text_ids(tiny, " and")
        with TreeScorer(tiny, entry.cache, len(ids)) as scorer:
            node = scorer.extend(chain_nodes(probe, 0))[-1]
            got = scorer.candidate_logits([node], [[10, 20, 30]])[0].double()
        want = _full_logits(tiny, ids + probe)[-1][[10, 20, 30]]
        assert torch.allclose(got, want, atol=1e-4)
    # A third prompt with a full pool crops the best entry in place.
    d = base + _text_ids(tiny, "<|im_start|>user\nQuery: third")
    cache.prepare(d)
    assert len(cache.entries) == 2


def test_no_reuse_recomputes_everything(tiny):
    ids = _text_ids(tiny, "<|im_start|>system\nAnswer.<|im_end|>\n")
    cache = PrefixCache(tiny, reuse=False)
    assert cache.prepare(ids)[1] == len(ids)
    assert cache.prepare(ids)[1] == len(ids)
    assert cache.entries == []


def test_clone_cache_prefix_copies_exactly(tiny):
    ids = _text_ids(tiny, "<|im_start|>system\nAnswer the questions, please.<|im_end|>\n")
    cache = PrefixCache(tiny)
    entry, _ = cache.prepare(ids)
    clone = clone_cache_prefix(tiny, entry.cache, 5)
    assert clone.get_seq_length() == 5
    for mine, theirs in zip(clone.layers, entry.cache.layers):
        assert torch.equal(mine.keys, theirs.keys[..., :5, :])
        assert mine.keys.data_ptr() != theirs.keys.data_ptr()

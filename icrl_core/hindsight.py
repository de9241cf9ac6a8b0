"""Hindsight feedback couples: the policy's own in-context RL streams, renamed so that their feedback flips.

Why. A model that copies its past answers whatever the feedback says (docs/LIMITS.md, the feedback probe) can
lower the loss of ordinary targets without reading the feedback: the query and the label names explain most of
them. Two contexts that are identical except for the feedback of some attempts, and whose right answers are
opposite, can be told apart by the feedback alone. Such a *couple* is built from any stream the policy rolled
out, because a stream stays consistent under a renaming of its task's labels.

The renaming. sigma swaps two labels of the stream's task: X, the label the stream answered most often (ties: the
first given; the label a copying policy repeats), and Y, another label of the task drawn at random. In the
sigma-world the queries of class X are called Y and those of class Y are called X; the stream's answers stay
token for token, its rewards and feedback turns are recomputed from the renamed golds:

    r'_i = [a_i == sigma(g_i)]

Couples. Every step t whose gold g_t is X or Y (its right answer differs between the worlds) and before which at
least one attempt's feedback differs between the worlds (r_i != r'_i for some i < t):

    real world:   context of t with the real feedback,   chosen g_t,         rejected sigma(g_t)
    sigma-world:  context of t with the renamed feedback, chosen sigma(g_t),  rejected g_t

A policy that ignores the feedback prefers the same label in both contexts, so it gets exactly one pair of each
couple right (`policy_accuracy` 0.5, `couple_accuracy` 0: the feedback probe's copying model). One that reads the
feedback can get both.

The loss: DPO (Rafailov et al., 2023) on the constrained decision where the two labels' token paths part. With z
the LM-head logits of the children of that label-trie node after the context and the shared path, at T = 1,

    log pi(c) = log softmax(z)[c]
    h = (log pi(c_w) - log pi_ref(c_w)) - (log pi(c_l) - log pi_ref(c_l))       (the node's normalizer cancels)
    L = -log sigmoid(beta h)                                                      (`objectives.dpo_loss`)

with pi_ref the policy with its adapters disabled. Or (`dpo.hindsight_loss: contrast`) reference-free, per
couple, `objectives.couple_contrast_loss`: m = margin(real) + margin(renamed), L = -log sigmoid(beta m). Or
(`rank`) reference-free, per pair, `objectives.pairwise_rank_loss`: L = -log sigmoid(beta margin) in each world,
satisfied only when each world ranks its own right answer first; the world ranked wrong (for a copying policy,
the one whose feedback marks the copied label wrong) carries the gradient. Or (`rank_contrast`) the sum of the two. With
a reference other than the start policy the DPO pairs of a couple are not symmetric (h starts away from 0 where
the start policy's preference differs from the reference's), so the DPO gradient also moves the preference both
worlds share; the contrast moves only the feedback's effect. The node's input is in the stream's token sequence only when
the stream's own answer at t passes through it (always for labels that part at their first token; opaque names
such as 'L12' / 'L47' share ' L'); other couples are skipped and counted.

One forward pass over each world's whole stream gives every couple of that stream: the context of a later step
extends that of an earlier one, as in `streams.stream_outputs`.

Shapes: S sequences (two per stream: real, renamed), L tokens, P pairs, K the largest number of children.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from icrl_core.chat import Tokens
from icrl_core.icrl_eval import EpisodeRecord, candidate_sequences, render_context, render_query
from icrl_core.kernels import ROOT, LabelTrie
from icrl_core.objectives import couple_contrast_loss, dpo_loss, pairwise_rank_loss
from icrl_core.streams import STREAM_VIEW, Stream, restricted_logits


def swap_labels(stream: Stream, rng: random.Random) -> tuple[str, str]:
    """(X, Y): X the stream's most frequent answer (ties: the first given), Y another label of its task."""
    answers = [step.record.prediction for step in stream.steps]
    counts = Counter(answers)
    top = max(counts.values())
    x = next(a for a in answers if counts[a] == top)
    y = rng.choice([label for label in stream.task.labels if label != x])
    return x, y


def renamed_records(records: Sequence[EpisodeRecord], x: str, y: str) -> list[EpisodeRecord]:
    """The sigma-world of a stream's records: golds X <-> Y swapped, answers kept, rewards and feedback recomputed."""
    sigma = {x: y, y: x}
    out = []
    for r in records:
        gold = sigma.get(r.gold, r.gold)
        reward = int(r.prediction == gold)
        out.append(EpisodeRecord(r.step, r.query, gold, r.prediction, reward, reward))
    return out


def couple_steps(records: Sequence[EpisodeRecord], renamed: Sequence[EpisodeRecord], x: str, y: str) -> list[int]:
    """Steps t with g_t in {X, Y} after at least one attempt whose feedback differs between the worlds."""
    steps, differs = [], False
    for t, (real, other) in enumerate(zip(records, renamed)):
        if differs and real.gold in (x, y):
            steps.append(t)
        differs = differs or real.feedback != other.feedback
    return steps


def render_world(tokens: Tokens, stream: Stream, records: Sequence[EpisodeRecord]) -> tuple[list[int], list[int]]:
    """(token ids of the whole stream in this world, index of each step's first answer token): each step's
    context rendered from `records` as the harness does, followed by the stream's own answer tokens."""
    template = stream.task.template
    ids: list[int] = []
    starts: list[int] = []
    for t, step in enumerate(stream.steps):
        context, user_open = render_context(tokens, template, records[:t], STREAM_VIEW)
        prompt = list(context) + render_query(tokens, template, step.record.query, user_open)
        if prompt[:len(ids)] != ids:  # the chat rendering must be concatenative (chat.Conversation)
            raise RuntimeError("a renamed stream's context is not an extension of its previous context")
        starts.append(len(prompt))
        ids = prompt + list(step.answer_ids)
    return ids, starts


@dataclass
class Decision:
    """One pair as a constrained decision: the token at `position` predicts a child of a trie node whose children
    are `candidates`; the pair prefers candidates[chosen] over candidates[rejected]."""

    position: int
    candidates: tuple[int, ...]
    chosen: int
    rejected: int


def parting_decision(trie: LabelTrie, chosen_ids: Sequence[int], rejected_ids: Sequence[int],
                     answer_ids: Sequence[int], answer_start: int) -> Decision | None:
    """The decision where the two labels' token paths part, if the stream's own answer reaches that node (its
    input is then in the sequence); else None."""
    shared = 0
    while chosen_ids[shared] == rejected_ids[shared]:
        shared += 1
    if tuple(answer_ids[:shared]) != tuple(chosen_ids[:shared]):
        return None
    node = ROOT
    for token in chosen_ids[:shared]:
        node = next(c for c in trie.children[node] if trie.token[c] == token)
    children = [trie.token[c] for c in trie.children[node]]
    return Decision(answer_start + shared - 1, tuple(children), children.index(chosen_ids[shared]),
                    children.index(rejected_ids[shared]))


@dataclass
class World:
    """One world of one stream: its token ids and the decisions of its couples' pairs (one per couple)."""

    input_ids: list[int]
    decisions: list[Decision]


@dataclass
class Couples:
    """The couples of a set of streams: 2 worlds per stream that has any (real, renamed), and counts."""

    worlds: list[World]
    couples: int
    skipped: int

    @property
    def pairs(self) -> int:
        return 2 * self.couples


def hindsight_couples(streams: Sequence[Stream], tokens: Tokens, rngs: Sequence[random.Random]) -> Couples:
    """Each stream's renaming (its own rng draws Y), its couples, both worlds rendered. Streams without a couple
    give no world."""
    worlds: list[World] = []
    couples = skipped = 0
    for stream, rng in zip(streams, rngs):
        x, y = swap_labels(stream, rng)
        records = [step.record for step in stream.steps]
        renamed = renamed_records(records, x, y)
        steps = couple_steps(records, renamed, x, y)
        if not steps:
            continue
        labels = list(stream.task.labels)
        sequences = dict(zip(labels, candidate_sequences(tokens, stream.task.template, labels)))
        trie = LabelTrie.build([sequences[label] for label in labels])
        real_ids, real_starts = render_world(tokens, stream, records)
        other_ids, other_starts = render_world(tokens, stream, renamed)
        real, other = World(real_ids, []), World(other_ids, [])
        for t in steps:
            gold, swapped = records[t].gold, renamed[t].gold
            answer = stream.steps[t].answer_ids
            first = parting_decision(trie, sequences[gold], sequences[swapped], answer, real_starts[t])
            second = parting_decision(trie, sequences[swapped], sequences[gold], answer, other_starts[t])
            if first is None or second is None:
                skipped += 1
                continue
            real.decisions.append(first)
            other.decisions.append(second)
            couples += 1
        if real.decisions:
            worlds += [real, other]
    return Couples(worlds, couples, skipped)


def decision_logps(policy, worlds: Sequence[World]) -> tuple[torch.Tensor, torch.Tensor]:
    """ONE forward pass over the worlds: (log pi(chosen), log pi(rejected)) of every decision at T = 1, each (P,),
    in the order of the worlds and their decisions."""
    from icrl_core.batching import pad_sequences

    ids, attention = pad_sequences([w.input_ids for w in worlds], policy.tokenizer.pad_token_id)  # (S, L)
    _, _, hidden = policy.forward(ids, attention, logits_at=torch.zeros_like(attention, dtype=torch.bool))
    flat = [(s, d) for s, world in enumerate(worlds) for d in world.decisions]
    width = max(len(d.candidates) for _, d in flat)
    rows = hidden[[s for s, _ in flat], [d.position for _, d in flat]]                           # (P, H)
    candidates = torch.tensor([list(d.candidates) + [d.candidates[0]] * (width - len(d.candidates))
                               for _, d in flat], dtype=torch.long)                              # (P, K)
    mask = torch.tensor([[k < len(d.candidates) for k in range(width)] for _, d in flat])        # (P, K)
    logits = restricted_logits(policy.causal_lm.lm_head, rows, candidates).cpu()
    log_probs = torch.log_softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
    chosen = torch.tensor([d.chosen for _, d in flat])
    rejected = torch.tensor([d.rejected for _, d in flat])
    index = torch.arange(len(flat))
    return log_probs[index, chosen], log_probs[index, rejected]


def couple_loss(policy, worlds: Sequence[World], beta: float, kind: str = "dpo"
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss over the worlds' couples, and sums over their pairs: `pairs`, `margin`, `accuracy`,
    `policy_accuracy` (pi(chosen) > pi(rejected)) and `couple_accuracy` (both pairs of a couple so; counted per
    couple).

    kind "dpo": mean DPO loss over the pairs against the reference (module docstring); margin = beta h, accuracy =
    pairs with h > 0. kind "contrast": `objectives.couple_contrast_loss`, no reference pass; margin = beta m per
    couple (counted for both its pairs), accuracy = pairs of couples with m > 0. kind "rank":
    `objectives.pairwise_rank_loss` on every pair, no reference pass; margin = beta (log pi(chosen) -
    log pi(rejected)) per pair, accuracy = policy_accuracy. kind "rank_contrast": the rank loss plus the
    contrast loss, counted as rank."""
    logp_w, logp_l = decision_logps(policy, worlds)
    real_index, renamed_index, start = [], [], 0
    for real in worlds[0::2]:  # worlds come as (real, renamed) pairs whose decisions are aligned
        n = len(real.decisions)
        real_index += range(start, start + n)
        renamed_index += range(start + n, start + 2 * n)
        start += 2 * n
    real_index, renamed_index = torch.tensor(real_index), torch.tensor(renamed_index)
    if kind == "dpo":
        with torch.no_grad(), policy.reference():
            ref_w, ref_l = decision_logps(policy, worlds)
        loss = dpo_loss(logp_w, logp_l, ref_w, ref_l, beta)
        h = ((logp_w - ref_w) - (logp_l - ref_l)).detach()
        margin, accuracy = float(beta * h.sum()), float((h > 0).sum())
    elif kind == "contrast":
        margins = logp_w - logp_l
        loss = couple_contrast_loss(margins[real_index], margins[renamed_index], beta)
        m = (margins[real_index] + margins[renamed_index]).detach()
        margin, accuracy = float(2 * beta * m.sum()), float(2 * (m > 0).sum())
    elif kind in ("rank", "rank_contrast"):
        margins = logp_w - logp_l
        loss = pairwise_rank_loss(logp_w, logp_l, beta)
        if kind == "rank_contrast":  # the contrast keeps the feedback's effect growing while the rank term
            # removes the preference both worlds share (setting 9 alone shrank both: PREREGISTERED.md addendum 11)
            loss = loss + couple_contrast_loss(margins[real_index], margins[renamed_index], beta)
        margin, accuracy = float(beta * margins.detach().sum()), float((margins > 0).sum())
    else:
        raise ValueError(f"unknown hindsight loss {kind!r}")
    right = (logp_w > logp_l).detach()
    both = float((right[real_index] & right[renamed_index]).sum())
    return loss, {"pairs": float(len(right)), "margin": margin, "accuracy": accuracy,
                  "policy_accuracy": float(right.sum()), "couple_accuracy": both}

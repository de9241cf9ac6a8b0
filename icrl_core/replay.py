"""General-chat replay: keep the base model's behaviour on ordinary chat turns while the bootstrap teaches the
in-context RL format (Learning without Forgetting, Li & Hoiem 2017, with the base model as the teacher).

Why: the bootstrap trains short label answers in in-context RL chats; the forgetting probe showed the trained
model then prefers short complete replies in *every* chat (README, issue 6). Replay adds, to each bootstrap step,
a KL term on plain chats (the model's own chat template and default system prompt, as the forgetting checks
render their questions) whose replies the base model sampled itself:

    L_replay = sum_t KL(pi(. | x_<t) || pi_base(. | x_<t)) / N_reply_tokens    over the reply positions t

exact over the vocabulary, so it also holds the probability of ending the turn at every reply position, whether
or not the sampled reply ended. The user turns are training queries of training tasks only (never held-out ones).

- `replay_prompts`:  n user turns drawn from training texts, deterministic in the seed.
- `sample_replies`:  the reference policy's replies (sampled at `temperature`), as `ReplaySequence`s.
- `replay_kl`:       the per-token KL at the reply positions of a padded batch of them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from icrl_core.batching import pad_sequences
from icrl_core.chat import chat_prompt_ids
from icrl_core.device import to_device
from icrl_core.errors import UserError
from icrl_core.io import atomic_write_text
from icrl_core.objectives import kl_policy_base


@dataclass(frozen=True)
class ReplaySequence:
    """A plain chat: input_ids[:reply_start] is the prompt (up to the assistant header), the rest the reply."""

    input_ids: list[int]
    reply_start: int

    @property
    def reply_tokens(self) -> int:
        return len(self.input_ids) - self.reply_start


def replay_prompts(texts: Sequence[str], n: int, seed: int) -> list[str]:
    """n distinct user turns drawn uniformly (without replacement) from `texts`."""
    unique = sorted({t.strip() for t in texts if t.strip()})
    if len(unique) < n:
        raise UserError(f"replay asks for {n} prompts but its tasks hold {len(unique)} distinct training texts")
    return random.Random(seed).sample(unique, n)


@torch.no_grad()
def sample_replies(policy, prompts: Sequence[str], max_new_tokens: int, temperature: float, seed: int,
                   batch_size: int = 8, progress=None) -> list[ReplaySequence]:
    """The reference policy's reply to each prompt, sampled at `temperature` (1.0: its own distribution) and
    stopped at the end of turn or after `max_new_tokens`. Deterministic given the seed and the batch size."""
    tok = policy.tokenizer
    eot = policy.tokens.end_of_turn_id
    pad = tok.pad_token_id
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    out: list[ReplaySequence] = []
    batches = [list(prompts[i:i + batch_size]) for i in range(0, len(prompts), batch_size)]
    try:
        policy.eval()
        with policy.reference():
            for batch in (progress(batches) if progress else batches):
                encoded = [chat_prompt_ids(tok, p) for p in batch]
                width = max(len(e) for e in encoded)
                ids = torch.tensor([[pad] * (width - len(e)) + e for e in encoded])  # left padding for generate
                attention = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
                generated = policy.model.generate(input_ids=ids.to(policy.device),
                                                  attention_mask=attention.to(policy.device), do_sample=True,
                                                  temperature=temperature, top_k=0, top_p=1.0,
                                                  max_new_tokens=max_new_tokens, eos_token_id=eot,
                                                  pad_token_id=pad)
                for prompt_ids, row in zip(encoded, generated[:, width:].tolist()):
                    reply = row[: row.index(eot) + 1] if eot in row else row
                    out.append(ReplaySequence(prompt_ids + reply, len(prompt_ids)))
    finally:
        torch.random.set_rng_state(generator_state)
    return out


def write_replay(path: Path | str, sequences: Sequence[ReplaySequence], key: str) -> None:
    """JSONL, atomically; the first line records the key (what generated it) so a rerun can reuse it."""
    lines = [json.dumps({"key": key})] + [json.dumps(asdict(s)) for s in sequences]
    atomic_write_text(Path(path), "\n".join(lines) + "\n")


def read_replay(path: Path | str, key: str) -> list[ReplaySequence] | None:
    """The sequences of a replay file written with the same key, else None."""
    path = Path(path)
    if not path.exists():
        return None
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines or json.loads(lines[0]).get("key") != key:
        return None
    return [ReplaySequence(**json.loads(line)) for line in lines[1:] if line.strip()]


@dataclass
class ReplayBatch:
    """Right-padded replay sequences. Shapes (B, T); `predict_at` marks the positions whose next token is a
    reply token (the last prompt token and every reply token but the last)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    predict_at: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return int(self.predict_at.sum())


def pad_replay(sequences: Sequence[ReplaySequence], pad_id: int) -> ReplayBatch:
    ids, attention = pad_sequences([s.input_ids for s in sequences], pad_id)
    predict_at = torch.zeros_like(attention, dtype=torch.bool)
    for i, s in enumerate(sequences):
        predict_at[i, s.reply_start - 1: len(s.input_ids) - 1] = True
    return ReplayBatch(ids, attention, predict_at)


def replay_kl(policy, batch: ReplayBatch) -> torch.Tensor:
    """KL_t(pi || pi_base) at every reply position of the batch (objectives.kl_policy_base). -> (N,)"""
    batch = to_device(batch, policy.device)
    logits, _, _ = policy.forward(batch.input_ids, batch.attention_mask, logits_at=batch.predict_at)
    with torch.no_grad(), policy.reference():
        base_logits, _, _ = policy.forward(batch.input_ids, batch.attention_mask, logits_at=batch.predict_at)
    return kl_policy_base(logits, base_logits)

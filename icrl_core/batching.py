"""Token lists into padded tensors: the one padding helper the supervised, replay, reward-model and preference
(DPO) batches share."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_sequences(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists -> (input_ids, attention_mask), both (B, T) long."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, :len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        attention[i, :len(seq)] = 1
    return ids, attention


def chunks(items: Sequence, size: int) -> list[list]:
    """Consecutive slices of at most `size` items."""
    return [list(items[i:i + size]) for i in range(0, len(items), size)]

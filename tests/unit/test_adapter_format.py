"""Adapter folders (docs/FORMATS.md): the non-LoRA kinds round-trip in safetensors with a JSON (tiny model).
Plain PEFT and transformers loading what the pipeline writes, the old layout and `icrl model convert/export`:
tests/integration/test_adapter_format.py."""

from __future__ import annotations

import json

import pytest
import torch

from icrl_core.adapter_format import BLOCKS, META, VALUE_HEAD
from icrl_core.config import FrozenAdapter, LastBlocksAdapter
from icrl_core.model import load_policy, saved_adapter


def _ids(policy, text="Query: where is my card?"):
    return torch.tensor([policy.tokenizer.encode(text)])


def _perturb(policy, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def _logits(policy, ids):
    with torch.no_grad():
        return policy.forward(ids)[0]


@pytest.mark.parametrize("adapter", [LastBlocksAdapter(n_blocks=1), FrozenAdapter()], ids=["last_blocks", "frozen"])
def test_other_kinds_round_trip_in_safetensors_with_a_json(tmp_path, adapter):
    policy = load_policy("tiny", adapter=adapter, value_head=True)
    _perturb(policy)
    policy.save_adapter(tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted([BLOCKS, META, VALUE_HEAD])
    assert json.loads((tmp_path / "a" / META).read_text())["adapter"]["kind"] == adapter.kind
    fresh = load_policy("tiny", adapter=saved_adapter(tmp_path / "a"), value_head=True, init_adapter=tmp_path / "a")
    ids = _ids(policy)
    with torch.no_grad():
        assert torch.equal(policy.forward(ids, with_values=True)[1], fresh.forward(ids, with_values=True)[1])
    assert torch.equal(_logits(policy, ids), _logits(fresh, ids))

"""Device selection (config `model.device`) and the collective backend that goes with it; CPU stays the default
on this machine and the numbers do not change."""

from __future__ import annotations

import pytest
import torch

from icrl_core.config import LoraAdapter, ModelConfig
from icrl_core.device import collective_backend, resolve_device, select_device
from icrl_core.errors import UserError


@pytest.mark.parametrize(("requested", "cuda", "expected"), [
    ("auto", True, "cuda"), ("auto", False, "cpu"), ("cpu", True, "cpu"), ("cpu", False, "cpu"),
    ("cuda", True, "cuda"),
])
def test_select_device(requested, cuda, expected):
    assert select_device(requested, cuda_available=cuda) == expected


def test_cuda_without_a_gpu_and_unknown_devices_are_user_errors():
    with pytest.raises(UserError, match="no CUDA device"):
        select_device("cuda", cuda_available=False)
    with pytest.raises(UserError, match="use one of auto, cpu, cuda"):
        select_device("tpu", cuda_available=True)


def test_collective_backend_matches_the_device():
    assert collective_backend("cuda") == "nccl"
    assert collective_backend("cpu") == "gloo"


def test_model_device_config_is_bounded():
    assert ModelConfig().device == "auto"
    with pytest.raises(ValueError):
        ModelConfig(device="gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks this CPU-only machine's default")
def test_cpu_is_the_default_here_and_numbers_are_unchanged(tiny):
    from icrl_core.model import load_policy, policy_from_config

    assert resolve_device() == torch.device("cpu")
    ids = torch.tensor([tiny.tokenizer.encode("Query: where is my card?")])
    explicit = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4, alpha=8), value_head=True, device="cpu")
    auto = policy_from_config(ModelConfig(spec="tiny", dtype="float32", adapter=LoraAdapter(rank=4, alpha=8)),
                              value_head=True)
    assert auto.device == explicit.device == torch.device("cpu")
    assert auto.value_head.linear.weight.device.type == "cpu"
    with torch.no_grad():
        a, va, _ = auto.forward(ids, with_values=True)
        b, vb, _ = explicit.forward(ids, with_values=True)
        base, _, _ = tiny.forward(ids)
    assert torch.equal(a, b) and torch.equal(va, vb)
    assert torch.equal(a, base)  # LoRA B starts at zero: the same numbers as the base model


def test_policy_to_moves_every_weight_and_batches_follow():
    """`meta`, a second device on every machine, shows what moves: the weights, the value head, the reference
    copies of trained blocks; and a batch of the supervised loop (to_device)."""
    from icrl_core.config import LastBlocksAdapter
    from icrl_core.device import to_device
    from icrl_core.model import load_policy
    from icrl_core.supervised import EpisodeBatch

    policy = load_policy("tiny", seed=0, adapter=LastBlocksAdapter(n_blocks=1), value_head=True, device="cpu")
    policy.to("meta")
    assert policy.device.type == "meta"
    tensors = [*policy.model.parameters(), *policy.value_head.parameters(),
               *(p for block in policy._frozen_blocks.values() for p in block.parameters())]
    assert {t.device.type for t in tensors} == {"meta"}
    ids = torch.ones((2, 3), dtype=torch.long)
    batch = EpisodeBatch(ids, ids, ids.bool(), ids, n_queries=2)
    moved = to_device(batch, policy.device)
    assert moved.input_ids.device.type == moved.loss_mask.device.type == "meta" and moved.n_queries == 2
    assert to_device(batch, "cpu").input_ids is batch.input_ids  # a no-op where the batch already is

"""What the vllm backend needs that runs without vllm: the project's LoRA adapters in PEFT's layout (what vLLM's
LoRARequest loads), and one clear error when the backend is chosen but not installed. The backend itself runs in
tests/integration/test_vllm_backend.py (with the vllm extra)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from icrl_core.errors import UserError


def test_a_project_lora_adapter_converts_to_the_same_peft_adapter(tmp_path):
    from peft import PeftModel

    from icrl_core.config import LoraAdapter
    from icrl_core.inference.vllm_backend import peft_folder
    from icrl_core.model import load_base_model, load_policy

    policy = load_policy("tiny", adapter=LoraAdapter(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:  # non-zero, so the adapter changes the outputs
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    policy.save_adapter(tmp_path / "adapter")
    folder = peft_folder(str(tmp_path / "adapter"), tmp_path / "converted")
    assert peft_folder(str(tmp_path / "adapter"), tmp_path / "converted") == folder  # converted once, then reused
    base, _ = load_base_model("tiny")
    ids = torch.tensor([[1, 5, 9, 200, 31, 7]])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        served = PeftModel.from_pretrained(base, folder)(input_ids=ids).logits
        trained = policy.model(input_ids=ids).logits
    assert torch.allclose(served, trained, atol=1e-6)
    assert not torch.allclose(plain, trained, atol=1e-3)


def test_vllm_chosen_but_not_installed_is_one_clear_error(monkeypatch):
    """Runs with and without the extra: a None entry in sys.modules makes `import vllm` fail as if it were not
    installed (the engine's environment defaults go into a copy of os.environ)."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setattr(os, "environ", os.environ.copy())
    from icrl_core.inference.vllm_backend import VllmEngine

    with pytest.raises(UserError, match="make setup-vllm"):
        VllmEngine("any-model-folder")

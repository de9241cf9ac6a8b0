"""The embedded SmolLM2-135M: the GGUF cache keyed by hash (built once), a factual answer
offline, and `icrl model interpolate` through the real console script. The model layer on the tiny model:
tests/unit/test_model.py."""

from __future__ import annotations

import json

import pytest
import torch

from icrl_core.config import LoraAdapter
from icrl_core.model import load_policy, materialize_gguf, packaged_gguf, saved_adapter
from tests.unit.test_model import _perturb_trainable


@pytest.mark.real_model
def test_gguf_cache_is_keyed_by_hash_and_built_once(monkeypatch):
    """The dequantized copy lives in the shared cache (the one every SmolLM2 stage and test loads, so a fresh
    machine converts once) under the GGUF's SHA-256; a second call reuses it without converting again."""
    from icrl_core.io import sha256_file

    gguf = packaged_gguf()
    folder = materialize_gguf(gguf)
    digest = sha256_file(gguf)
    assert folder.name.endswith(digest[:16])
    assert json.loads((folder / "icrl-cache.json").read_text())["sha256"] == digest
    weights = (folder / "model.safetensors").stat()

    def convert_again(*args, **kwargs):
        raise AssertionError("the cached copy was converted again")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", convert_again)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", convert_again)
    assert materialize_gguf(gguf) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == weights.st_mtime_ns


@pytest.mark.real_model
def test_smollm2_answers_a_factual_question_offline(smollm2, monkeypatch):
    import os

    from icrl_core.generation import greedy_chat_answer

    assert os.environ["HF_HUB_OFFLINE"] == "1"
    cfg = smollm2.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    answer = greedy_chat_answer(smollm2, "What is the capital of France?")
    assert "Paris" in answer


def test_model_interpolate_cli_writes_the_interpolated_adapter(tmp_path):
    from safetensors.torch import load_file

    from tests.conftest import call_cli

    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4, alpha=8))
    _perturb_trainable(policy)
    policy.save_adapter(tmp_path / "trained")
    done = call_cli("model", "interpolate", str(tmp_path / "trained"), "--scale", "0.5", "--output",
                    str(tmp_path / "half"), "--spec", "tiny", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    trained = load_file(tmp_path / "trained" / "adapter_model.safetensors")
    half = load_file(tmp_path / "half" / "adapter_model.safetensors")
    assert set(half) == set(trained)
    for name, tensor in trained.items():
        assert torch.allclose(half[name], tensor * (0.5 if "lora_B" in name else 1.0)), name
    assert saved_adapter(tmp_path / "half") == LoraAdapter(rank=4, alpha=8)
    missing = call_cli("model", "interpolate", str(tmp_path / "nowhere"), "--scale", "0.5", "--output",
                       str(tmp_path / "x"), "--spec", "tiny", cwd=tmp_path)
    assert missing.returncode == 2 and "does not exist" in missing.stderr

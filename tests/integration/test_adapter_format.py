"""Adapter folders in PEFT's own format (docs/FORMATS.md): plain PEFT loads what the pipeline writes (tiny model
and the real SmolLM2), the old layout still loads and converts, and `icrl model export --merge` writes a model
transformers loads."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from icrl_core.adapter_format import META, PEFT_CONFIG, PEFT_WEIGHTS, VALUE_HEAD
from icrl_core.config import LastBlocksAdapter, LoraAdapter
from icrl_core.io import sha256_folder
from icrl_core.model import load_base_model, load_policy, resolve_spec, saved_adapter
from tests.conftest import call_cli
from tests.unit.test_adapter_format import _ids, _logits, _perturb


def _peft_logits(base, folder, ids):
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, str(folder))
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_plain_peft_loads_a_pipeline_adapter_with_the_same_logits(request, tmp_path, model):
    spec = {"tiny": "tiny", "smollm2": "smollm2-135m"}[model]
    adapter = LoraAdapter(rank=4, alpha=8)
    writer = load_policy(spec, adapter=adapter, value_head=True)
    _perturb(writer)
    writer.save_adapter(tmp_path / "adapter")
    del writer
    folder = tmp_path / "adapter"
    assert sorted(p.name for p in folder.iterdir()) == sorted([PEFT_CONFIG, PEFT_WEIGHTS, META, VALUE_HEAD])
    config = json.loads((folder / PEFT_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["target_modules"] == sorted(adapter.target_modules)  # sorted: the same bytes on every run
    # the base it was trained on: the embedded model's dequantized folder (none for the random tiny model)
    assert config["base_model_name_or_path"] == (str(resolve_spec(spec)[1]) if model == "smollm2" else None)
    if model == "smollm2":
        base = copy.deepcopy(request.getfixturevalue("smollm2").model)  # the session's frozen model, untouched
    else:
        base, _ = load_base_model("tiny")
    pipeline = load_policy(spec, adapter=saved_adapter(folder), value_head=True, init_adapter=folder)
    ids = _ids(pipeline)
    ours = _logits(pipeline, ids)
    with torch.no_grad(), pipeline.reference():
        assert not torch.equal(ours, pipeline.forward(ids)[0])  # the adapter changes the answer
    torch.testing.assert_close(_peft_logits(base, folder, ids), ours, rtol=0, atol=1e-5)


def _old_layout(policy, folder):
    """An adapter folder as icrl wrote it before PEFT's format (format 1)."""
    folder.mkdir()
    save_file(policy.trainable_state_dict(), str(folder / "adapter.safetensors"))
    policy.value_head.save(folder / "value_head.safetensors")
    (folder / "adapter.json").write_text(json.dumps({
        "spec": policy.spec, "adapter": policy.adapter.model_dump(mode="json"), "value_head": True}))


def test_old_layout_loads_and_converts_with_one_command(tmp_path):
    policy = load_policy("tiny", adapter=LoraAdapter(rank=4), value_head=True)
    _perturb(policy)
    _old_layout(policy, tmp_path / "old")
    ids = _ids(policy)
    expected = _logits(policy, ids)
    loaded = load_policy("tiny", adapter=saved_adapter(tmp_path / "old"), value_head=True,
                         init_adapter=tmp_path / "old")
    assert torch.equal(_logits(loaded, ids), expected)

    done = call_cli("model", "convert", str(tmp_path / "old"), cwd=tmp_path)  # in place
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == sorted([PEFT_CONFIG, PEFT_WEIGHTS, META,
                                                                          VALUE_HEAD])
    converted = load_policy("tiny", adapter=saved_adapter(tmp_path / "old"), value_head=True,
                            init_adapter=tmp_path / "old")
    assert torch.equal(_logits(converted, ids), expected)
    assert torch.equal(load_file(tmp_path / "old" / VALUE_HEAD)["linear.weight"],
                       policy.value_head.linear.weight)
    base, _ = load_base_model("tiny")
    torch.testing.assert_close(_peft_logits(base, tmp_path / "old", ids), expected, rtol=0, atol=1e-5)
    # the same weights saved by the pipeline: the same bytes
    policy.save_adapter(tmp_path / "new")
    assert sha256_folder(tmp_path / "new") == sha256_folder(tmp_path / "old")
    missing = call_cli("model", "convert", str(tmp_path / "nowhere"), cwd=tmp_path)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.parametrize("adapter", [LoraAdapter(rank=4, alpha=8), LastBlocksAdapter(n_blocks=1)],
                         ids=["lora", "last_blocks"])
def test_export_merge_writes_a_model_transformers_loads_with_the_same_logits(tmp_path, adapter):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from icrl_core.adapter_tools import export_merged

    policy = load_policy("tiny", adapter=adapter)
    _perturb(policy)
    policy.save_adapter(tmp_path / "adapter")
    if adapter.kind == "lora":  # the command once; the other kind through the function it calls
        done = call_cli("model", "export", str(tmp_path / "adapter"), "--merge", "--output",
                        str(tmp_path / "merged"), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    else:
        export_merged(tmp_path / "adapter", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
    ids = _ids(policy)
    assert tokenizer.encode("Query: where is my card?") == ids[0].tolist()
    with torch.no_grad():
        logits = merged(input_ids=ids).logits.float()
    torch.testing.assert_close(logits, _logits(policy, ids), rtol=0, atol=1e-5)

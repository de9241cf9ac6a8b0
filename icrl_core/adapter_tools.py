"""Operations on a saved adapter folder that need its base model (docs/FORMATS.md): load it as a policy, rewrite
it in the current format, interpolate it toward the base model, export it merged into a transformers folder.
The folder format itself is icrl_core/adapter_format.py, below icrl_core/model.py; this module is above both."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from icrl_core.adapter_format import PEFT_WEIGHTS, is_legacy, load_safetensors, read_meta, saved_adapter
from icrl_core.config import LoraAdapter
from icrl_core.errors import UserError
from icrl_core.io import atomic_dir
from icrl_core.model import load_policy as _load_policy


def policy_for_adapter(folder: Path | str, spec: str | None = None, dtype: str = "float32"):
    """A policy with the saved adapter in `folder` loaded, on the base model it names (or `spec`)."""
    folder = Path(folder)
    meta = read_meta(folder)
    if meta is None:
        raise UserError(f"{folder}: no saved adapter there (see docs/FORMATS.md)")
    spec = spec or meta.get("spec")
    if not spec:
        raise UserError(f"{folder}: the adapter does not name its base model; give it with --spec")
    return _load_policy(spec, dtype, saved_adapter(folder), value_head=bool(meta.get("value_head")),
                       init_adapter=folder)


def convert_adapter(folder: Path | str, output: Path | str | None = None, spec: str | None = None) -> Path:
    """Rewrite a saved adapter (format 1, or a plain PEFT folder) in format 2, in place or to `output`."""
    target = Path(output or folder)
    policy_for_adapter(folder, spec).save_adapter(target)
    return target


def interpolate_adapter(folder: Path | str, scale: float, output: Path | str,
                        load_policy: Callable[[], Any] | None = None) -> Path:
    """Write base + scale * (trained - base) as an adapter folder at `output`, atomically (WiSE-FT; see
    Policy.interpolate_to_reference). A LoRA folder in PEFT's files (format 2, or a plain PEFT folder) needs no
    base model: its delta is (alpha / r) * B @ A, so every lora_B tensor is scaled in the file and the other files
    are copied as they are. Other adapters (last_blocks, format 1) are loaded onto their base model by
    `load_policy()` (default: policy_for_adapter(folder)), interpolated there and saved."""
    import shutil

    from safetensors import safe_open

    if not 0.0 <= scale <= 1.0:
        raise UserError(f"interpolation scale must be in [0, 1], got {scale}")
    folder = Path(folder)
    meta = read_meta(folder)
    kind = ((meta or {}).get("adapter") or {}).get("kind")
    if is_legacy(folder) or kind != "lora" or not (folder / PEFT_WEIGHTS).is_file():
        policy = load_policy() if load_policy is not None else policy_for_adapter(folder)
        policy.interpolate_to_reference(scale)
        policy.save_adapter(output)
        return Path(output)
    tensors = load_safetensors(folder / PEFT_WEIGHTS)
    with safe_open(str(folder / PEFT_WEIGHTS), framework="pt") as handle:
        metadata = handle.metadata()
    scaled = {name: tensor * scale if "lora_B" in name else tensor for name, tensor in tensors.items()}
    with atomic_dir(output) as tmp:
        for path in folder.iterdir():
            if path.is_file() and path.name != PEFT_WEIGHTS:
                shutil.copy2(path, tmp / path.name)
        save_file(scaled, str(tmp / PEFT_WEIGHTS), metadata=metadata)
    return Path(output)


def export_merged(folder: Path | str, output: Path | str, spec: str | None = None, dtype: str = "float32") -> Path:
    """A transformers model folder with the adapter merged into the base weights (W + (alpha/r) B A for LoRA, the
    trained blocks in place for last_blocks) and the tokenizer, loadable by AutoModelForCausalLM.from_pretrained.
    The value head is not part of a causal LM and stays in the adapter folder."""
    policy = policy_for_adapter(folder, spec, dtype)
    model = policy.model.merge_and_unload() if isinstance(policy.adapter, LoraAdapter) else policy.causal_lm
    with atomic_dir(output) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        policy.tokenizer.save_pretrained(str(tmp))
    return Path(output)

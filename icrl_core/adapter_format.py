"""A trained adapter folder on disk (docs/FORMATS.md).

Format 2 (written now):

    adapter_config.json        LoRA only: PEFT's own files, written by PEFT (`PeftModel.save_pretrained`), so
    adapter_model.safetensors  `PeftModel.from_pretrained(base, folder)` loads the adapter without icrl
    blocks.safetensors         other kinds (last_blocks, frozen): the trained parameters by name
    value_head.safetensors     the PPO critic, when there is one (linear.weight (1, H), linear.bias (1,))
    icrl_adapter.json          {"format": 2, "spec", "adapter" (the model.adapter section), "value_head"}

Format 1 (before): adapter.safetensors (the trainable parameters by their names inside the PEFT wrapper) +
adapter.json (+ value_head.safetensors). It still loads; `icrl model convert FOLDER` rewrites it as format 2.
A plain PEFT LoRA folder without icrl_adapter.json (trained elsewhere) loads too: its shape comes from
adapter_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from icrl_core.config import Adapter, FrozenAdapter, LoraAdapter
from icrl_core.errors import CheckpointError, UserError
from icrl_core.io import atomic_dir

FORMAT = 2
META = "icrl_adapter.json"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
BLOCKS = "blocks.safetensors"
VALUE_HEAD = "value_head.safetensors"
LEGACY_META = "adapter.json"
LEGACY_WEIGHTS = "adapter.safetensors"


def is_adapter_folder(folder: Path | str | None) -> bool:
    """True if `folder` holds a saved adapter (format 2, format 1, or a plain PEFT LoRA folder)."""
    if folder is None:
        return False
    folder = Path(folder)
    return any((folder / name).is_file() for name in (META, PEFT_CONFIG, LEGACY_WEIGHTS))


def is_legacy(folder: Path | str) -> bool:
    folder = Path(folder)
    return (folder / LEGACY_WEIGHTS).is_file() and not (folder / META).is_file()


def load_safetensors(path: Path | str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError(f"{path}: corrupt or truncated safetensors file ({exc})") from None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: not a readable JSON file ({error})") from error
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return value


def read_peft_config(folder: Path | str) -> dict:
    """The folder's PEFT adapter_config.json (CheckpointError when it is not a readable JSON object)."""
    return _read_json(Path(folder) / PEFT_CONFIG)


def read_meta(folder: Path | str) -> dict | None:
    """The folder's description: {"spec", "adapter", "value_head"} from icrl_adapter.json (format 2) or adapter.json
    (format 1), or derived from a plain PEFT adapter_config.json (spec: its base model); None if there is none."""
    folder = Path(folder)
    for name in (META, LEGACY_META):
        if (folder / name).is_file():
            return _read_json(folder / name)
    if (folder / PEFT_CONFIG).is_file():
        peft = read_peft_config(folder)
        if peft.get("peft_type") != "LORA":
            raise CheckpointError(f"{folder / PEFT_CONFIG}: a {peft.get('peft_type')} adapter; only LoRA loads")
        try:
            adapter = LoraAdapter(rank=peft["r"], alpha=peft["lora_alpha"], dropout=peft.get("lora_dropout", 0.0),
                                  target_modules=sorted(peft["target_modules"]))
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{folder / PEFT_CONFIG}: not a LoRA config icrl can load ({error})") from error
        return {"spec": peft.get("base_model_name_or_path"), "adapter": adapter.model_dump(mode="json"),
                "value_head": False}
    return None


def saved_adapter(folder: Path | str) -> Adapter | None:
    """The adapter type and shape a saved adapter folder was trained with, or None."""
    from pydantic import TypeAdapter, ValidationError

    meta = read_meta(folder)
    if meta is None:
        return None
    try:
        return TypeAdapter(Adapter).validate_python(meta["adapter"])
    except (KeyError, ValidationError) as error:
        raise CheckpointError(f"{folder}: not a valid adapter description ({error})") from error


def save_adapter(policy, folder: Path | str) -> None:
    """Write `policy`'s trained part in format 2, atomically (the folder is replaced as a whole)."""
    with atomic_dir(folder) as tmp:
        if isinstance(policy.adapter, LoraAdapter):
            _save_peft(policy, tmp)
        else:
            save_file(policy.trainable_state_dict(), str(tmp / BLOCKS))
        if policy.value_head is not None:
            policy.value_head.save(tmp / VALUE_HEAD)
        (tmp / META).write_text(json.dumps({
            "format": FORMAT, "spec": policy.spec, "adapter": policy.adapter.model_dump(mode="json"),
            "value_head": policy.value_head is not None,
        }, indent=2) + "\n")


def _save_peft(policy, tmp: Path) -> None:
    """PEFT writes its two files; its config is then made byte-stable: PEFT keeps target_modules as a set, whose
    order changes with Python's hash seed (the same adapter would get other bytes, so another sha256, on every
    run). Its template model card (README.md) goes: icrl_adapter.json says where the adapter comes from."""
    policy.model.save_pretrained(str(tmp), safe_serialization=True)
    (tmp / "README.md").unlink(missing_ok=True)
    config_file = tmp / PEFT_CONFIG
    config = json.loads(config_file.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))  # as PEFT writes it


def load_value_head(path: Path | str) -> dict[str, torch.Tensor]:
    """The tensors of a saved value head (linear.weight (1, H), linear.bias (1,)), checked."""
    tensors = load_safetensors(path)
    if set(tensors) != {"linear.weight", "linear.bias"} or tensors["linear.weight"].ndim != 2:
        raise CheckpointError(f"{path}: not a value head (tensors: {sorted(tensors)})")
    return tensors


def load_adapter(policy, folder: Path | str) -> None:
    """Load a saved adapter (either format) into `policy`, whose adapter must have the same kind and shape."""
    folder = Path(folder)
    if not is_adapter_folder(folder):
        raise CheckpointError(f"{folder}: not a saved adapter (no {META}, {PEFT_CONFIG} or {LEGACY_WEIGHTS})")
    meta = read_meta(folder) or {}
    kind = (meta.get("adapter") or {}).get("kind")
    if kind is not None and kind != policy.adapter.kind:
        raise CheckpointError(f"{folder}: a {kind} adapter, but this policy has model.adapter.kind="
                              f"{policy.adapter.kind}; was it trained with the same model.adapter?")
    if is_legacy(folder):
        policy.load_trainable_state_dict(load_safetensors(folder / LEGACY_WEIGHTS), str(folder))
    elif isinstance(policy.adapter, LoraAdapter):
        _load_peft(policy, folder)
    elif not isinstance(policy.adapter, FrozenAdapter) or (folder / BLOCKS).is_file():
        policy.load_trainable_state_dict(load_safetensors(folder / BLOCKS), str(folder))
    head = folder / VALUE_HEAD
    if head.exists() and policy.value_head is not None:
        policy.value_head.load_state_dict(load_value_head(head))


def _load_peft(policy, folder: Path) -> None:
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    tensors = load_safetensors(folder / PEFT_WEIGHTS)
    expected = get_peft_model_state_dict(policy.model)
    missing, unexpected = set(expected) - set(tensors), set(tensors) - set(expected)
    if missing or unexpected:
        raise CheckpointError(
            f"{folder} does not match this policy's LoRA layers (missing {sorted(missing)[:3]}..., unexpected "
            f"{sorted(unexpected)[:3]}...); was it trained with the same model.spec and model.adapter?")
    for name, value in tensors.items():
        if expected[name].shape != value.shape:
            raise CheckpointError(f"{folder}: {name} has shape {tuple(value.shape)}, expected "
                                  f"{tuple(expected[name].shape)}")
    set_peft_model_state_dict(policy.model, tensors)


def require_adapter(folder: Path | str, what: str, hint: str = "not a trained adapter folder") -> Path:
    """`folder` if it holds a saved adapter, else a UserError naming `what` (e.g. 'evaluate.adapter')."""
    if not is_adapter_folder(folder):
        raise UserError(f"{what} {folder}: no saved adapter there ({hint})")
    return Path(folder)

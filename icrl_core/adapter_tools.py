"""Operations on a saved adapter folder that need its base model (docs/FORMATS.md): load it as a policy, rewrite
it in the current format, interpolate it toward the base model, extrapolate a fine-tuning step beyond its end point,
export it merged into a transformers folder.
The folder format itself is icrl_core/adapter_format.py, below icrl_core/model.py; this module is above both."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from icrl_core.adapter_format import (
    META,
    PEFT_CONFIG,
    PEFT_WEIGHTS,
    is_legacy,
    load_safetensors,
    read_meta,
    read_peft_config,
    saved_adapter,
)
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


def _peft_lora_meta(folder: Path) -> dict | None:
    """The folder's description if it is a LoRA adapter in PEFT's files (format 2 or a plain PEFT folder), whose
    weights can be rewritten in the file without the base model; None otherwise."""
    meta = read_meta(folder)
    kind = ((meta or {}).get("adapter") or {}).get("kind")
    if is_legacy(folder) or kind != "lora" or not (folder / PEFT_WEIGHTS).is_file():
        return None
    return meta


def _weights_metadata(folder: Path) -> dict[str, str] | None:
    """The header metadata of the folder's PEFT weights file (kept when the file is rewritten)."""
    from safetensors import safe_open

    with safe_open(str(folder / PEFT_WEIGHTS), framework="pt") as handle:
        return handle.metadata()


def interpolate_adapter(folder: Path | str, scale: float, output: Path | str,
                        load_policy: Callable[[], Any] | None = None) -> Path:
    """Write base + scale * (trained - base) as an adapter folder at `output`, atomically (WiSE-FT; see
    Policy.interpolate_to_reference). A LoRA folder in PEFT's files (format 2, or a plain PEFT folder) needs no
    base model: its delta is (alpha / r) * B @ A, so every lora_B tensor is scaled in the file and the other files
    are copied as they are. Other adapters (last_blocks, format 1) are loaded onto their base model by
    `load_policy()` (default: policy_for_adapter(folder)), interpolated there and saved."""
    import shutil

    if not 0.0 <= scale <= 1.0:
        raise UserError(f"interpolation scale must be in [0, 1], got {scale}")
    folder = Path(folder)
    if _peft_lora_meta(folder) is None:
        policy = load_policy() if load_policy is not None else policy_for_adapter(folder)
        policy.interpolate_to_reference(scale)
        policy.save_adapter(output)
        return Path(output)
    tensors = load_safetensors(folder / PEFT_WEIGHTS)
    metadata = _weights_metadata(folder)
    scaled = {name: tensor * scale if "lora_B" in name else tensor for name, tensor in tensors.items()}
    with atomic_dir(output) as tmp:
        for path in folder.iterdir():
            if path.is_file() and path.name != PEFT_WEIGHTS:
                shutil.copy2(path, tmp / path.name)
        save_file(scaled, str(tmp / PEFT_WEIGHTS), metadata=metadata)
    return Path(output)


def extrapolate_adapter(start: Path | str, trained: Path | str, scale: float, output: Path | str) -> Path:
    """Write W_start + scale * (W_trained - W_start) as a LoRA adapter folder at `output`, atomically: the step a
    fine-tuning stage took from `start` to `trained` (e.g. the RL stage from the supervised bootstrap it continued),
    taken `scale` times (scale > 1 extrapolates past `trained`, as ExPO does for aligned models; 1 gives `trained`'s
    weights, 0 `start`'s). Both must be LoRA folders in PEFT's files with the same rank, alpha and target modules.
    Each delta is (alpha / r) * B @ A, so the result is exact as a LoRA of twice the rank and twice the alpha (same
    alpha / r): A' = [A_trained; A_start] (2r x in), B' = [scale * B_trained, (1 - scale) * B_start] (out x 2r),
    and B' @ A' = scale * B_trained @ A_trained + (1 - scale) * B_start @ A_start. Standard files: PEFT loads the
    folder as it is. The other files (icrl_adapter.json, the value head) are `trained`'s, with the rank and alpha
    doubled."""
    import json
    import math
    import shutil

    import torch

    if not (math.isfinite(scale) and scale >= 0):
        raise UserError(f"extrapolation scale must be a finite number >= 0, got {scale}")
    folders = {"start": Path(start), "trained": Path(trained)}
    configs = {}
    for role, folder in folders.items():
        if read_meta(folder) is None:
            raise UserError(f"{folder}: no saved adapter there (see docs/FORMATS.md)")
        if _peft_lora_meta(folder) is None or not (folder / PEFT_CONFIG).is_file():
            raise UserError(f"{folder}: extrapolation needs a LoRA adapter in PEFT's files (the {role} adapter "
                            "is not one; `icrl model convert` rewrites an old one)")
        config = read_peft_config(folder)
        if config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern") \
                or config.get("use_dora"):
            raise UserError(f"{folder}: rsLoRA, DoRA and per-module ranks or alphas are not supported here")
        configs[role] = config
    shape = {role: (c.get("r"), c.get("lora_alpha"), sorted(c.get("target_modules") or []))
             for role, c in configs.items()}
    if shape["start"] != shape["trained"]:
        raise UserError(f"{folders['trained']} (rank, alpha, modules {shape['trained']}) did not continue "
                        f"{folders['start']} ({shape['start']}): extrapolation needs the same LoRA shape")
    weights = {role: load_safetensors(folder / PEFT_WEIGHTS) for role, folder in folders.items()}
    if set(weights["start"]) != set(weights["trained"]):
        raise UserError(f"{folders['trained']} and {folders['start']} hold different LoRA tensors")
    stacked = {}
    for name, trained_tensor in weights["trained"].items():
        start_tensor = weights["start"][name]
        if "lora_A" in name:  # (r, in): rows stacked
            stacked[name] = torch.cat([trained_tensor, start_tensor], dim=0).contiguous()
        elif "lora_B" in name:  # (out, r): columns stacked, each side scaled
            stacked[name] = torch.cat([scale * trained_tensor, (1.0 - scale) * start_tensor], dim=1).contiguous()
        else:
            raise UserError(f"{folders['trained'] / PEFT_WEIGHTS}: unexpected tensor {name} in a LoRA adapter")
    rank, alpha = 2 * configs["trained"]["r"], 2 * configs["trained"]["lora_alpha"]
    trained_folder = folders["trained"]
    with atomic_dir(output) as tmp:
        for path in trained_folder.iterdir():
            if path.is_file() and path.name not in (PEFT_WEIGHTS, PEFT_CONFIG, META):
                shutil.copy2(path, tmp / path.name)
        (tmp / PEFT_CONFIG).write_text(json.dumps({**configs["trained"], "r": rank, "lora_alpha": alpha},
                                                  indent=2) + "\n")
        if (trained_folder / META).is_file():  # format 2: its description, with the new shape
            meta = read_meta(trained_folder)
            meta["adapter"] = {**meta["adapter"], "rank": rank, "alpha": alpha}
            (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        save_file(stacked, str(tmp / PEFT_WEIGHTS), metadata=_weights_metadata(trained_folder))
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

"""Operations on a saved adapter folder that need its base model (docs/FORMATS.md): load it as a policy, rewrite
it in the current format, interpolate it toward the base model, extrapolate a fine-tuning step beyond its end point,
export it merged into a transformers folder.
The folder format itself is icrl_core/adapter_format.py, below icrl_core/model.py; this module is above both."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    weights, 0 `start`'s). It is combine_adapters([trained, start], [scale, 1 - scale]): a LoRA of twice the rank
    and twice the alpha, A' = [A_trained; A_start], B' = [scale * B_trained, (1 - scale) * B_start]."""
    import math

    if not (math.isfinite(scale) and scale >= 0):
        raise UserError(f"extrapolation scale must be a finite number >= 0, got {scale}")
    return combine_adapters([trained, start], [scale, 1.0 - scale], output, roles=["trained", "start"])


def combine_adapters(folders: Sequence[Path | str], weights: Sequence[float], output: Path | str,
                     roles: Sequence[str] | None = None) -> Path:
    """Write sum_i weights[i] * W_i as a LoRA adapter folder at `output`, atomically, for LoRA adapters W_i of one
    base model (model soups: equal weights; task arithmetic: W_a + W_b - W_start = weights 1, 1, -1; ExPO:
    extrapolate_adapter). The weights must sum to 1 (an affine combination), so the base model's weights count once:
    sum_i w_i (W_base + D_i) = W_base + sum_i w_i D_i. Each D_i = (alpha / r_i) * B_i @ A_i with one alpha / r for
    all parts, so the result is exact as one LoRA of rank R = sum_i r_i and alpha R * (alpha / r): A' = [A_1; ...;
    A_n] (R x in), B' = [w_1 B_1, ..., w_n B_n] (out x R), B' @ A' = sum_i w_i B_i @ A_i. All parts must be LoRA
    folders in PEFT's files with the same alpha / r, target modules and tensors. Standard files: PEFT loads the
    folder as it is. The other files (icrl_adapter.json, the value head) are the first part's, with the new rank
    and alpha. `roles` names the parts in error messages (default: part 1, part 2, ...)."""
    import json
    import math
    import shutil

    import torch

    folders = [Path(folder) for folder in folders]
    roles = list(roles) if roles is not None else [f"part {i + 1}" for i in range(len(folders))]
    if len(folders) < 2 or len(weights) != len(folders):
        raise UserError(f"combining adapters needs two or more adapters and one weight each, got {len(folders)} "
                        f"adapter(s) and {len(weights)} weight(s)")
    if not all(math.isfinite(w) for w in weights) or abs(sum(weights) - 1.0) > 1e-6:
        raise UserError(f"the weights must be finite and sum to 1 (the base model's weights then count once), got "
                        f"{', '.join(f'{w:g}' for w in weights)} (sum {sum(weights):g})")
    configs, specs = [], []
    for role, folder in zip(roles, folders):
        meta = read_meta(folder)
        if meta is None:
            raise UserError(f"{folder}: no saved adapter there (see docs/FORMATS.md)")
        specs.append(meta.get("spec"))
        if _peft_lora_meta(folder) is None or not (folder / PEFT_CONFIG).is_file():
            raise UserError(f"{folder}: combining needs a LoRA adapter in PEFT's files (the {role} adapter is not "
                            "one; `icrl model convert` rewrites an old one)")
        config = read_peft_config(folder)
        if config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern") \
                or config.get("use_dora"):
            raise UserError(f"{folder}: rsLoRA, DoRA and per-module ranks or alphas are not supported here")
        configs.append(config)
    for role, folder, spec in zip(roles[1:], folders[1:], specs[1:]):
        if spec != specs[0]:  # deltas of different base models do not add
            raise UserError(f"{folder} was trained on {spec!r}, {folders[0]} on {specs[0]!r}: the {role} adapter "
                            "must share the base model")
    shapes = [(c.get("lora_alpha") / c.get("r"), sorted(c.get("target_modules") or [])) for c in configs]
    for role, folder, shape in zip(roles[1:], folders[1:], shapes[1:]):
        if shape != shapes[0]:
            raise UserError(f"{folder} (alpha / r, modules {shape}) and {folders[0]} ({shapes[0]}) are not LoRAs of "
                            f"one shape: the {role} adapter did not continue or parallel the {roles[0]} adapter")
    tensors = [load_safetensors(folder / PEFT_WEIGHTS) for folder in folders]
    for folder, part in zip(folders[1:], tensors[1:]):
        if set(part) != set(tensors[0]):
            raise UserError(f"{folder} and {folders[0]} hold different LoRA tensors")
    stacked = {}
    for name in tensors[0]:
        if "lora_A" in name:  # (r_i, in): rows stacked
            stacked[name] = torch.cat([part[name] for part in tensors], dim=0).contiguous()
        elif "lora_B" in name:  # (out, r_i): columns stacked, each scaled by its weight
            stacked[name] = torch.cat([w * part[name] for w, part in zip(weights, tensors)], dim=1).contiguous()
        else:
            raise UserError(f"{folders[0] / PEFT_WEIGHTS}: unexpected tensor {name} in a LoRA adapter")
    rank = sum(c["r"] for c in configs)
    alpha = sum(c["lora_alpha"] for c in configs)  # = rank * (alpha / r), since every part has that alpha / r
    first = folders[0]
    with atomic_dir(output) as tmp:
        for path in first.iterdir():
            if path.is_file() and path.name not in (PEFT_WEIGHTS, PEFT_CONFIG, META):
                shutil.copy2(path, tmp / path.name)
        (tmp / PEFT_CONFIG).write_text(json.dumps({**configs[0], "r": rank, "lora_alpha": alpha}, indent=2) + "\n")
        if (first / META).is_file():  # format 2: its description, with the new shape
            meta = read_meta(first)
            meta["adapter"] = {**meta["adapter"], "rank": rank, "alpha": alpha}
            (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        save_file(stacked, str(tmp / PEFT_WEIGHTS), metadata=_weights_metadata(first))
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

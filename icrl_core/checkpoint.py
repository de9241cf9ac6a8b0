"""Training checkpoints: written atomically, verified on load.

A checkpoint is a folder:

    manifest.json          step, format version, sha256 + size of every other file, user state (JSON)
    trainable.safetensors  the trained weights (LoRA matrices or last blocks) and value/reward head
    optimizer.pt           optimizer + scheduler state dicts (tensors, numbers, lists: loads with weights_only)
    rng.pt                 torch RNG state + numpy/python RNG states

The folder is built under a temporary name and renamed into place, so a crash leaves either the previous
checkpoint or the new one. On load every file's size and hash is checked against the manifest; a truncated or
corrupt checkpoint raises `CheckpointError` and is never loaded.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from icrl_core.errors import CheckpointError
from icrl_core.io import atomic_dir, sha256_file

FORMAT_VERSION = 1
_NAME = re.compile(r"^step-(\d{8})$")


@dataclass
class TrainingState:
    """Everything needed to continue a run exactly where it stopped."""

    step: int
    tensors: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None = None
    rng: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def capture_rng(numpy_rng: np.random.Generator | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if numpy_rng is not None:
        state["numpy"] = numpy_rng.bit_generator.state
    return state


def restore_rng(state: Mapping[str, Any], numpy_rng: np.random.Generator | None = None) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "python" in state:
        python_state = state["python"]
        random.setstate((python_state[0], tuple(python_state[1]), python_state[2]))
    if numpy_rng is not None and "numpy" in state:
        numpy_rng.bit_generator.state = state["numpy"]


def write_checkpoint(folder: Path | str, state: TrainingState) -> Path:
    """Write `state` into `folder` atomically (temporary sibling + rename)."""
    folder = Path(folder)
    with atomic_dir(folder) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in state.tensors.items()},
                  str(tmp / "trainable.safetensors"))
        torch.save({"optimizer": state.optimizer, "scheduler": state.scheduler}, tmp / "optimizer.pt")
        rng = dict(state.rng)
        torch.save({"torch": rng.pop("torch", None), "python": rng.pop("python", None)}, tmp / "rng.pt")
        files = {}
        for path in sorted(tmp.iterdir()):
            files[path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        manifest = {"format": FORMAT_VERSION, "step": state.step, "files": files, "extra": state.extra,
                    "numpy_rng": rng.get("numpy")}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, default=_json_default))
    return folder


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def verify_checkpoint(folder: Path | str) -> dict[str, Any]:
    """Check the manifest and every file; return the manifest or raise `CheckpointError`."""
    folder = Path(folder)
    manifest_path = folder / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: not a checkpoint (manifest.json missing)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{manifest_path}: corrupt manifest ({exc.msg})") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{folder}: checkpoint format {manifest.get('format')}, expected {FORMAT_VERSION}")
    for name, info in manifest.get("files", {}).items():
        path = folder / name
        if not path.exists():
            raise CheckpointError(f"{folder}: {name} is missing")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"{folder}: {name} is truncated or altered ({size} bytes, manifest says "
                                  f"{info['bytes']})")
        if sha256_file(path) != info["sha256"]:
            raise CheckpointError(f"{folder}: {name} is corrupt (sha256 does not match the manifest)")
    return manifest


def read_checkpoint(folder: Path | str) -> TrainingState:
    """Load a verified checkpoint. Pickled parts load with `weights_only=True`."""
    folder = Path(folder)
    manifest = verify_checkpoint(folder)
    try:
        tensors = load_file(str(folder / "trainable.safetensors"))
        opt = torch.load(folder / "optimizer.pt", weights_only=True, map_location="cpu")
        rng_torch = torch.load(folder / "rng.pt", weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any unreadable part (safetensors, unpickling, I/O) is a CheckpointError
        raise CheckpointError(f"{folder}: cannot be read ({exc})") from None
    rng = {k: v for k, v in rng_torch.items() if v is not None}
    if manifest.get("numpy_rng") is not None:
        rng["numpy"] = manifest["numpy_rng"]
    return TrainingState(step=int(manifest["step"]), tensors=tensors, optimizer=opt["optimizer"],
                         scheduler=opt.get("scheduler"), rng=rng, extra=manifest.get("extra", {}))


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(root: Path | str) -> list[Path]:
    """Complete checkpoint folders under `root`, oldest first (temporary folders are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(root: Path | str) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_rotating(root: Path | str, state: TrainingState, keep: int = 2) -> Path:
    """Write `root/step-NNNNNNNN` and delete older checkpoints beyond the newest `keep`."""
    root = Path(root)
    path = write_checkpoint(root / checkpoint_name(state.step), state)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return path

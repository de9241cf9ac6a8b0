"""Where tensors live: the device a model runs on (config `model.device`) and the torch.distributed backend that
goes with it.

Models are built and seeded on the CPU and then moved (icrl_core.model.load_policy), and batches are built on
the CPU and moved where they meet the model, so the CPU run is unchanged and a GPU run starts from the same
numbers. Sampling keeps its seeded CPU generators (the draws do not depend on the device)."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch
from torch import nn

from icrl_core.errors import UserError

DEVICES = ("auto", "cpu", "cuda")
B = TypeVar("B")


def select_device(requested: str, cuda_available: bool) -> str:
    """'auto' -> 'cuda' when a CUDA device is available, else 'cpu'; 'cpu' always; 'cuda' only when available
    (else a UserError rather than a silent fall-back to a much slower CPU run)."""
    if requested not in DEVICES:
        raise UserError(f"model.device '{requested}': use one of {', '.join(DEVICES)}")
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    if requested == "cuda" and not cuda_available:
        raise UserError("model.device 'cuda': no CUDA device is visible here (torch.cuda.is_available() is False); "
                        "use 'auto' or 'cpu'")
    return requested


def collective_backend(device: str) -> str:
    """The torch.distributed backend for data-parallel workers on `device`: NCCL between GPUs, gloo on CPUs."""
    return "nccl" if device == "cuda" else "gloo"


def resolve_device(requested: str = "auto") -> torch.device:
    """`select_device` for this process. 'cuda' is the current CUDA device (Ray Train sets it per worker)."""
    return torch.device(select_device(requested, torch.cuda.is_available()))


def module_device(module: nn.Module) -> torch.device:
    """Where a module's weights live (the device its inputs must be on)."""
    return next(module.parameters()).device


def to_device(batch: B, device: torch.device | str) -> B:
    """A copy of a dataclass of tensors with every tensor field on `device` (the same object's tensors when they
    are there already, e.g. on the CPU)."""
    moved = {f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **moved)

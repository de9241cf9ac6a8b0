"""Data-parallel helpers on torch.distributed (gloo on CPU). With one process they are no-ops.

Gradients are averaged with all_reduce after backward, which is what DDP does; the policy is not wrapped in
DistributedDataParallel because its forward goes through the backbone, the LM head and the value head
separately (see Policy.forward)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def shard(items: Sequence[T], rank_: int | None = None, world: int | None = None) -> list[T]:
    """Every `world`-th item starting at `rank`: disjoint, near-equal shards."""
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    return list(items[rank_::world])


def average_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """grad <- mean over processes of grad (flattened into one all_reduce)."""
    if not is_distributed():
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g).to(g.dtype))
        offset += n


def mean_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Average scalar metrics over processes (same keys on every rank)."""
    if not is_distributed() or not metrics:
        return dict(metrics)
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    values /= dist.get_world_size()
    return {k: float(v) for k, v in zip(keys, values)}


def broadcast_parameters(params: Sequence[torch.nn.Parameter], src: int = 0) -> None:
    """Make every process start from rank `src`'s trainable weights."""
    if not is_distributed():
        return
    for p in params:
        dist.broadcast(p.data, src=src)

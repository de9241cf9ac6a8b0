"""The bootstrap loop (tiny model): deterministic and resumes bitwise, and two gloo worker processes train like
one process. Its parts: tests/unit/test_supervised.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from icrl_core.checkpoint import list_checkpoints
from icrl_core.config import BootstrapConfig
from icrl_core.supervised import train_bootstrap
from tasks.runtime import LocalRuntime
from tests.conftest import timeless
from tests.stage_helpers import keyword_rows
from tests.unit.test_supervised import _lora_policy


def _cfg(**kw):
    base = {"max_steps": 6, "batch_size": 2, "grad_accum": 2, "save_steps": 3, "eval_steps": 3, "learning_rate": 5e-3,
            "kl_beta": 0.1, "max_eval_episodes": 4, "warmup_steps": 1}
    base.update(kw)
    return BootstrapConfig(**base)


def test_bootstrap_is_deterministic_and_resumes_bitwise(tmp_path, tokens):
    train, val = keyword_rows(tokens)
    runs = {}
    for name in ("a", "b"):
        policy = _lora_policy()
        runtime = LocalRuntime(tmp_path / name)
        metrics, history = train_bootstrap(policy, train, val, _cfg(), seed=7, runtime=runtime)
        assert [h["step"] for h in history] == [h["step"] for h in runtime.history] == [1, 2, 3, 4, 5, 6]
        runs[name] = (metrics, policy.trainable_state_dict(), history)
    (ma, wa, ha), (mb, wb, _) = runs["a"], runs["b"]
    assert ha[-1]["loss"] < ha[0]["loss"]  # it learns
    assert timeless(ma) == timeless(mb)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # resume: a fresh run that finds only the step-3 checkpoint ends exactly where the full run ended
    step3 = [p for p in list_checkpoints(tmp_path / "a") if p.name.endswith("00000003")]
    assert step3, list_checkpoints(tmp_path / "a")
    shutil.copytree(step3[0], tmp_path / "resumed" / step3[0].name)
    policy = _lora_policy()
    runtime = LocalRuntime(tmp_path / "resumed")
    mr, hr = train_bootstrap(policy, train, val, _cfg(), seed=7, runtime=runtime)
    assert [h["step"] for h in runtime.history] == [4, 5, 6]

    assert timeless(hr) == timeless(ha)  # the history before the checkpoint comes back with it
    assert timeless(mr) == timeless(ma)
    wr = policy.trainable_state_dict()
    assert all(torch.equal(wa[k], wr[k]) for k in wa)


def _dp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One data-parallel rank (torch.distributed over gloo) running the real bootstrap loop."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        policy = _lora_policy()
        train, val = keyword_rows(policy.tokens, n_queries=2, n_queries_min=1)
        runtime = LocalRuntime(Path(out_dir) / f"ckpt-{world}", rank=rank, world_size=world)
        metrics, _ = train_bootstrap(policy, train, val, _cfg(max_steps=3, save_steps=10, eval_steps=3), seed=5,
                                     runtime=runtime)
        if rank == 0:
            torch.save({"metrics": metrics, "weights": policy.trainable_state_dict()}, Path(out_dir) / f"{world}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_workers_train_like_one_process(tmp_path, tokens):
    """The whole loop under torch.distributed with 2 processes ends where one process ends (same global
    batches; equal up to float summation order)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_dp_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    policy = _lora_policy()
    train, val = keyword_rows(tokens, n_queries=2, n_queries_min=1)
    single, _ = train_bootstrap(policy, train, val, _cfg(max_steps=3, save_steps=10, eval_steps=3), seed=5,
                                runtime=LocalRuntime(tmp_path / "ckpt-1"))
    two = torch.load(tmp_path / "2.pt", weights_only=True)
    for key in ("loss", "ce", "kl", "val_loss", "val_answer_accuracy", "val_queries"):
        assert two["metrics"][key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), key
    weights = policy.trainable_state_dict()
    assert all(torch.allclose(weights[k], two["weights"][k], atol=1e-6, rtol=1e-4) for k in weights)

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from icrl_core.checkpoint import (
    TrainingState,
    capture_rng,
    latest_checkpoint,
    read_checkpoint,
    restore_rng,
    save_rotating,
    write_checkpoint,
)
from icrl_core.errors import CheckpointError


def _state(step=3):
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return TrainingState(step=step, tensors=dict(model.state_dict()), optimizer=opt.state_dict(),
                         scheduler=sched.state_dict(), rng=capture_rng(np.random.default_rng(5)),
                         extra={"epoch": 1, "history": [0.5, 0.25]})


def test_round_trip_restores_everything(tmp_path):
    state = _state()
    write_checkpoint(tmp_path / "ck", state)
    loaded = read_checkpoint(tmp_path / "ck")
    assert loaded.step == 3 and loaded.extra == state.extra
    for k, v in state.tensors.items():
        assert torch.equal(v, loaded.tensors[k])
    assert loaded.optimizer["state"][0]["exp_avg"].equal(state.optimizer["state"][0]["exp_avg"])
    rng = np.random.default_rng(0)
    restore_rng(loaded.rng, rng)
    assert rng.random() == np.random.default_rng(5).random()
    torch_next = torch.rand(1)
    restore_rng(loaded.rng)
    assert torch.equal(torch.rand(1), torch_next)
    py_next = random.random()
    restore_rng(loaded.rng)
    assert random.random() == py_next


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_corrupt_or_truncated_checkpoints_are_refused(tmp_path, damage):
    folder = write_checkpoint(tmp_path / "ck", _state())
    target = folder / "trainable.safetensors"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif damage == "delete":
        (folder / "optimizer.pt").unlink()
    else:
        (folder / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError):
        read_checkpoint(folder)


def test_rotation_keeps_newest_and_ignores_temporary_folders(tmp_path):
    for step in (1, 2, 3):
        save_rotating(tmp_path, _state(step), keep=2)
    (tmp_path / ".step-00000004.abc.tmp").mkdir()  # a crash mid-write leaves only a temp folder
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "step-00000002", "step-00000003"]

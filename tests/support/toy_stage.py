"""A minimal training stage (linear regression) that follows the runtime contract: used to test the Ray Train
and local runtimes without a language model."""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from icrl_core import distributed
from icrl_core.checkpoint import TrainingState, capture_rng, restore_rng


def train_worker(config, runtime) -> dict:
    torch.manual_seed(config.seed)
    data_rng = np.random.default_rng(config.seed)
    x = torch.tensor(data_rng.normal(size=(64, 4)), dtype=torch.float32)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    state = runtime.load_latest_checkpoint()
    if state is not None:
        model.load_state_dict(state.tensors)
        opt.load_state_dict(state.optimizer)
        restore_rng(state.rng, data_rng)
        start = state.step
    distributed.broadcast_parameters(list(model.parameters()))
    steps = config.bootstrap.max_steps
    loss = torch.tensor(0.0)
    for step in range(start + 1, steps + 1):
        batch = data_rng.choice(64, size=16, replace=False)
        mine = distributed.shard(list(batch))
        opt.zero_grad()
        pred = model(x[mine]).squeeze(-1)
        # sum over my shard / global batch size: averaging over ranks then equals the full-batch mean
        loss = ((pred - y[mine]) ** 2).sum() / len(batch) * distributed.world_size()
        loss.backward()
        distributed.average_gradients(list(model.parameters()))
        opt.step()
        runtime.report(distributed.mean_metrics({"loss": loss.item()}), step)
        if step % config.bootstrap.save_steps == 0:
            runtime.save_checkpoint(TrainingState(step, dict(model.state_dict()), opt.state_dict(),
                                                  rng=capture_rng(data_rng)))
        delay = float(os.environ.get("ICRL_TOY_STEP_SECONDS", "0"))
        if delay:
            time.sleep(delay)
    import psutil

    # the addresses this process listens on while its process group is up (rank 0 holds the rendezvous store)
    listening = sorted({c.laddr.ip for c in psutil.Process().net_connections(kind="tcp") if c.status == "LISTEN"})
    return {"final_loss": float(loss.item()) / distributed.world_size(),
            "weight": [round(float(w), 6) for w in model.weight.detach().view(-1)], "rank": runtime.rank,
            "world_size": runtime.world_size, "listening": listening}

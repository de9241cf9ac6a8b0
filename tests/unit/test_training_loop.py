"""icrl_core/training_loop.py: the loop bootstrap, reward model and PPO share. A toy trainer (one weight, SGD,
steps seeded by their number) checks when it evaluates, reports and checkpoints, and that a run killed after a
checkpoint resumes to the uninterrupted result."""

from __future__ import annotations

import pytest
import torch

from icrl_core.training_loop import Schedule, Trainer, run_loop
from tests.conftest import Killed
from tests.conftest import MemoryRuntime as SharedRuntime


class MemoryRuntime(SharedRuntime):
    """The shared in-memory runtime, recording only the steps reported."""

    def report(self, metrics, step):
        self.reports.append(step)


def toy_trainer(with_eval: bool = True) -> tuple[Trainer, torch.nn.Parameter, list]:
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    counter = {"updates": 0}  # the trainer's own state, carried by the checkpoint

    def step(number: int) -> dict[str, float]:
        target = float(torch.randn(1, generator=torch.Generator().manual_seed(number)))
        optimizer.zero_grad()
        loss = (weight - target).pow(2).sum()
        loss.backward()
        optimizer.step()
        scheduler.step()
        counter["updates"] += 1
        return {"loss": float(loss.detach()), "noise": float(torch.rand(1))}  # the global RNG must come back on resume

    def load_state(extra):
        counter["updates"] = extra["updates"]

    trainer = Trainer(step, optimizer, scheduler, [weight], lambda: {"w": weight.detach().clone()},
                      lambda tensors: weight.data.copy_(tensors["w"]),
                      (lambda: {"val": float(weight.detach())}) if with_eval else None,
                      state=lambda number: {"updates": counter["updates"]}, load_state=load_state)
    return trainer, weight, counter


def test_schedule_evaluates_reports_and_checkpoints_after_the_last_step_too():
    trainer, _, _ = toy_trainer()
    runtime = MemoryRuntime()
    result = run_loop(trainer, Schedule(max_steps=7, eval_steps=3, save_steps=2, evaluate_first=True), runtime)
    assert [c.step for c in runtime.checkpoints] == [2, 4, 6, 7]  # the last step is saved
    assert [e["step"] for e in result.evals] == [0, 3, 6, 7]
    assert runtime.reports == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [h["step"] for h in result.history] == list(range(1, 8))
    assert "val" in result.history[2] and "val" not in result.history[3] and result.last["step"] == 7
    silent = MemoryRuntime()
    no_eval = run_loop(toy_trainer(with_eval=False)[0], Schedule(3, 1, 5, evaluate_first=True), silent)
    assert no_eval.evals == [] and silent.reports == [1, 2, 3] and [c.step for c in silent.checkpoints] == [3]


def test_a_killed_run_resumes_to_the_uninterrupted_result():
    schedule = Schedule(max_steps=6, eval_steps=2, save_steps=2, evaluate_first=True)
    torch.manual_seed(0)
    trainer, weight, counter = toy_trainer()
    full = run_loop(trainer, schedule, MemoryRuntime())
    expected = (float(weight.detach()), counter["updates"])

    torch.manual_seed(0)
    saved: list = []
    with pytest.raises(Killed):
        run_loop(toy_trainer()[0], schedule, MemoryRuntime(saved, kill_after=2))  # dies after step 4's checkpoint
    torch.manual_seed(123)  # a new process: another RNG state until the checkpoint's comes back
    trainer, weight, counter = toy_trainer()
    runtime = MemoryRuntime(saved)
    resumed = run_loop(trainer, schedule, runtime)
    assert runtime.reports == [5, 6]  # no second step-0 evaluation
    assert resumed.history == full.history and resumed.evals == full.evals
    assert (float(weight.detach()), counter["updates"]) == expected
    # a run that was killed after its final checkpoint has nothing left to do
    done = MemoryRuntime(runtime.checkpoints[-1:])
    again = run_loop(toy_trainer()[0], schedule, done)
    assert done.reports == [] and again.history == full.history

"""The training loop every training stage shares (bootstrap, reward model, PPO in both modes):

    state = runtime.load_latest_checkpoint()
    if state: restore weights, optimizer, schedule, RNG, history, evaluations and the trainer's own state
    broadcast the trainable weights (every data-parallel rank starts from rank 0's)
    if evaluate_first and nothing was done yet: evaluate and report at step 0
    for step in start + 1 .. max_steps:                   (steps are 1-based: step s is the s-th optimizer update)
        metrics = trainer.step(step)
        if step % eval_steps == 0 or step == max_steps:  metrics |= trainer.evaluate()
        runtime.report(metrics, step)
        if step % save_steps == 0 or step == max_steps:  runtime.save_checkpoint(state after step)

The checkpoint after the last step means a run killed while writing its outputs resumes with nothing to redo.
A trainer's step must be a pure function of (seed, step) and the restored state (data order, sampling RNG) so a
resumed run continues exactly as an uninterrupted one. The loop talks only to a runtime (`tasks/runtime.py`:
`report`, `save_checkpoint`, `load_latest_checkpoint`), so it runs in one process or in Ray Train workers alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from icrl_core.checkpoint import TrainingState, capture_rng, restore_rng
from icrl_core.distributed import broadcast_parameters


@dataclass
class Schedule:
    """When the loop stops, evaluates and checkpoints (a stage config's max_steps, eval_steps, save_steps)."""

    max_steps: int
    eval_steps: int
    save_steps: int
    evaluate_first: bool = False  # also evaluate the starting weights (reported at step 0)

    def evaluates_at(self, step: int) -> bool:
        return step % self.eval_steps == 0 or step == self.max_steps

    def saves_at(self, step: int) -> bool:
        return step % self.save_steps == 0 or step == self.max_steps


@dataclass
class Trainer:
    """What one stage trains and how one step goes.

    step(s) -> metrics          optimizer update s (1-based)
    evaluate() -> metrics       validation metrics (None: the stage has no validation data)
    tensors() / load_tensors()  the trainable weights a checkpoint carries
    state(s) / load_state(d)    the stage's own JSON state beside them (e.g. PPO's adaptive KL coefficient)"""

    step: Callable[[int], dict[str, float]]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    parameters: Sequence[torch.Tensor]
    tensors: Callable[[], dict[str, torch.Tensor]]
    load_tensors: Callable[[dict[str, torch.Tensor]], None]
    evaluate: Callable[[], dict[str, float]] | None = None
    state: Callable[[int], dict[str, Any]] = lambda step: {}
    load_state: Callable[[Mapping[str, Any]], None] = lambda extra: None


@dataclass
class LoopResult:
    """Every step's metrics (validation metrics merged in on evaluation steps) and every evaluation."""

    history: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)

    @property
    def last(self) -> dict:
        return self.history[-1] if self.history else {}


def restore(trainer: Trainer, state: TrainingState) -> None:
    trainer.load_tensors(state.tensors)
    trainer.optimizer.load_state_dict(state.optimizer)
    if state.scheduler is not None:
        trainer.scheduler.load_state_dict(state.scheduler)
    restore_rng(state.rng)
    trainer.load_state(state.extra)


def checkpoint_state(trainer: Trainer, step: int, result: LoopResult) -> TrainingState:
    return TrainingState(step=step, tensors=trainer.tensors(), optimizer=trainer.optimizer.state_dict(),
                         scheduler=trainer.scheduler.state_dict(), rng=capture_rng(),
                         extra={"history": result.history, "evals": result.evals, **trainer.state(step)})


def run_loop(trainer: Trainer, schedule: Schedule, runtime) -> LoopResult:
    """Steps 1..schedule.max_steps of `trainer`, resuming after the runtime's latest checkpoint (see the module
    docstring). Returns the history and evaluations of the whole run, the resumed part included."""
    result = LoopResult()
    start = 0
    state = runtime.load_latest_checkpoint()
    if state is not None:
        restore(trainer, state)
        start = state.step
        result = LoopResult(list(state.extra.get("history", [])), list(state.extra.get("evals", [])))
    broadcast_parameters(trainer.parameters)
    if schedule.evaluate_first and start == 0 and trainer.evaluate is not None:
        metrics = trainer.evaluate()
        result.evals.append({"step": 0, **metrics})
        runtime.report(metrics, 0)
    for step in range(start + 1, schedule.max_steps + 1):
        metrics = trainer.step(step)
        if trainer.evaluate is not None and schedule.evaluates_at(step):
            evaluation = trainer.evaluate()
            result.evals.append({"step": step, **evaluation})
            metrics.update(evaluation)
        result.history.append({"step": step, **metrics})
        runtime.report(metrics, step)
        if schedule.saves_at(step):
            runtime.save_checkpoint(checkpoint_state(trainer, step, result))
    return result

"""Asynchronous stream rollouts (`ppo.async_rollouts`): the pure part. Rollout actors (tasks/async_rollouts.py,
Ray) generate the streams of later iterations with the weights they last received while the trainer updates;
this module decides which weights each rollout is generated with, checks the lag of what the trainer consumes,
and carries the weights of unconsumed rollouts through checkpoints.

Versions. The weights after u optimizer updates are policy version u (the start adapter is version 0), so
trainer step s (1-based, the s-th update) trains from version s - 1. A rollout records the version v of the
weights that generated it; consumed at step s its lag is

    lag(s, v) = (s - 1) - v                     (0: on-policy, what the synchronous loop does)

and the bound is lag(s, v) <= K = max_async_level. Counting steps from 0 (t = s - 1, the trainer's version)
this is the usual t - v <= K.

Schedule: the rollout WAITS, it is never regenerated. The rollout of step s is started right after version

    v(s) = max(0, s - 1 - K)                    (`behaviour_version`)

has been pushed to the actors, and an actor runs its calls in the order they were made (the push, then the
rollout), so it is generated with exactly version v(s): lag = min(s - 1, K). At the start versions 0 opens steps
1..K+1; after update u, version u opens step u + K + 1 (`steps_opened_by`). So while the trainer runs step s the
actors generate steps s+1..s+K with older weights; K = 0 is the synchronous order (each rollout waits for the
previous update). Which version generated a rollout depends only on (s, K), not on timing: an async run is as
reproducible as a synchronous one, and a resumed run regenerates its pending rollouts with the same versions,
which the checkpoint keeps (`checkpoint_tensors`: the versions max(0, c-K)..c-1 after step c, LoRA-sized).

The off-policy correction (icrl_core/stream_rl.py, `off_policy=True`): pi_old of every objective is the behaviour
policy mu that generated the rollout (its log-probs are recorded at generation), so the ratio
rho = pi_theta / mu of the clipped losses and AIPO's min(pi / mu, delta) weigh the stale samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from icrl_core.streams import Stream, StreamTask

# Keys of the held versions' tensors inside a checkpoint's trainable tensors: async_rollouts.v<version>.<name>.
CHECKPOINT_PREFIX = "async_rollouts.v"


def behaviour_version(step: int, max_async_level: int) -> int:
    """v(s) = max(0, s - 1 - K): the policy version the rollout of trainer step s is generated with."""
    return max(0, step - 1 - max_async_level)


def rollout_lag(step: int, version: int) -> int:
    """lag(s, v) = (s - 1) - v: updates the trainer made since the weights that generated the rollout."""
    return step - 1 - version


def steps_opened_by(version: int, max_async_level: int, max_steps: int) -> range:
    """The steps whose rollout starts once `version` reached the actors: 1..K+1 for version 0, else v + K + 1
    (the steps s with v(s) = version), capped at max_steps."""
    first = 1 if version == 0 else version + max_async_level + 1
    return range(first, min(version + max_async_level + 1, max_steps) + 1)


def pending_steps(done: int, max_async_level: int, max_steps: int) -> range:
    """The steps whose rollouts are in flight after `done` updates: done+1 .. done+K+1 (capped)."""
    return range(done + 1, min(done + max_async_level + 1, max_steps) + 1)


def check_lag(step: int, version: int, max_async_level: int) -> int:
    """The lag of a rollout consumed at `step`; a rollout older than the bound, or from weights newer than the
    trainer's, is a scheduling bug and raises."""
    lag = rollout_lag(step, version)
    if not 0 <= lag <= max_async_level:
        raise RuntimeError(f"the rollout of step {step} was generated with policy version {version} (lag {lag}), "
                           f"outside 0..max_async_level={max_async_level}")
    return lag


@dataclass
class GeneratedRollout:
    """The streams of one trainer step, the policy version that generated them (the actors' own record) and the
    seconds the slowest actor spent generating."""

    step: int
    version: int
    streams: list[Stream]
    seconds: float


class RolloutSource(Protocol):
    """Where rollouts are generated (tasks/async_rollouts.RolloutPool: Ray actors). Calls to one source reach its
    actors in the order they are made."""

    def push(self, version: int, tensors: dict[str, torch.Tensor]) -> None: ...

    def start(self, step: int, tasks: Sequence[tuple[int, StreamTask]]) -> None: ...

    def result(self, step: int) -> GeneratedRollout: ...


class AsyncStreams:
    """The trainer's side of asynchronous rollouts: pushes each policy version, starts the rollouts it opens,
    hands the trainer the rollout of each step and keeps the weights of the rollouts still in flight.

    `tasks_of(step)` -> [(group, task)]: this worker's groups of the step (drawn on the trainer, where the data
    sources are; the actors only need the policy)."""

    def __init__(self, source: RolloutSource, tasks_of: Callable[[int], list[tuple[int, StreamTask]]],
                 max_async_level: int, max_steps: int):
        self.source = source
        self.tasks_of = tasks_of
        self.max_async_level = max_async_level
        self.max_steps = max_steps
        self.held: dict[int, dict[str, torch.Tensor]] = {}  # version -> weights (in flight, for checkpoints)
        self.started = False

    def start(self, done: int, weights: dict[str, torch.Tensor]) -> None:
        """Start the rollouts in flight after `done` updates (`weights`: version `done`; older versions come from
        `held`, restored from the checkpoint), each after the version it is generated with."""
        self.held[done] = _copy(weights)
        pushed = None
        for step in pending_steps(done, self.max_async_level, self.max_steps):
            version = behaviour_version(step, self.max_async_level)
            if version != pushed:
                if version not in self.held:
                    raise RuntimeError(f"async rollouts: resuming after step {done} needs policy version {version}, "
                                       "which the checkpoint does not hold")
                self.source.push(version, self.held[version])
                pushed = version
            self.source.start(step, self.tasks_of(step))
        self._prune(done)
        self.started = True

    def take(self, step: int) -> GeneratedRollout:
        """The rollout of `step` (waits for it), its lag checked against the bound."""
        rollout = self.source.result(step)
        check_lag(step, rollout.version, self.max_async_level)
        return rollout

    def updated(self, step: int, weights: dict[str, torch.Tensor]) -> None:
        """After update `step` (weights = version `step`): push it if it opens a rollout, start that rollout."""
        self.held[step] = _copy(weights)
        opened = steps_opened_by(step, self.max_async_level, self.max_steps)
        if len(opened):
            self.source.push(step, weights)
            for later in opened:
                self.source.start(later, self.tasks_of(later))
        self._prune(step)

    def _prune(self, done: int) -> None:
        keep = range(behaviour_version(done + 1, self.max_async_level), done + 1)
        self.held = {v: w for v, w in self.held.items() if v in keep}

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The older versions the rollouts in flight were generated with (not the newest: the checkpoint's own
        weights), as flat tensors `async_rollouts.v<version>.<name>`."""
        newest = max(self.held, default=-1)
        return {f"{CHECKPOINT_PREFIX}{version}.{name}": tensor for version, weights in self.held.items()
                if version < newest for name, tensor in weights.items()}

    def restore(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take the held versions out of a checkpoint's tensors; return the rest (the trainer's own weights)."""
        rest = {}
        for key, tensor in tensors.items():
            if key.startswith(CHECKPOINT_PREFIX):
                version, name = key[len(CHECKPOINT_PREFIX):].split(".", 1)
                self.held.setdefault(int(version), {})[name] = tensor
            else:
                rest[key] = tensor
        return rest


def _copy(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in weights.items()}

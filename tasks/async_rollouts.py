"""Rollout actors of `ppo.async_rollouts` (Ray): the trainer-side pool and the actor. The schedule (which policy
version each rollout is generated with, the lag bound, checkpoints) is icrl_core/async_rollouts.py; the actors
only hold a policy and turn (group, task) lists into streams (`stream_rl.roll_out_tasks`).

Weights reach the actors by `ppo.async_rollouts.transport`:
  object_store  `ray.put` of the trainable tensors (LoRA: a few MB), one object per version, handed to every
                actor's `set_weights`; Ray moves it to the actors' nodes. Works on a local Ray and on any cluster.
  file          a safetensors file per version in `weights_dir` (a path every actor sees: shared filesystem),
                deleted once every actor has loaded it.
An actor runs its calls in the order the trainer made them (one submitter, a synchronous actor), so a rollout
started after a push is generated with that version; the actor still reports the version it held, and the
trainer checks it.

On a cluster (`ray.address`) the actors run wherever Ray places them, importing this module from the job's
runtime_env (tasks/ray_train.code_runtime_env); they load the base model themselves (model.spec from the image's
cache), never the trainer's files, and receive every weight they use from the trainer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import torch

from icrl_core.async_rollouts import GeneratedRollout
from icrl_core.errors import UserError
from icrl_core.streams import StreamTask
from tasks.settings import PipelineConfig


class RolloutWorker:
    """One rollout actor: the base model with the trainer's adapter shape, the weights of the last version it
    received, and the stream rollout of icrl_core."""

    def __init__(self, model: dict, adapter: dict, seed: int, threads: int):
        from pydantic import TypeAdapter

        from icrl_core.config import Adapter, ModelConfig
        from icrl_core.model import load_policy

        torch.set_num_threads(threads)
        cfg = ModelConfig.model_validate(model)
        # the base weights as the trainer has them (the tiny model is seeded); the adapter comes from the pushes
        self.policy = load_policy(cfg.spec, cfg.dtype, TypeAdapter(Adapter).validate_python(adapter), False,
                                  cfg.cache_dir, seed, None, cfg.device)
        self.version: int | None = None

    def set_weights(self, version: int, weights) -> int:
        """Load policy version `version`: the tensors (object store; Ray resolved the reference) or a file path."""
        if isinstance(weights, str):
            from safetensors.torch import load_file

            weights = load_file(weights)
        self.policy.load_trainable_state_dict(weights, f"policy version {version}")
        self.version = version
        return version

    def generate(self, tasks: Sequence[tuple[int, StreamTask]], ppo: dict, seed: int, step: int,
                 max_tokens: int) -> tuple[int, list, float]:
        """(the version generated with, the streams of `tasks` at `step`, seconds)."""
        from icrl_core.config import PPOConfig
        from icrl_core.stream_rl import roll_out_tasks

        if self.version is None:
            raise RuntimeError("a rollout actor was asked for streams before it received any weights")
        started = time.perf_counter()
        streams = roll_out_tasks(self.policy, tasks, PPOConfig.model_validate(ppo), seed, step, max_tokens)
        return self.version, streams, time.perf_counter() - started

    def ready(self) -> str:
        """Where this actor imported its code from (on a cluster: the job's runtime_env)."""
        return __file__


class RolloutPool:
    """`ppo.async_rollouts.actors` RolloutWorker actors of one training worker (`icrl_core.async_rollouts.
    RolloutSource`). A step's (group, task) list is split over the actors round-robin, its streams put back in
    group order. Use as a context manager (`close` kills the actors and removes weight files)."""

    def __init__(self, config: PipelineConfig, adapter, max_tokens: int):
        import ray

        from tasks.ray_train import ensure_ray

        options = config.ppo.async_rollouts
        self.options = options
        self.seed = config.seed
        self.max_tokens = max_tokens
        self.ppo = config.ppo.model_dump(mode="json")
        ensure_ray(config.ray)  # a local Ray, ray.address, or (inside a Ray Train worker) the job's own
        wanted = options.actors * options.actor_cpus
        free = _free_cpus(wanted)
        if wanted > free + 1e-9:  # Ray would wait for them forever
            raise UserError(f"ppo.async_rollouts: {options.actors} actor(s) x {options.actor_cpus} CPUs do not fit "
                            f"the {free:g} CPUs Ray has free; lower ppo.async_rollouts.actors or actor_cpus (0 "
                            "shares the cores), or raise ray.num_cpus")
        threads = max(1, int(options.actor_cpus))
        worker = ray.remote(RolloutWorker).options(num_cpus=options.actor_cpus, max_restarts=0)
        model = config.model.model_dump(mode="json")
        self.actors = [worker.remote(model, adapter.model_dump(mode="json"), config.seed, threads)
                       for _ in range(options.actors)]
        # model loaded (failures surface here); where each actor's code came from (a cluster: the runtime_env)
        self.code = ray.get([actor.ready.remote() for actor in self.actors])
        self.pending: dict[int, list[tuple[list[int], object]]] = {}
        self.files: list[tuple[Path, list]] = []  # weight files and the set_weights calls that read them
        self.weights_dir = Path(options.weights_dir).resolve() if options.weights_dir is not None else None
        self.run = uuid.uuid4().hex[:8]

    def push(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        import ray

        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
        if self.options.transport == "file":
            from safetensors.torch import save_file

            self.weights_dir.mkdir(parents=True, exist_ok=True)
            path = self.weights_dir / f"{self.run}-v{version:08d}.safetensors"
            partial = path.with_suffix(".partial")
            save_file(tensors, str(partial))
            partial.replace(path)  # an actor never reads a half-written file
            weights = str(path)
        else:
            weights = ray.put(tensors)
        calls = [actor.set_weights.remote(version, weights) for actor in self.actors]
        if self.options.transport == "file":
            self.files.append((path, calls))
            self._remove_loaded_files()

    def start(self, step: int, tasks: Sequence[tuple[int, StreamTask]]) -> None:
        parts = []
        for index, actor in enumerate(self.actors):
            mine = list(range(index, len(tasks), len(self.actors)))
            if mine:
                call = actor.generate.remote([tasks[i] for i in mine], self.ppo, self.seed, step, self.max_tokens)
                parts.append((mine, call))
        self.pending[step] = parts

    def result(self, step: int) -> GeneratedRollout:
        import ray
        from ray.exceptions import RayTaskError

        parts = self.pending.pop(step)
        try:
            outs = ray.get([call for _, call in parts])
        except RayTaskError as error:  # the actor's own exception (e.g. a UserError: exit 2 with its message)
            raise error.as_instanceof_cause() from None
        versions = {version for version, _, _ in outs}
        if len(versions) != 1:
            raise RuntimeError(f"the rollout of step {step} mixes policy versions {sorted(versions)}")
        size = self.ppo["stream"]["group_size"]  # an actor returns its tasks' streams in order, G per task
        by_task = {index: streams[j * size:(j + 1) * size]
                   for (mine, _), (_, streams, _) in zip(parts, outs) for j, index in enumerate(mine)}
        ordered = [stream for index in sorted(by_task) for stream in by_task[index]]
        return GeneratedRollout(step, versions.pop(), ordered, max(seconds for _, _, seconds in outs))

    def _remove_loaded_files(self) -> None:
        import ray

        kept = []
        for path, calls in self.files:
            done, _ = ray.wait(calls, num_returns=len(calls), timeout=0)
            if len(done) == len(calls):
                path.unlink(missing_ok=True)
            else:
                kept.append((path, calls))
        self.files = kept

    def close(self) -> None:
        import ray

        for actor in getattr(self, "actors", []):
            ray.kill(actor)
        for path, _ in getattr(self, "files", []):
            path.unlink(missing_ok=True)
        self.actors, self.files = [], []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _free_cpus(wanted: float, patience: float = 20.0) -> float:
    """Ray's free CPUs, polled for up to `patience` seconds until `wanted` are free (actors killed just before
    give their CPUs back asynchronously); at once when the cluster has fewer in all."""
    import ray

    deadline = time.monotonic() + patience
    total = ray.cluster_resources().get("CPU", 0.0)
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if free + 1e-9 >= wanted or wanted > total or time.monotonic() > deadline:
            return free
        time.sleep(0.5)

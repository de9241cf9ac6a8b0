"""Ray Train integration (orchestration issue): runs a stage's train_worker in TorchTrainer workers."""

from __future__ import annotations


def run_ray_training(config, stage, train_worker, tracker=None) -> dict:
    raise NotImplementedError("Ray Train execution is not wired yet: set ray.enabled=false")

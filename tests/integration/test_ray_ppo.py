"""Ray Train and Ray Tune on the real PPO stage (tiny model, real local Ray): a two-worker job survives a killed
worker by resuming from its checkpoint, and a Ray Tune sweep of 4 trials logs 4 MLflow child runs under one
parent. The mechanics on a toy stage: tests/integration/test_ray_train.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import a_ray_train_worker_killed_after

pytestmark = pytest.mark.integration

TINY_PPO = [
    "model.spec=tiny", "data.output_dir=data", "ppo.rollout_episodes=4", "ppo.batch_size=4",
    "ppo.minibatch_size=2", "ppo.epochs=1", "ppo.eval_steps=100", "ppo.eval_episodes=2", "ppo.max_new_tokens=3",
    "ppo.learning_rate=1e-3",
]


@pytest.fixture(scope="module")
def ray_folder(tmp_path_factory):
    import tempfile

    import ray

    from tests.ppo_helpers import write_keyword_dataset

    # Ray puts AF_UNIX sockets under the working folder (.icrl/ray): keep the path short (107 bytes max).
    folder = Path(tempfile.mkdtemp(prefix="icrl-ray-", dir="/tmp"))
    write_keyword_dataset(folder / "data", train=16, val=2)
    old = os.getcwd()
    os.chdir(folder)
    yield folder
    ray.shutdown()
    os.chdir(old)
    shutil.rmtree(folder, ignore_errors=True)


def test_two_worker_ray_train_ppo_recovers_from_a_killed_worker(ray_folder, monkeypatch):
    from tasks.ppo import run
    from tasks.runtime import checkpoint_dir_for
    from tasks.settings import load_config

    config = load_config(None, TINY_PPO + ["tracking.enabled=false", "ray.enabled=true", "ray.num_workers=2",
                                           "ray.max_failures=2", "ppo.max_steps=4", "ppo.save_steps=1"],
                         environ={})
    with a_ray_train_worker_killed_after(checkpoint_dir_for(config, "ppo"), step=2, timeout=600) as killed:
        metrics = run(config)
    assert killed, "no Ray Train worker was found to kill"
    history = json.loads((ray_folder / "artifacts" / "ppo" / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert metrics["iterations"] == 4 and metrics["world_size"] == 2


def test_tune_sweep_of_four_ppo_trials_logs_four_mlflow_child_runs(ray_folder):
    import mlflow

    from tasks.settings import load_config
    from tasks.sweep import run_sweep

    store = f"sqlite:///{ray_folder / 'sweep-mlflow.db'}"
    config = load_config(None, TINY_PPO + [f"tracking.tracking_uri={store}", "tracking.experiment=sweep-test",
                                           "sweep.stage=ppo", "sweep.num_samples=4", "sweep.max_concurrent=2",
                                           "sweep.max_steps=2", "sweep.grace_period=1"], environ={})
    summary = run_sweep(config)
    assert len(summary["trials"]) == 4 and all(t["error"] is None for t in summary["trials"])
    assert set(summary["best_params"]) == {"ppo.learning_rate", "ppo.kl_beta"}
    assert (ray_folder / "artifacts" / "sweep" / "best.json").exists()
    client = mlflow.MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("sweep-test")
    children = client.search_runs([experiment.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{summary['parent_run_id']}'")
    assert len(children) == 4
    for child in children:
        assert {"ppo.learning_rate", "ppo.kl_beta"} <= set(child.data.params)
        assert "mean_reward" in child.data.metrics

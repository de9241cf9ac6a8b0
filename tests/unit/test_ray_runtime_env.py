"""Where code and devices go on Ray, as pure functions: code is shipped in the runtime_env only to clusters, and
the GPU / collective-backend choice (tasks/ray_train). A real Ray job importing the shipped code:
tests/integration/test_ray_runtime_env.py."""

from __future__ import annotations

import os

import pytest


def test_ship_code_defaults_to_clusters_only():
    from tasks.ray_train import SHIP_EXCLUDES, code_runtime_env, ships_code
    from tasks.settings import load_config

    assert not ships_code(load_config(None, [], environ={}).ray)
    assert ships_code(load_config(None, ["ray.address=ray-head:6379"], environ={}).ray)
    assert not ships_code(load_config(None, ["ray.address=ray-head:6379", "ray.ship_code=false"], environ={}).ray)
    shipped = code_runtime_env()
    assert [os.path.basename(p) for p in shipped["py_modules"]] == ["icrl_core", "tasks", "flows"]
    assert {"artifacts", ".venv", ".git", "mlruns", ".icrl"} <= set(SHIP_EXCLUDES) == set(shipped["excludes"])


@pytest.mark.parametrize(("use_gpu", "device", "gpus", "expected"), [
    ("auto", "auto", 0, (False, "gloo")),
    ("auto", "auto", 4, (True, "nccl")),
    ("auto", "cpu", 4, (False, "gloo")),   # model.device=cpu: no GPU reserved
    (False, "auto", 4, (False, "gloo")),
    (True, "auto", 4, (True, "nccl")),
    (True, "cpu", 4, (True, "gloo")),       # a GPU reserved but the model on the CPU: gloo matches
])
def test_ray_devices_choose_gpus_and_the_collective_backend(use_gpu, device, gpus, expected):
    from tasks.ray_train import ray_devices

    assert ray_devices(use_gpu, device, gpus) == expected


def test_ray_devices_refuse_impossible_requests():
    from icrl_core.errors import UserError
    from tasks.ray_train import ray_devices

    with pytest.raises(UserError, match="no GPU"):
        ray_devices(True, "auto", 0)
    with pytest.raises(UserError, match="no CUDA device"):
        ray_devices(False, "cuda", 4)



def test_worker_cpus_share_a_local_ray_and_follow_the_setting():
    from tasks.ray_train import worker_cpus
    from tasks.settings import RayConfig

    assert worker_cpus(RayConfig(num_cpus=2)) == 2  # one worker gets both cores of a local Ray
    assert worker_cpus(RayConfig(num_cpus=4, num_workers=2)) == 2
    assert worker_cpus(RayConfig(num_cpus=2), actor_cpus=1) == 1  # the rollout actors keep theirs
    assert worker_cpus(RayConfig(address="10.0.0.1:6379")) == 1  # a cluster's size is not known to the driver
    assert worker_cpus(RayConfig(address="127.0.0.1:6379", cpus_per_worker=2)) == 2


def test_ray_stages_names_every_stage_that_trains_through_launch():
    """`ray.stages` accepts exactly the stages whose module trains through tasks.runtime.launch."""
    import re
    from pathlib import Path
    from typing import get_args

    from tasks.settings import TrainingStage

    root = Path(__file__).resolve().parents[2] / "tasks"
    launching = set()
    for module in root.glob("*.py"):
        text = module.read_text()
        stage = re.search(r'^STAGE = "(\w+)"', text, re.MULTILINE)
        if stage and re.search(r"\b(run_training_stage|launch)\(config, STAGE\b", text):
            launching.add(stage.group(1))
    assert launching == set(get_args(TrainingStage))


def test_a_stage_outside_ray_stages_trains_in_process(tmp_path, monkeypatch):
    """ray.enabled with ray.stages=[ppo]: bootstrap trains in this process (no Ray started); a stage not named
    there is refused by the config."""
    from icrl_core.errors import ConfigError
    from tasks.runtime import launch
    from tasks.settings import load_config
    from tests.support.toy_stage import train_worker

    monkeypatch.chdir(tmp_path)
    config = load_config(None, ["ray.enabled=true", "ray.stages=[ppo]", "bootstrap.max_steps=2"], environ={})
    assert launch(config, "bootstrap", train_worker)["world_size"] == 1
    assert not (tmp_path / ".icrl" / "ray").exists() and not (tmp_path / ".icrl" / "ray_results").exists()
    with pytest.raises(ConfigError, match="ray.stages"):
        load_config(None, ["ray.stages=[evaluate]"], environ={})


def test_a_deep_project_runs_its_local_ray_from_a_short_folder(tmp_path, monkeypatch):
    """Ray's AF_UNIX socket paths under its folder stop at 107 bytes: .icrl/ray in a short project, a folder of the
    system's temp dir named after the project in a deep one (one per project)."""
    from tasks.ray_train import SOCKET_PATH_MAX, SOCKET_SUFFIX, ray_temp_dir

    short = tmp_path.parent / "p"
    short.mkdir(exist_ok=True)
    monkeypatch.chdir(short)
    if len(str(short / ".icrl" / "ray")) + SOCKET_SUFFIX <= SOCKET_PATH_MAX:
        assert ray_temp_dir() == short.resolve() / ".icrl" / "ray"
    deep = tmp_path / ("a-project-folder-deeper-than-ray-sockets-allow" * 2)
    deep.mkdir()
    monkeypatch.chdir(deep)
    moved = ray_temp_dir()
    assert moved.name.startswith("icrl-ray-") and len(str(moved)) + SOCKET_SUFFIX <= SOCKET_PATH_MAX
    other = tmp_path / ("another-project-folder-deeper-than-ray-sockets-allow" * 2)
    other.mkdir()
    monkeypatch.chdir(other)
    assert ray_temp_dir() != moved

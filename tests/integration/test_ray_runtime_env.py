"""The code reaches Ray workers in the job's runtime_env (tasks/ray_train.code_runtime_env), not through the
driver's path: a driver started from another working directory sees its workers, and the PPO stage's rollout
actors (ppo.async_rollouts), import the shipped packages from Ray's runtime_env folder; the actors roll out with
the weights pushed through the object store. Real local Ray, in a subprocess (one Ray job per process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

DRIVER = textwrap.dedent("""
    import json

    import ray

    from tasks.ray_train import ensure_ray
    from tasks.settings import load_config

    from icrl_core.config import LoraAdapter
    from icrl_core.dataset_build import resolve_sources
    from icrl_core.model import load_policy
    from icrl_core.stream_rl import stream_tasks
    from tasks.async_rollouts import RolloutPool

    config = load_config(None, ["ray.ship_code=true", "ray.num_cpus=1", "model.spec=tiny", "ppo.mode=stream",
                                "model.adapter={kind: lora, rank: 4}", "ppo.objective={kind: grpo}",
                                "ppo.stream={steps: 2, group_size: 2, groups: 1}",
                                "ppo.async_rollouts.enabled=true"], environ={})
    ensure_ray(config.ray)

    @ray.remote(num_cpus=1)
    def where():
        import icrl_core
        import tasks
        import flows
        import icrl_core.device

        return {"icrl_core": icrl_core.__file__, "tasks": tasks.__file__, "flows": flows.__file__,
                "backend": icrl_core.device.collective_backend("cpu")}

    seen = ray.get(where.remote())
    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4))
    with RolloutPool(config, policy.adapter, 2048) as pool:
        pool.push(3, policy.trainable_state_dict())
        pool.start(1, stream_tasks(resolve_sources(config.data, 0), config.data, config.ppo, 0, 1, [0], "train"))
        rollout = pool.result(1)
        seen.update(actors=pool.code, version=rollout.version, streams=len(rollout.streams))
    print(json.dumps(seen))
    ray.shutdown()
""")


def test_workers_and_rollout_actors_import_the_code_shipped_in_the_runtime_env():
    # a short folder: Ray's session sockets live under <cwd>/.icrl/ray, and AF_UNIX paths stop at 107 bytes
    tmp_path = Path(tempfile.mkdtemp(prefix="icrl-rt-", dir="/tmp"))
    try:
        _check_shipped_code(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _check_shipped_code(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run([sys.executable, "-c", DRIVER], cwd=tmp_path, env=env, check=False, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    runtime_resources = tmp_path / ".icrl" / "ray"  # this job's Ray session folder (in the driver's cwd)
    for package in ("icrl_core", "tasks", "flows"):
        path = os.path.realpath(seen[package])
        assert not path.startswith(str(ROOT) + os.sep), (package, path)  # not the driver's copy
        assert path.startswith(os.path.realpath(runtime_resources)) and "runtime_resources" in path, (package, path)
    assert seen["backend"] == "gloo"
    (actor_code,) = seen["actors"]  # where the rollout actor imported tasks.async_rollouts from
    assert os.path.realpath(actor_code).startswith(os.path.realpath(runtime_resources)), actor_code
    assert "runtime_resources" in actor_code and seen["version"] == 3 and seen["streams"] == 2

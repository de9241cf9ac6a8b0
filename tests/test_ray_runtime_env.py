"""The code reaches Ray workers in the job's runtime_env (tasks/ray_train.code_runtime_env), not through the
driver's path: a driver started from another working directory sees its workers import the shipped packages
from Ray's runtime_env folder. Real local Ray, in a subprocess (one Ray job per process)."""

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

    config = load_config(None, ["ray.ship_code=true", "ray.num_cpus=1"], environ={})
    ensure_ray(config.ray)

    @ray.remote(num_cpus=1)
    def where():
        import icrl_core
        import tasks
        import flows
        import icrl_core.device

        return {"icrl_core": icrl_core.__file__, "tasks": tasks.__file__, "flows": flows.__file__,
                "backend": icrl_core.device.collective_backend("cpu")}

    print(json.dumps(ray.get(where.remote())))
    ray.shutdown()
""")


def test_workers_import_the_code_shipped_in_the_runtime_env():
    # a short folder: Ray's session sockets live under <cwd>/.icrl/ray, and AF_UNIX paths stop at 107 bytes
    tmp_path = Path(tempfile.mkdtemp(prefix="icrl-rt-", dir="/tmp"))
    try:
        _check_shipped_code(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _check_shipped_code(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    result = subprocess.run([sys.executable, "-c", DRIVER], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    runtime_resources = tmp_path / ".icrl" / "ray"  # this job's Ray session folder (in the driver's cwd)
    for package in ("icrl_core", "tasks", "flows"):
        path = os.path.realpath(seen[package])
        assert not path.startswith(str(ROOT) + os.sep), (package, path)  # not the driver's copy
        assert path.startswith(os.path.realpath(runtime_resources)) and "runtime_resources" in path, (package, path)
    assert seen["backend"] == "gloo"


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

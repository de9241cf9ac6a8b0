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
    result = subprocess.run([sys.executable, "-c", DRIVER], cwd=tmp_path, env=env, check=False, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    runtime_resources = tmp_path / ".icrl" / "ray"  # this job's Ray session folder (in the driver's cwd)
    for package in ("icrl_core", "tasks", "flows"):
        path = os.path.realpath(seen[package])
        assert not path.startswith(str(ROOT) + os.sep), (package, path)  # not the driver's copy
        assert path.startswith(os.path.realpath(runtime_resources)) and "runtime_resources" in path, (package, path)
    assert seen["backend"] == "gloo"

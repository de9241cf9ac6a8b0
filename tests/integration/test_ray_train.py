"""Ray Train runtime: real local Ray (num_cpus=2), DDP over gloo, checkpoints through Ray's API, worker
failure recovery. Uses a toy linear-regression stage so the mechanics are tested in seconds; the PPO stage
runs the same way (tests/integration/test_ray_ppo.py)."""

from __future__ import annotations

import psutil
import pytest

from tasks.runtime import checkpoint_dir_for, launch
from tasks.settings import load_config
from tests.conftest import a_ray_train_worker_killed_after
from tests.support.toy_stage import train_worker

pytestmark = pytest.mark.integration
LOOPBACK = ("127.0.0.1", "::ffff:127.0.0.1")


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    import os

    import ray

    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray"))
    yield
    ray.shutdown()
    os.chdir(old)


def _config(workers: int, steps: int = 20):
    return load_config(None, ["ray.enabled=true", f"ray.num_workers={workers}", f"bootstrap.max_steps={steps}",
                              "bootstrap.save_steps=5", "ray.max_failures=2"], environ={})


def test_a_killed_worker_is_replaced_and_two_workers_still_match_one(ray_session, monkeypatch):
    """Two data-parallel workers (half the batch each, gradients averaged) end where one worker on the full batch
    ends, even when one of them is killed mid-run and its replacement resumes from the last checkpoint. While they
    train, rank 0 listens on 127.0.0.1 only: torch.distributed's rendezvous store binds every interface unless
    told otherwise (tasks.ray_train.bind_rendezvous_to_master_addr, run by the job's setup hook)."""
    monkeypatch.setenv("ICRL_TOY_STEP_SECONDS", "0.4")
    config = _config(2, steps=12)
    uninterrupted = launch(load_config(None, ["bootstrap.max_steps=12", "bootstrap.save_steps=5"], environ={}),
                           "bootstrap", train_worker)
    with a_ray_train_worker_killed_after(checkpoint_dir_for(config, "bootstrap"), step=5, timeout=120) as killed:
        result = launch(config, "bootstrap", train_worker)
    assert killed, "no Ray Train worker was found to kill"
    assert result["world_size"] == 2 and uninterrupted["world_size"] == 1
    assert result["weight"] == pytest.approx(uninterrupted["weight"], abs=1e-5)
    assert result["listening"] and set(result["listening"]) <= set(LOOPBACK), result


def test_local_ray_workers_run_at_the_configured_niceness(ray_session):
    """Ray's default (15) starves training behind any other CPU job; ray.worker_niceness (0) is applied."""
    import os

    import ray

    from tasks.ray_train import ensure_ray

    ensure_ray(_config(1).ray)
    niceness = ray.get(ray.remote(num_cpus=1)(lambda: os.nice(0)).remote())
    assert niceness == os.nice(0) + _config(1).ray.worker_niceness


def test_ray_listens_on_loopback_only(ray_session):
    """This test's own Ray (its descendants: another job's Ray on the machine is not its concern) listens on
    127.0.0.1 only."""
    import os

    from tasks.ray_train import ensure_ray

    ensure_ray(_config(1).ray)
    me = os.getpid()
    ray_pids = {proc.pid for proc in psutil.Process(me).children(recursive=True)}
    listening = [c for c in psutil.net_connections(kind="tcp") if c.status == "LISTEN" and c.pid in ray_pids]
    assert listening, "expected Ray to listen on some ports"
    for conn in listening:
        assert conn.laddr.ip in LOOPBACK, conn


def test_a_job_stopped_for_memory_becomes_one_resumable_user_error(tmp_path):
    """Ray's memory monitor kills a job's workers (and, since Ray 2.56, its Train controller): the stage ends
    with one message naming the cause and the kept checkpoints, exit 2, not Ray's traceback. Other failures
    pass through."""
    from ray.exceptions import OutOfMemoryError as RayOutOfMemory

    from icrl_core.errors import OutOfMemoryError, UserError
    from tasks.ray_train import memory_error

    monitor = ("Training failed due to controller error:\n4 worker(s) were killed due to the node running low on "
               "memory. Memory on the node (IP: 127.0.0.1, ID: 455d) was 22.52GB used / 23.54GB limit (0.956442)")
    error = memory_error(RuntimeError(monitor), "dpo", tmp_path / "dpo-123")
    assert isinstance(error, OutOfMemoryError) and isinstance(error, UserError) and error.exit_code == 2
    assert "stage 'dpo'" in str(error) and "22.52GB of 23.54GB in use" in str(error)
    assert str(tmp_path / "dpo-123") in str(error) and "rerun the stage to resume" in str(error)
    try:  # Ray's own exception, raised from inside a wrapper
        try:
            raise RayOutOfMemory("Task was killed due to the node running low on memory.")
        except RayOutOfMemory as inner:
            raise RuntimeError("worker group failed") from inner
    except RuntimeError as outer:
        assert isinstance(memory_error(outer, "ppo", tmp_path), OutOfMemoryError)
    assert memory_error(RuntimeError("a worker raised ValueError"), "ppo", tmp_path) is None

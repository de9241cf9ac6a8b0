"""Training stages as Ray Train jobs.

`run_ray_training(config, stage, train_worker, checkpoint_dir)` runs the stage's loop in `TorchTrainer` workers:
`ScalingConfig(num_workers=ray.num_workers, use_gpu=...)`, torch.distributed over NCCL when the workers have
GPUs and gloo on CPUs (`ray_devices`; the loops average gradients with `icrl_core.distributed`),
`FailureConfig(max_failures=ray.max_failures)`: when a worker dies, Ray restarts the worker group and the loop
resumes from the last checkpoint reported through `ray.train.report` (`ray.train.get_checkpoint()`).

Local Ray by default (started on 127.0.0.1 with `ray.num_cpus` CPUs and no dashboard); an existing cluster when
`ray.address` is set. The code reaches a cluster's workers in the job's runtime_env (`code_runtime_env`:
icrl_core, tasks and flows as py_modules), so the workers need the project's dependencies (the Docker image),
not a copy of the code at the driver's path (docs/DEPLOYMENT.md). Each job gets a unique run name, so Ray never
silently resumes an older run.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from icrl_core.checkpoint import TrainingState, latest_checkpoint, read_checkpoint, save_rotating
from icrl_core.device import collective_backend, select_device
from icrl_core.errors import UserError
from tasks.env import DEFAULTS as ENV_DEFAULTS
from tasks.settings import PipelineConfig, RayConfig

log = logging.getLogger(__name__)

RAY_DIR = Path(".icrl")
# A local Ray puts AF_UNIX sockets under its temp dir (<dir>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store,
# up to 64 more characters), and a socket path stops at 107 bytes: a project folder longer than about 33 characters
# would not start Ray. Such a project's Ray folder moves to the system's temp dir, one per project.
SOCKET_PATH_MAX = 107
SOCKET_SUFFIX = len("/session_2026-12-01_18-42-22_584244_4194304/sockets/plasma_store")
FINAL_KEY = "icrl_final_metrics"
# What a cluster's workers import from the job's runtime_env, and what is never uploaded with it.
SHIPPED_PACKAGES = ("icrl_core", "tasks", "flows")
SHIP_EXCLUDES = ["__pycache__", "*.pyc", "artifacts", ".venv", ".git", "mlruns", "mlartifacts", ".icrl", ".dvc"]


def code_runtime_env() -> dict:
    """runtime_env entries that ship the project's packages, as this driver imports them, to every worker of
    the job (Ray zips each folder once, keyed by its content, and puts it first on the workers' sys.path)."""
    import importlib

    folders = [str(Path(importlib.import_module(name).__file__).parent) for name in SHIPPED_PACKAGES]
    return {"py_modules": folders, "excludes": list(SHIP_EXCLUDES)}


def setup_ray_worker() -> None:
    """Ray `worker_process_setup_hook` of every job (ensure_ray): runs in each worker process when it starts."""
    bind_rendezvous_to_master_addr()
    quiet_coordinator_start_up()


# Ray Train's controller registers the job's resources with an autoscaling-coordinator actor it creates at the first
# request, and waits 5 s for the answer; on a loaded 2-core machine the actor takes longer to start, and Ray logs
# the timeout as a warning with a traceback that it calls "safe to ignore" when transient.
COORDINATOR_LOGGER = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"


class FirstCoordinatorTimeout(logging.Filter):
    """Drops the first 'Failed to send resource request' warning of a process when its error is Ray's
    GetTimeoutError (the coordinator still starting); every later one, and any other error, is logged."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.dropped or not record.getMessage().startswith("Failed to send resource request"):
            return True
        error = record.exc_info[1] if record.exc_info else None
        if type(error).__name__ != "GetTimeoutError":
            return True
        self.dropped = True
        return False


def quiet_coordinator_start_up() -> None:
    """Install FirstCoordinatorTimeout on the coordinator client's logger (once per process)."""
    logger = logging.getLogger(COORDINATOR_LOGGER)
    if not any(isinstance(f, FirstCoordinatorTimeout) for f in logger.filters):
        logger.addFilter(FirstCoordinatorTimeout())


def bind_rendezvous_to_master_addr() -> None:
    """Part of every Ray worker's setup (setup_ray_worker): torch.distributed's rendezvous store (a TCPStore on rank 0,
    created when Ray Train sets up the process group) listens on every interface ('::') whatever address the
    workers are given. Make rank 0's store listen only on that address (MASTER_ADDR: 127.0.0.1 on a local Ray,
    the node's address on a cluster) by handing TCPStore a socket bound there (its `master_listen_fd`)."""
    import importlib
    import socket

    from torch.distributed import TCPStore

    # the module (torch.distributed's attribute of that name is the rendezvous function)
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    create_store = getattr(rendezvous, "_create_c10d_store", None)
    if create_store is None or getattr(create_store, "binds_master_addr", False):
        return  # another torch layout: leave it (tests/integration/test_ray_train.py would catch a wildcard)

    def create_bound_store(hostname, port, rank, world_size, timeout, use_libuv=True):
        if rank != 0 or rendezvous._torchelastic_use_agent_store():
            return create_store(hostname, port, rank, world_size, timeout, use_libuv)
        family, kind, proto, _, address = socket.getaddrinfo(hostname, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen()
        return TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=True, timeout=timeout,
                        multi_tenant=True, master_listen_fd=listener.detach(), use_libuv=use_libuv)

    create_bound_store.binds_master_addr = True
    rendezvous._create_c10d_store = create_bound_store


def ships_code(cfg: RayConfig) -> bool:
    return bool(cfg.address) if cfg.ship_code == "auto" else bool(cfg.ship_code)


def ray_devices(use_gpu: str | bool, model_device: str, cluster_gpus: float) -> tuple[bool, str]:
    """(one GPU per worker?, torch.distributed backend) of a Ray Train job, from `ray.use_gpu`, `model.device`
    and the cluster's GPU count. A worker sees a GPU only when it is given one, so its device is
    select_device(model.device, use_gpu), and the backend matches it: NCCL on GPUs, gloo on CPUs."""
    if use_gpu == "auto":
        use_gpu = cluster_gpus > 0 and model_device != "cpu"
    if use_gpu and cluster_gpus <= 0:
        raise UserError("ray.use_gpu=true but the Ray cluster has no GPU; use ray.use_gpu=auto or false")
    device = select_device(model_device, cuda_available=bool(use_gpu))
    return bool(use_gpu), collective_backend(device)


def ray_temp_dir() -> Path:
    """A local Ray's folder: .icrl/ray in the working folder, or /tmp/icrl-ray-<digest of that path> when Ray's
    socket paths under it would be longer than AF_UNIX allows (SOCKET_PATH_MAX)."""
    import hashlib
    import tempfile

    temp_dir = (RAY_DIR / "ray").resolve()
    if len(str(temp_dir)) + SOCKET_SUFFIX <= SOCKET_PATH_MAX:
        return temp_dir
    return Path(tempfile.gettempdir()) / f"icrl-ray-{hashlib.sha256(str(temp_dir).encode()).hexdigest()[:12]}"


def ensure_ray(cfg: RayConfig) -> None:
    """Connect to `cfg.address`, or start a local Ray bound to 127.0.0.1 (once per process)."""
    import ray

    if ray.is_initialized():
        return
    env_vars = {k: os.environ.get(k, v) for k, v in ENV_DEFAULTS.items()}
    runtime_env = {"env_vars": env_vars, **(code_runtime_env() if ships_code(cfg) else {}),
                   "worker_process_setup_hook": "tasks.ray_train.setup_ray_worker"}
    if cfg.address:
        ray.init(address=cfg.address, runtime_env=runtime_env, logging_level=logging.WARNING)
        return
    for key, value in ENV_DEFAULTS.items():  # local workers inherit the driver's environment
        os.environ.setdefault(key, value)
    # The raylet reads its config from RAY_<name> variables when it starts (Ray's default niceness is 15).
    os.environ["RAY_worker_niceness"] = str(cfg.worker_niceness)
    temp_dir = ray_temp_dir()
    temp_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    # No dashboard (it would need ray[default] and another port); Ray's own INFO/WARNING chatter from its
    # actors (e.g. the placement-group cleaner, which polls the dashboard's state API) is silenced.
    ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_config=ray.LoggingConfig(encoding="TEXT", log_level="ERROR"),
             _temp_dir=str(temp_dir), runtime_env=runtime_env, logging_level=logging.WARNING,
             log_to_driver=True)


class RayRuntime:
    """The runtime of a stage loop inside a Ray Train worker (see tasks/runtime.py for the contract).

    Every rank must call `report`/`save_checkpoint` at the same steps (Ray's report is a barrier)."""

    def __init__(self, checkpoint_dir: Path, tracker=None, keep_checkpoints: int = 2):
        import ray.train

        context = ray.train.get_context()
        self.rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self.checkpoint_dir = Path(checkpoint_dir)
        self.tracker = tracker
        self.keep_checkpoints = keep_checkpoints

    def report(self, metrics: Mapping[str, float], step: int) -> None:
        if self.rank == 0 and self.tracker is not None:
            self.tracker.log_metrics(metrics, step=step)

    def save_checkpoint(self, state: TrainingState) -> None:
        import ray.train

        checkpoint = None
        if self.rank == 0:
            # The same verified folder serves a restart of the whole stage (local folder) and a worker
            # restart inside the job (Ray copies it into its storage).
            path = save_rotating(self.checkpoint_dir, state, keep=self.keep_checkpoints)
            checkpoint = ray.train.Checkpoint.from_directory(str(path))
        ray.train.report({"step": state.step}, checkpoint=checkpoint)

    def load_latest_checkpoint(self) -> TrainingState | None:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is not None:
            with checkpoint.as_directory() as folder:
                log.info("rank %d resuming from Ray checkpoint %s", self.rank, folder)
                return read_checkpoint(folder)
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return None
        log.info("rank %d resuming from %s", self.rank, path)
        return read_checkpoint(path)


def _train_loop(loop_config: dict) -> None:
    """Runs in every Ray Train worker."""
    import importlib

    import ray.train

    logging.getLogger("ray").setLevel(logging.WARNING)  # per-report INFO lines drown the stage's own output
    cwd = loop_config.get("cwd")
    if cwd and Path(cwd).is_dir():
        os.chdir(cwd)  # stage paths are relative to the project, as on the driver
    import sys

    from tasks.tracking import Tracker

    if loop_config.get("module_root") and loop_config["module_root"] not in sys.path:
        sys.path.insert(0, loop_config["module_root"])
    config = PipelineConfig.model_validate(loop_config["config"])
    from icrl_core.task_data import register_task_templates

    register_task_templates(config.data)  # as the driver did (tasks/cli_stages.run_stage)
    module_name, func_name = loop_config["train_worker"].rsplit(":", 1)
    train_worker = getattr(importlib.import_module(module_name), func_name)
    tracker = Tracker(loop_config.get("tracking_uri"), loop_config.get("run_id"))
    runtime = RayRuntime(Path(loop_config["checkpoint_dir"]), tracker)
    final = train_worker(config, runtime)
    # Ray keeps the metrics that come with a checkpoint: hand the final metrics back that way (a small folder
    # from rank 0), which also works when the driver is on another machine.
    import json
    import tempfile

    if runtime.rank == 0:
        with tempfile.TemporaryDirectory() as folder:
            Path(folder, "final_metrics.json").write_text(json.dumps(final, default=str))
            ray.train.report({FINAL_KEY: json.dumps(final, default=str)},
                             checkpoint=ray.train.Checkpoint.from_directory(folder))
    else:
        ray.train.report({FINAL_KEY: "{}"})


def memory_error(error: BaseException, stage: str, checkpoint_dir: Path):
    """A `UserError` for a job Ray stopped because the node ran low on memory (its memory monitor kills workers,
    and under Ray 2.56's policy the Train controller with them, so the job fails instead of restarting), else None.
    Recognised by Ray's OutOfMemoryError anywhere in the chain or by the monitor's message in the error's text."""
    import re

    from icrl_core.errors import OutOfMemoryError

    seen, chain = set(), error
    texts = []
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        texts.append(f"{type(chain).__name__}: {chain}")
        chain = chain.__cause__ or chain.__context__
    text = "\n".join(texts)
    if "OutOfMemoryError" not in text and "running low on memory" not in text:
        return None
    used = re.search(r"was ([\d.]+GB) used / ([\d.]+GB) limit", text)
    where = f" ({used.group(1)} of {used.group(2)} in use)" if used else ""
    return OutOfMemoryError(
        f"stage '{stage}': Ray stopped its training job because the machine ran low on memory{where}. Its "
        f"checkpoints are kept in {checkpoint_dir}: free memory (other jobs on the machine) or lower the memory a "
        "step needs (model.gradient_checkpointing, a smaller batch or minibatch), then rerun the stage to resume "
        "from the latest one.")


def worker_cpus(cfg: RayConfig, actor_cpus: float = 0) -> int:
    """CPUs each Ray Train worker asks for (Ray gives the worker as many OMP/torch threads): `ray.cpus_per_worker`,
    else a local Ray's CPUs shared among the workers, less those of the PPO stage's rollout actors (they must stay
    free for them), else 1 on a cluster."""
    if cfg.cpus_per_worker is not None:
        return cfg.cpus_per_worker
    if cfg.address:
        return 1
    return max(1, int(cfg.num_cpus - actor_cpus) // cfg.num_workers)


def run_ray_training(config: PipelineConfig, stage: str, train_worker, checkpoint_dir: Path,
                     tracker=None) -> dict:
    """Run `train_worker` (a module-level function) as a TorchTrainer job whose workers checkpoint into
    `checkpoint_dir` (tasks/runtime.checkpoint_dir_for); return rank 0's final metrics."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ensure_ray(config.ray)
    # The cluster's GPUs, not the driver's: a Prefect worker without a GPU drives GPU workers.
    use_gpu, backend = ray_devices(config.ray.use_gpu, config.model.device, ray.cluster_resources().get("GPU", 0))
    workers = config.ray.num_workers
    rollouts = config.ppo.async_rollouts
    actor_cpus = workers * rollouts.actors * rollouts.actor_cpus if stage == "ppo" and rollouts.enabled else 0
    cpus_per_worker = worker_cpus(config.ray, actor_cpus)
    import sys

    module_file = Path(sys.modules[train_worker.__module__].__file__).resolve()
    # the folder from which the worker's module is importable (for modules not installed as packages)
    module_root = module_file.parents[train_worker.__module__.count(".")]
    loop_config = {
        "module_root": str(module_root),
        "config": config.model_dump(mode="json"),
        "train_worker": f"{train_worker.__module__}:{train_worker.__name__}",
        "checkpoint_dir": str(Path(checkpoint_dir).resolve()),
        "cwd": str(Path.cwd()),
        "tracking_uri": getattr(tracker, "uri", None),
        "run_id": getattr(tracker, "run_id", None),
    }
    name = f"{stage}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend=backend),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cpus_per_worker}),
        run_config=RunConfig(
            name=name,
            storage_path=str((RAY_DIR / "ray_results").resolve()),
            failure_config=FailureConfig(max_failures=config.ray.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    log.info("Ray Train job %s: %d worker(s), %d CPU each, %s, %s", name, workers, cpus_per_worker,
             "1 GPU each" if use_gpu else "no GPU", backend)
    result = trainer.fit()
    if result.error is not None:
        raise memory_error(result.error, stage, checkpoint_dir) or result.error
    import json

    return json.loads(result.metrics.get(FINAL_KEY, "{}"))

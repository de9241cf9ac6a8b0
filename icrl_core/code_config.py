"""Config schema of the code tasks: the sandbox (icrl_core/sandbox.py) and the reward (icrl_core/code_reward.py).
A module of its own so the pipeline config (icrl_core/config.py) hangs it on as `code` without every stage
depending on the sandbox's and the reward's code."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from icrl_core.schema import Section


class SandboxConfig(Section):
    """Limits and isolation of the process that runs one untrusted program."""

    isolation: Annotated[
        Literal["auto", "namespaces", "audit_hook"],
        Field(description="auto: namespaces where the kernel allows them (CAP_SYS_ADMIN), else audit_hook. "
              "namespaces: network/mount/PID namespaces, a chroot into a tmpfs with read-only /usr and Python, a "
              "dedicated uid per worker. audit_hook: a Python audit hook refusing sockets, files outside the "
              "working directory and signals to other processes (weaker; see docs/SANDBOX.md)."),
    ] = "auto"
    workers: Annotated[int, Field(ge=1, le=64, description="Programs run at once (each in its own process).")] = 2
    wall_seconds: Annotated[float, Field(gt=0, le=600, description="Wall-clock timeout of one program; the "
                                         "whole process group is killed past it.")] = 5.0
    cpu_seconds: Annotated[int, Field(ge=1, le=600, description="RLIMIT_CPU of each process of the program "
                                      "(SIGXCPU past it).")] = 5
    memory_mb: Annotated[int, Field(ge=64, le=65536, description="RLIMIT_AS (address space) of each process, "
                                    "MiB; allocations past it raise MemoryError.")] = 512
    max_processes: Annotated[int, Field(ge=1, le=1024, description="RLIMIT_NPROC: processes the program may "
                                        "have at once (its own uid under namespaces; under audit_hook the "
                                        "current user's process count is added, and root is not limited).")] = 8
    max_open_files: Annotated[int, Field(ge=16, le=65536, description="RLIMIT_NOFILE: open file "
                                         "descriptors per process.")] = 64
    max_file_mb: Annotated[float, Field(gt=0, le=65536, description="RLIMIT_FSIZE: largest file a process "
                                        "may write, MiB.")] = 8.0
    disk_mb: Annotated[int, Field(ge=1, le=65536, description="Size of the tmpfs holding the working "
                                  "directory and /tmp (namespaces only).")] = 32
    max_output_bytes: Annotated[int, Field(ge=1024, le=1 << 30, description="stdout and stderr are each kept "
                                           "up to this many bytes; past it the program is killed "
                                           "(status output_limit).")] = 1 << 16
    uid_base: Annotated[int, Field(ge=1000, le=(1 << 31) - (1 << 18), description="Under namespaces the "
                                   "program of worker slot i of calling process p runs as uid/gid uid_base + "
                                   "(p mod 4096) * 64 + i; the range must be unused by anything else.")] = 100000


class CodeRewardWeights(Section):
    """Weight of each reward component (the length penalty is subtracted)."""

    pass_fraction: Annotated[float, Field(ge=0, le=100, description="Share of the task's tests passed "
                                          "(partial credit).")] = 1.0
    all_pass: Annotated[float, Field(ge=0, le=100, description="Bonus when every test passes.")] = 1.0
    time_efficiency: Annotated[float, Field(ge=0, le=100, description="Bonus for passing everything well "
                                            "within the task's time budget.")] = 0.1
    lint: Annotated[float, Field(ge=0, le=100, description="1 / (1 + ruff lint findings).")] = 0.1
    docstring: Annotated[float, Field(ge=0, le=100, description="The function keeps a docstring.")] = 0.05
    complexity: Annotated[float, Field(ge=0, le=100, description="Low cyclomatic complexity (radon).")] = 0.05
    reward_model: Annotated[float, Field(ge=0, le=100, description="A reward model's score in [0, 1], when "
                                         "the caller passes one (0 = unused).")] = 0.0
    length_penalty: Annotated[float, Field(ge=0, le=100, description="Subtracted for programs longer than "
                                           "length_ratio x the reference solution.")] = 0.1


class CodeRewardConfig(Section):
    """How a candidate program is scored against a code task."""

    weights: CodeRewardWeights = Field(default_factory=CodeRewardWeights, description="Component weights.")
    reward_scale: Annotated[float, Field(gt=0, le=1000, description="The weighted sum is multiplied by "
                                         "this.")] = 1.0
    complexity_target: Annotated[int, Field(ge=1, le=50, description="Cyclomatic complexity that still scores "
                                            "1; above it the score is target / complexity.")] = 5
    length_ratio: Annotated[float, Field(gt=0, le=100, description="Programs up to this many times the "
                                         "reference solution's length get no length penalty; twice that gets "
                                         "the full penalty.")] = 3.0
    lint_select: Annotated[list[str], Field(min_length=1, description="ruff rule selectors counted as lint "
                                            "findings.")] = ["E", "F", "W"]
    lint_ignore: Annotated[list[str], Field(description="ruff rules not counted (line length: prompts carry "
                                            "long docstrings).")] = ["E501"]


class CodeConfig(Section):
    """Code tasks: the sandbox that runs model-written programs and the reward that scores them."""

    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Process isolation and limits.")
    reward: CodeRewardConfig = Field(default_factory=CodeRewardConfig, description="Reward components.")
    task_seed: Annotated[int, Field(ge=0, description="Seed of the code-task family (icrl_core/code_tasks.py); "
                                    "the same seed gives the same tasks.")] = 0
    variants: Annotated[int, Field(ge=1, le=100, description="Tasks per template (distinct parameters).")] = 11

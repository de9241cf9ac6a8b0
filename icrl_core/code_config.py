"""Config schema of the code tasks: the sandbox (icrl_core/sandbox.py) and the reward (icrl_core/code_reward.py).
A module of its own so the pipeline config (icrl_core/config.py) hangs it on as `code` without every stage
depending on the sandbox's and the reward's code."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

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


class CodeRolloutConfig(Section):
    """Code tasks as rollouts of the policy (`ppo.mode: code`, `dpo.mine_code`; icrl_core/code_rl.py): each step
    draws train-split code tasks and samples a group of completions per task, scored in the sandbox with the
    `code.reward` components."""

    tasks_per_step: Annotated[int, Field(ge=1, le=256, description="Train-split code tasks drawn per step (one "
                                         "group each; split over data-parallel workers).")] = 4
    group_size: Annotated[int, Field(ge=1, le=64, description="Completions sampled per task (G); group "
                                     "objectives compare them, DPO pairs a passing one with a failing "
                                     "one.")] = 4
    max_new_tokens: Annotated[int, Field(ge=16, le=512, description="Tokens generated per completion (the "
                                         "whole function in a code block).")] = 160
    eval_tasks: Annotated[int, Field(ge=0, le=1000, description="Held-out test-split tasks answered greedily at "
                                     "each evaluation (the same ones every time, a seeded sample): val_accuracy "
                                     "is their pass@1. Measurement only; nothing is selected on it (0: no "
                                     "evaluation).")] = 12


class CodeEvalConfig(Section):
    """`icrl code-eval`: pass@1 and pass@k (Chen et al., 2021) on code tasks, per difficulty level."""

    split: Annotated[Literal["train", "test"], Field(description="Tasks evaluated: test = the held-out "
                                                     "templates (never trained on), train = the training "
                                                     "templates.")] = "test"
    tasks_per_level: Annotated[int | None, Field(ge=1, le=1000, description="Tasks per difficulty level, a "
                                                 "seeded sample (empty = every task of the split).")] = None
    samples: Annotated[int, Field(ge=1, le=200, description="Completions sampled per task (n of the pass@k "
                                  "estimator).")] = 8
    k: Annotated[list[Annotated[int, Field(ge=1, le=200)]] | None, Field(
        min_length=1, description="The k of pass@k reported, each at most `samples` (empty: 1, 2, 4, ... up to "
        "samples, and samples).")] = None
    temperature: Annotated[float, Field(ge=0, le=10, description="Sampling temperature (0 = greedy, one "
                                        "sample per task).")] = 0.8
    max_new_tokens: Annotated[int, Field(ge=16, le=512, description="Tokens generated per completion.")] = 160
    batch_size: Annotated[int, Field(ge=1, le=256, description="Completions generated together (one KV "
                                     "cache).")] = 16
    output: Annotated[Path, Field(description="JSON file the results are written to (atomically).")] = Path(
        "artifacts/code_eval/code_eval.json")

    @property
    def ks(self) -> list[int]:
        """The k of pass@k: `k`, or the powers of 2 up to `samples` and `samples`."""
        if self.k is not None:
            return sorted(set(self.k))
        return sorted({2 ** i for i in range(8) if 2 ** i <= self.samples} | {self.samples})

    @model_validator(mode="after")
    def _k_fits_samples(self) -> CodeEvalConfig:
        too_big = [k for k in self.k or [] if k > self.samples]
        if too_big:
            raise ValueError(f"k={too_big} needs at least that many samples per task (samples={self.samples}): "
                             "pass@k is estimated from n >= k samples")
        if self.temperature == 0 and self.samples > 1:
            raise ValueError(f"temperature 0 (greedy) gives one completion per task: samples={self.samples} "
                             "would repeat it; set samples 1 or a temperature > 0")
        return self


class CodeConfig(Section):
    """Code tasks: the sandbox that runs model-written programs and the reward that scores them."""

    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="Process isolation and limits.")
    reward: CodeRewardConfig = Field(default_factory=CodeRewardConfig, description="Reward components.")
    task_seed: Annotated[int, Field(ge=0, description="Seed of the code-task family (icrl_core/code_tasks.py); "
                                    "the same seed gives the same tasks.")] = 0
    variants: Annotated[int, Field(ge=1, le=100, description="Tasks per template (distinct parameters).")] = 11
    eval: CodeEvalConfig = Field(default_factory=CodeEvalConfig, description="`icrl code-eval`: "
                                 "pass@1 and pass@k on held-out code tasks.")

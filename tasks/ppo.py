"""Stage `ppo`: PPO in ICRL mode (icrl_core/ppo.py, icrl_core/rollout.py) on the built episodes, with
ppo.mode=stream on in-context RL streams of tasks drawn from data.sources (icrl_core/stream_rl.py), or with
ppo.mode=code on code tasks rewarded in the sandbox (icrl_core/code_rl.py, docs/CODE_RL.md), with the objective
ppo.objective. In code mode history.json carries every reward component per iteration (`reward/<name>`) and
code_rewards.png plots them.

Inputs: data.output_dir/train.jsonl (and val.jsonl for greedy validation), the start adapter ppo.init_adapter
(default model.init_adapter),
the reward model ppo.reward_model_path when ppo.reward uses it. Outputs (atomic, rank 0): ppo.output_dir/adapter/
(adapter + value head, `policy.save_adapter`), history.json (per-iteration metrics), evals.json (validation accuracy by step), reward_curve.png,
metrics.json; metrics/ppo.json; MLflow params, per-iteration metrics and the artifacts. A killed run resumes from
its last checkpoint (every ppo.save_steps iterations) and ends with the same metrics as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from icrl_core.errors import UserError
from tasks.settings import PipelineConfig

STAGE = "ppo"
HEADLINE = ("mean_reward_last_20pct", "val_accuracy_after")  # metrics/ppo.json; the rest: output_dir/metrics.json


def read_split(config: PipelineConfig, split: str, required: bool):
    from icrl_core.episodes import read_episodes

    path = Path(config.data.output_dir) / f"{split}.jsonl"
    if not path.exists():
        if required:
            raise UserError(f"{path}: no episodes; run `icrl stage build_dataset` first (or set data.output_dir)")
        return []
    return read_episodes(path)


def load_scorer(config: PipelineConfig, reward, path: Path | None):
    """The reward model when `reward` needs one (None otherwise)."""
    if reward.kind == "task":
        return None
    if path is None:
        raise UserError(f"reward kind '{reward.kind}' needs a reward model: set ppo.reward_model_path "
                        "(e.g. artifacts/reward_model/reward_model)")
    from icrl_core.reward_model import load_reward_model

    return load_reward_model(path, config.model)


def code_scorer(config: PipelineConfig):
    """Code mode: the reward model (ppo.reward_model_path) when the reward_model component of
    code.reward.weights has a weight (the reward-model mode, docs/CODE_RL.md), else None."""
    if config.code.reward.weights.reward_model == 0:
        return None
    if config.ppo.reward_model_path is None:
        raise UserError("code.reward.weights.reward_model > 0 needs a reward model: set ppo.reward_model_path "
                        "(e.g. artifacts/reward_model/reward_model)")
    from icrl_core.reward_model import load_reward_model

    return load_reward_model(config.ppo.reward_model_path, config.model)


def max_episode_tokens(config: PipelineConfig, policy) -> int:
    return min(config.data.episode_tokens, policy.context_window)


def train_worker(config: PipelineConfig, runtime) -> dict:
    from icrl_core.adapter_format import VALUE_HEAD, require_adapter
    from icrl_core.model import policy_from_config
    from icrl_core.policy_optimization import train_ppo
    from icrl_core.ppo import zero_value_head
    from tasks.runtime import ProgressRuntime
    from tasks.training import replay_chats

    cfg = config.ppo
    stream_sources = None
    if cfg.mode == "stream":  # streams draw their tasks from data.sources, not from the built episodes
        from icrl_core.dataset_build import resolve_sources

        train, val = [], []
        stream_sources = (resolve_sources(config.data, config.seed), config.data)
    elif cfg.mode == "code":  # code tasks are generated (icrl_core/code_tasks.py), not read
        train, val = [], []
    else:
        train = read_split(config, "train", required=True)
        val = read_split(config, "val", required=False)
    init = cfg.init_adapter or config.model.init_adapter
    if init is not None:
        require_adapter(init, "ppo.init_adapter", "run the bootstrap stage first")
    policy = policy_from_config(config.model, value_head=cfg.value_head, seed=config.seed, init_adapter=init)
    if not any(p.requires_grad for p in policy.model.parameters()):
        raise UserError("PPO needs trainable weights: set model.adapter.kind to lora or last_blocks")
    if cfg.value_head and not (init is not None and (Path(init) / VALUE_HEAD).exists()):
        zero_value_head(policy)  # a fresh critic (one trained by an earlier PPO run is kept)
    scorer = code_scorer(config) if cfg.mode == "code" else load_scorer(config, cfg.reward, cfg.reward_model_path)
    max_tokens = max_episode_tokens(config, policy)
    with contextlib.ExitStack() as stack:
        pool = None
        if cfg.async_rollouts.enabled:  # stream rollouts in Ray actors (docs/ASYNC.md)
            from tasks.async_rollouts import RolloutPool

            pool = stack.enter_context(RolloutPool(config, policy.adapter, max_tokens))
        progress = stack.enter_context(ProgressRuntime(runtime, cfg.max_steps, STAGE,
                                                       ("mean_reward", "kl", "val_accuracy")))
        replay = replay_chats(config, policy, runtime.rank, cfg.replay)
        engine = None
        if cfg.mode == "stream" and cfg.stream.engine == "inference":
            engine = rollout_engine(config, stack.enter_context(tempfile.TemporaryDirectory(prefix="icrl-rollout-")))
            stack.callback(engine.close)
        summary, history, evals = train_ppo(policy, train, val, cfg, config.seed, progress, max_tokens, scorer,
                                            stream_sources, config.code, pool, replay, engine)
    if runtime.rank == 0:
        write_outputs(Path(cfg.output_dir), policy, history, evals)
    return {**summary, "world_size": runtime.world_size}


def rollout_engine(config: PipelineConfig, work_dir: str):
    """The engine that decodes stream rollouts (`ppo.stream.engine: inference`, stream_rl.RolloutEngine), built by
    `inference.backend`'s own `from_config` on the base model (the rollout's adapter is the live policy, or comes
    per request) with a prefix cache per stream of a group (each stream's context only grows) and no fused
    passes (one caller): the torch engine around the live policy, built per rollout; another backend (vllm)
    started once, the policy's adapter saved into `work_dir` for each rollout."""
    from icrl_core.inference.base import engine_from_config
    from icrl_core.stream_rl import RolloutEngine

    rollout = config.model_copy(update={
        "model": config.model.model_copy(update={"init_adapter": None}),
        "icrl_eval": config.icrl_eval.model_copy(update={"cache_entries": config.ppo.stream.group_size + 1}),
        "inference": config.inference.model_copy(update={"fuse_streams": False})})
    if config.inference.backend == "torch":
        return RolloutEngine(lambda policy: engine_from_config(rollout, policy))
    return RolloutEngine(lambda policy: engine_from_config(rollout), adapter_dir=work_dir)


def write_outputs(out: Path, policy, history: list[dict], evals: list[dict]) -> None:
    from icrl_core.io import atomic_write_json
    from tasks.training import plot_records

    policy.save_adapter(out / "adapter")
    # Two flat lists of records: the shape `dvc plots` reads.

    atomic_write_json(out / "history.json", plot_records(history))
    atomic_write_json(out / "evals.json", plot_records(evals))
    plot_reward_curve(history, evals, out / "reward_curve.png")
    if history and any(key.startswith("reward/") for key in history[-1]):
        plot_code_rewards(history, out / "code_rewards.png")


def plot_code_rewards(history: list[dict], path: Path) -> None:
    """Code mode: the mean of every reward component per iteration (the length penalty is subtracted) and the
    pass rate."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from icrl_core.io import atomic_write_bytes

    steps = [h["step"] for h in history]
    keys = sorted(k for k in history[-1] if k.startswith("reward/") and k != "reward/tests_passed")
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in keys:
        ax.plot(steps, [h.get(key) for h in history], "-", label=key.removeprefix("reward/"))
    ax.plot(steps, [h["task_accuracy"] for h in history], "k--", label="pass rate (all tests)")
    ax.set_xlabel("PPO iteration")
    ax.set_ylabel("mean over completions")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def plot_reward_curve(history: list[dict], evals: list[dict], path: Path) -> None:
    """Mean reward per iteration (and its 5-iteration moving average), KL and validation accuracy."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from icrl_core.io import atomic_write_bytes

    if not history:
        return
    steps = [h["step"] for h in history]
    reward = [h["mean_reward"] for h in history]
    window = 5
    smooth = [sum(reward[max(0, i - window + 1):i + 1]) / len(reward[max(0, i - window + 1):i + 1])
              for i in range(len(reward))]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, reward, "o-", alpha=0.4, label="mean reward (rollouts)")
    top.plot(steps, smooth, "-", label=f"moving average ({window})")
    val = [(e["step"], e["val_accuracy"]) for e in evals if "val_accuracy" in e]
    if val:
        top.plot(*zip(*val), "s--", label="validation accuracy (greedy)")
    top.set_ylabel("reward")
    top.legend()
    bottom.plot(steps, [h["kl"] for h in history], "-", label="KL to reference (per episode)")
    bottom.plot(steps, [h["entropy"] for h in history], "-", label="entropy (per token)")
    bottom.set_xlabel("PPO iteration")
    bottom.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def run(config: PipelineConfig) -> dict:
    from tasks.training import run_training_stage

    # metrics.json is logged too: it is written before the artifacts are logged.
    artifacts = {"adapter": "adapter", "history.json": None, "evals.json": None, "reward_curve.png": None,
                 "metrics.json": None}
    if config.ppo.mode == "code":
        artifacts["code_rewards.png"] = None
    return run_training_stage(config, STAGE, train_worker, config.ppo.output_dir, artifacts, HEADLINE,
                              log_summary=True)

"""Stage `dpo`: DPO or IPO (icrl_core/dpo.py) on the (preferred, rejected) answer pairs of the tokenized episodes,
with dpo.mine_streams on pairs mined from the policy's own in-context RL streams, and with dpo.mine_code on
(passing, failing) completions of code tasks the policy samples (icrl_core/code_rl.py); the reference is the
policy with its adapters disabled. It starts from dpo.init_adapter (default model.init_adapter; params.yaml: the
bootstrap adapter) and replaces reward_model + ppo: evaluate and promote it with
`evaluate.adapter: artifacts/dpo/adapter` (DVC then runs bootstrap -> dpo -> evaluate, docs/DPO.md).

Outputs (rank 0, atomic): dpo.output_dir/adapter/ (policy.save_adapter), metrics.json, history.json, curves.png;
metrics/dpo.json; MLflow params, step metrics (loss, margin, accuracy, val_preference_accuracy), the adapter and
the curves. Resumes from its last checkpoint after a kill, like the other training stages.
"""

from __future__ import annotations

from pathlib import Path

from tasks.settings import PipelineConfig

STAGE = "dpo"
HEADLINE = ("val_preference_accuracy", "val_preference_accuracy_before", "val_margin", "val_accuracy_before",
            "val_accuracy",  # val_accuracy: greedy pass@1 on held-out code tasks (dpo.mine_code)
            "val_couple_accuracy", "val_couple_accuracy_before", "val_hindsight_accuracy",
            "val_hindsight_accuracy_before")  # hindsight couples of validation streams (dpo.mine_hindsight)


def start_adapter(config: PipelineConfig) -> Path | None:
    from icrl_core.adapter_format import require_adapter

    init = config.dpo.init_adapter or config.model.init_adapter
    if init is not None:
        require_adapter(init, "dpo.init_adapter", "run the bootstrap stage first")
    return init


def train_worker(config: PipelineConfig, runtime) -> dict:
    from icrl_core.dpo import train_dpo
    from icrl_core.model import policy_from_config
    from icrl_core.supervised import episode_pairs, finite
    from icrl_core.tokenized import read_tokenized
    from tasks.runtime import ProgressRuntime
    from tasks.training import replay_chats, write_history

    cfg = config.dpo
    train, val = [], []
    if cfg.episode_pairs or Path(config.tokenize.output_dir).exists():
        rows = read_tokenized(config.tokenize.output_dir)
        train = episode_pairs([r for r in rows if r.split == "train"])
        val = episode_pairs([r for r in rows if r.split == "val"])
    sources = None
    if cfg.mine_streams or cfg.mine_hindsight:
        from icrl_core.dataset_build import resolve_sources

        sources = (resolve_sources(config.data, config.seed), config.data)
    policy = policy_from_config(config.model, seed=config.seed, init_adapter=start_adapter(config))
    with ProgressRuntime(runtime, cfg.max_steps, STAGE, ("loss", "margin", "val_preference_accuracy")) as progress:
        replay = replay_chats(config, policy, runtime.rank, cfg.replay)  # before the reference is frozen
        metrics, history = train_dpo(policy, train, val, cfg, config.seed, progress, sources,
                                     min(config.data.episode_tokens, policy.context_window), config.code, replay)
    if runtime.rank == 0:
        out = Path(cfg.output_dir)
        policy.save_adapter(out / "adapter")
        panels = {f"{cfg.loss.upper()} loss": ["loss", "val_loss"],
                  "implicit reward margin (beta h)": ["margin", "val_margin"],
                  "preference accuracy (h > 0)": ["accuracy", "val_preference_accuracy"]}
        if cfg.mine_hindsight:  # 0.5 / 0 for a feedback-blind policy (icrl_core/hindsight.py)
            panels["hindsight couples"] = ["hindsight_accuracy", "couple_accuracy", "val_hindsight_accuracy",
                                           "val_couple_accuracy"]
            panels["implicit reward margin (beta h)"].append("val_hindsight_margin")
        if cfg.replay.beta > 0:
            panels["general-chat replay: KL(policy || reference)"] = ["replay_kl", "val_replay_kl"]
        if cfg.mine_code:
            panels["code tasks (sampled; val: greedy, held out)"] = ["task_accuracy", "reward/pass_fraction",
                                                                     "mean_reward", "val_accuracy"]
        write_history(out, history, panels, f"{cfg.loss} ({config.model.spec}, beta {cfg.beta})")
    return finite(metrics)


def run(config: PipelineConfig) -> dict:
    from tasks.training import run_training_stage

    start_adapter(config)  # fail early, before any run is opened, when the start adapter is missing
    return run_training_stage(config, STAGE, train_worker, config.dpo.output_dir,
                              {"adapter": "adapter", "curves.png": None}, HEADLINE)

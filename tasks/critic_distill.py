"""Stage `critic_distill`: the policy (`model`, its LoRA adapter) trained with critic_distill.method: reverse_kl
distils the Q-weighted policy pi_new of the trained critic (critic stage) into it; rft, the baseline, fine-tunes
it on the critic_data train trajectories that succeeded. Same optimizer steps and prompts per step for both
(icrl_core/critic.py `train_distilled_policy`, docs/CRITIC.md).

Outputs (rank 0, atomic): critic_distill.output_dir/adapter/ (policy.save_adapter), metrics.json (val_reward
before and after: mean exact-match reward of sampled answers on the held-out prompts), history.json, curves.png;
metrics/critic_distill.json; MLflow. Resumes from its last checkpoint after a kill, like the other training
stages.
"""

from __future__ import annotations

from pathlib import Path

from tasks.settings import PipelineConfig

STAGE = "critic_distill"
HEADLINE = ("val_reward", "val_reward_before")


def train_worker(config: PipelineConfig, runtime) -> dict:
    from icrl_core.critic import load_critic, train_distilled_policy
    from icrl_core.model import policy_from_config
    from icrl_core.supervised import finite
    from tasks.critic import model_dir, read_groups
    from tasks.runtime import ProgressRuntime
    from tasks.training import write_history

    cfg, dcfg = config.critic, config.critic_distill
    train, val = read_groups(config)
    policy = policy_from_config(config.model, seed=config.seed)
    critic, tokens = (None, None)
    if dcfg.method == "reverse_kl":
        critic, tokens = load_critic(model_dir(config), config.model)
    else:  # rft reads only the success threshold of the bins
        from icrl_core.critic import CriticTokens, JointBins

        tokens = CriticTokens(JointBins.from_config(cfg.bins), ())
    eot = policy.tokens.end_of_turn_id

    def answer_of(ids) -> str:  # as the rollout reads an answer: without its end-of-turn, stripped
        return policy.tokens.decode(ids[:-1] if ids and ids[-1] == eot else ids).strip()

    with ProgressRuntime(runtime, dcfg.max_steps, STAGE, ("loss", "val_reward")) as progress:
        metrics, history = train_distilled_policy(policy, critic, tokens, train, val, cfg, dcfg, policy.tokens.encode,
                                                  answer_of, (eot, policy.tokenizer.eos_token_id), config.seed,
                                                  progress)
    if runtime.rank == 0:
        out = Path(dcfg.output_dir)
        policy.save_adapter(out / "adapter")
        write_history(out, history, {"loss": ["loss"], "reward (val: sampled, held out)": ["val_reward",
                                                                                          "sampled_reward"]},
                      f"critic_distill: {dcfg.method} ({config.model.spec})")
    metrics["method"] = dcfg.method
    return finite(metrics)


def run(config: PipelineConfig) -> dict:
    from tasks.critic import model_dir, read_groups
    from tasks.training import run_training_stage

    read_groups(config)  # fail early, before any run is opened, when the trajectories are missing
    if config.critic_distill.method == "reverse_kl":
        from icrl_core.io import read_user_text

        read_user_text(model_dir(config) / "critic.json", "critic", "run `icrl stage critic` first")
    return run_training_stage(config, STAGE, train_worker, config.critic_distill.output_dir,
                              {"adapter": "adapter", "curves.png": None}, HEADLINE)

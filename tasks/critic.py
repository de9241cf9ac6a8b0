"""Stage `critic`: the in-context critic (icrl_core/critic.py, docs/CRITIC.md) trained on packed contexts of the
critic_data stage's train prompts, measured on its held-out prompts: critic loss, AUC of predicted success (with
a 95% bootstrap interval over prompts) and calibration, best-of-n with the critic vs at random vs consistency.

Outputs (rank 0, atomic): critic.output_dir/model/ (critic.safetensors + critic.json; `load_critic`),
metrics.json, history.json, curves.png, selection.json, q_view.html (held-out trajectories, each token coloured
by its Q-value); metrics/critic.json; MLflow params, step metrics, the model, the curves and the HTML view.
Resumes from its last checkpoint after a kill, like the other training stages.
"""

from __future__ import annotations

from pathlib import Path

from tasks.settings import PipelineConfig

STAGE = "critic"
HEADLINE = ("val_auc", "val_auc_low", "val_auc_high", "val_auc_before", "val_ece", "best_of_n_reward",
            "random_of_n_reward", "consistency_reward", "q_weighted_reward", "plain_sampling_reward",
            "min_p_sampling_reward", "q_minus_plain", "q_minus_min_p")


def model_dir(config: PipelineConfig) -> Path:
    return Path(config.critic.output_dir) / "model"


def read_groups(config: PipelineConfig):
    from icrl_core.critic import read_trajectory_groups
    from icrl_core.errors import UserError

    path = config.critic.data.trajectories_path
    groups = read_trajectory_groups(path)
    if not groups.get("train"):
        raise UserError(f"{path} has no train trajectories: run `icrl stage critic_data`")
    rewards = [t.reward for part in groups.values() for g in part for t in g.trajectories]
    values = config.critic.bins.reward_values
    if min(rewards) < values[0] or max(rewards) > values[-1]:
        # a reward past an end would silently fall in that end's bin: E[r] and P(success) would mean less
        raise UserError(f"the trajectories' rewards span [{min(rewards):g}, {max(rewards):g}], beyond "
                        f"critic.bins.reward_values {values}: set values spanning them (code rewards: "
                        "docs/CRITIC.md)")
    return groups.get("train", []), groups.get("val", [])


def q_view(critic, tokens, groups, cfg, encode, decode) -> str:
    """The HTML view: the first candidate of up to `cfg.html_trajectories` held-out prompts, read after the
    prompt's first K - 1 trajectories and their feedback, each token coloured by Q(s_t, a_t)."""
    import math

    from icrl_core.critic import candidate_contexts, render_q_html, target_values

    shown = []
    for group in groups:
        if len(shown) >= cfg.html_trajectories or len(group.trajectories) < cfg.context_trajectories:
            continue
        context = candidate_contexts(group, cfg, tokens.bins, encode)[0]
        candidate = group.trajectories[cfg.context_trajectories - 1]
        values = target_values(critic, tokens, [context], cfg.q.value)[0]
        earlier = "".join(f"{decode(t.token_ids)!r} -> reward {t.reward:g}; "
                          for t in group.trajectories[: cfg.context_trajectories - 1])
        shown.append({"heading": f"{group.prompt_id}: reward {candidate.reward:g}",
                      "meta": f"earlier attempts: {earlier}final Q {values[-1]:.3f}" if values else earlier,
                      "prompt": decode(group.prompt_ids[-200:]),
                      "pieces": [decode([t]) for t in candidate.token_ids],
                      "q": [v if math.isfinite(v) else None for v in values]})
    values = list(tokens.bins.reward_values)
    return render_q_html(f"Critic Q-values ({cfg.q.value}) on held-out prompts", shown, low=values[0],
                         high=values[-1])


def train_worker(config: PipelineConfig, runtime) -> dict:
    import numpy as np
    import torch

    from icrl_core.critic import (
        JointBins,
        new_critic,
        q_sampling_metrics,
        sample_context,
        save_critic,
        selection_metrics,
        train_critic,
    )
    from icrl_core.io import atomic_write_json, atomic_write_text
    from icrl_core.supervised import finite
    from tasks.runtime import ProgressRuntime
    from tasks.training import write_history

    cfg = config.critic
    train, val = read_groups(config)
    bins = JointBins.from_config(cfg.bins)
    critic, tokens = new_critic(config.model, bins, seed=config.seed)

    def encode(text: str) -> tuple[int, ...]:
        return critic.tokens.encode(text)

    def decode(ids) -> str:
        return critic.tokens.decode(ids)

    # held-out contexts: one per val prompt, fixed by the seed
    val_contexts = [sample_context(g, cfg, bins, encode, np.random.default_rng([config.seed, 10_000 + i]))
                    for i, g in enumerate(val)]
    with ProgressRuntime(runtime, cfg.max_steps, STAGE, ("loss", "val_auc")) as progress:
        metrics, history = train_critic(critic, tokens, train, val_contexts, cfg, encode, config.seed, progress,
                                        [g.prompt_id for g in val])
    if runtime.rank == 0:
        out = Path(cfg.output_dir)
        with torch.no_grad():
            selection = selection_metrics(critic, tokens, val, cfg, encode, decode)
        metrics.update(selection)
        if cfg.q.eval_samples:
            eot = critic.tokens.end_of_turn_id

            def answer_of(ids) -> str:  # as the rollout reads an answer: without its end-of-turn, stripped
                return decode(ids[:-1] if ids and ids[-1] == eot else ids).strip()

            metrics.update(q_sampling_metrics(critic, tokens, val, cfg, encode, answer_of, cfg.data.max_new_tokens,
                                              (eot, critic.tokenizer.eos_token_id), config.seed))
        save_critic(model_dir(config), critic, tokens, {"metrics": finite(metrics), "torch": torch.__version__})
        atomic_write_json(out / "selection.json", finite(selection))
        atomic_write_text(out / "q_view.html", q_view(critic, tokens, val, cfg, encode, decode))
        write_history(out, history, {"critic loss": ["loss", "val_loss"], "AUC of P(success)": ["val_auc",
                                     "val_auc_first_token"], "calibration": ["val_ece", "val_brier"]},
                      f"in-context critic ({config.model.spec}, K={cfg.context_trajectories}, "
                      f"N={cfg.supervise_from})")
    return finite(metrics)


def run(config: PipelineConfig) -> dict:
    from tasks.training import run_training_stage

    read_groups(config)  # fail early, before any run is opened, when the trajectories are missing
    return run_training_stage(config, STAGE, train_worker, config.critic.output_dir,
                              {"model": "model", "curves.png": None, "selection.json": None, "q_view.html": None},
                              HEADLINE)

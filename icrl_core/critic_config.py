"""Config schema of the in-context critic (icrl_core/critic.py; issue 28, in-context value learning). A module of
its own so the pipeline config (tasks/settings.py) hangs it on as `critic` without every stage depending on the
critic's code (the reason icrl_core/code_config.py exists too)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from icrl_core.config import OptimFields
from icrl_core.schema import Section


class CriticBins(Section):
    """The critic's output: a joint distribution over (reward bin, remaining-length bin), one added special token
    per pair (R reward bins x L length bins = R * L tokens)."""

    reward_values: Annotated[list[float], Field(min_length=2, max_length=64, description="The reward each reward "
                                                "bin stands for, increasing; a reward falls in the bin of the "
                                                "nearest value (a tie goes up). Task rewards are 0/1: [0, "
                                                "1]; code rewards need more values (docs/CRITIC.md).")] = [
        0.0, 1.0]
    length_edges: Annotated[list[Annotated[int, Field(ge=1)]], Field(
        min_length=1, max_length=63, description="Increasing edges of the remaining-length bins, in tokens: bin 0 "
        "is [0, e_0), bin j is [e_(j-1), e_j), the last bin [e_last, inf). Remaining length = trajectory tokens "
        "after the one just read.")] = [1, 2, 4, 8, 16, 32, 64]
    success_threshold: Annotated[float, Field(allow_inf_nan=False, description="A trajectory succeeds when its "
                                              "reward is at least this: P(success) sums the reward bins whose "
                                              "value reaches it (between the lowest and highest value).")] = 0.5

    @model_validator(mode="after")
    def _increasing(self) -> CriticBins:
        for name in ("reward_values", "length_edges"):
            values = getattr(self, name)
            if any(b <= a for a, b in itertools.pairwise(values)):
                raise ValueError(f"{name} must be strictly increasing, got {values}")
        if not self.reward_values[0] < self.success_threshold <= self.reward_values[-1]:
            raise ValueError(f"success_threshold {self.success_threshold} must lie above the lowest and at most "
                             f"the highest reward value {self.reward_values}: else every or no bin succeeds")
        return self


class QSampling(Section):
    """Q-weighted sampling (icrl_core/critic.py): at each state the reference policy's min-p-filtered candidate
    tokens are reweighted by the critic, pi_new(a|s) = pi_ref(a|s) exp(Q(s, a) / tau) / Z over the kept
    candidates."""

    min_p: Annotated[float, Field(ge=0, le=1, description="Keep a candidate token a when pi_ref(a|s) >= min_p * "
                                  "max_a' pi_ref(a'|s) (0: every token, up to max_candidates).")] = 0.1
    max_candidates: Annotated[int, Field(ge=1, le=256, description="At most this many candidates per state (the "
                                         "most probable ones): each costs the critic one more token.")] = 8
    tau: Annotated[float, Field(gt=0, le=1e6, description="Temperature of the Q weighting: small tau follows the "
                                "critic, large tau the reference.")] = 0.1
    value: Annotated[Literal["expected_reward", "success_probability"], Field(
        description="What Q(s, a) is read as from the critic's joint bins: the expected reward, or "
        "P(reward >= success_threshold).")] = "expected_reward"
    eval_samples: Annotated[int, Field(ge=0, le=64, description="At the end of the critic stage: this many "
                                       "Q-weighted samples per held-out prompt (pi_ref = the base model), their "
                                       "mean reward against as many plain samples of critic_data (0: skipped; each "
                                       "token costs a reference and a critic pass over the state).")] = 0


class CriticDataConfig(Section):
    """The critic_data stage: trajectories sampled from the reference policy (`model`, with model.init_adapter if
    set). Source `episodes`: answers to the first query of built episodes (data.output_dir: the train split for
    training prompts, the val split for held-out ones), rewarded by exact match with the gold answer (the task
    reward of the rollouts). Source `code`: completions of code tasks (the `code` section's family: train-split
    tasks for training prompts, held-out test-split tasks for held-out ones), rewarded by the composed code reward
    of the sandbox (`code.reward`)."""

    source: Annotated[Literal["episodes", "code"], Field(
        description="Where the prompts come from. episodes: the first query of built episodes, reward = exact "
        "match (0/1). code: code tasks as code RL prompts them, reward = the composed code reward of the sandbox "
        "(continuous, up to about 2.3 with the default code.reward; set critic.bins.reward_values to span it, "
        "docs/CRITIC.md), gold empty.")] = "episodes"
    prompts: Annotated[int, Field(ge=1, le=100000, description="Training prompts (episodes: the first query of "
                                  "the first N train episodes; code: N train-split tasks, a seeded sample spread "
                                  "over the difficulty levels).")] = 48
    val_prompts: Annotated[int, Field(ge=0, le=100000, description="Held-out prompts (episodes: from the val "
                                      "split; code: test-split tasks, sampled as the training ones): the critic's "
                                      "AUC, calibration and best-of-n are measured on them.")] = 16
    samples_per_prompt: Annotated[int, Field(ge=2, le=256, description="Trajectories sampled per prompt.")] = 8
    max_new_tokens: Annotated[int, Field(ge=1, le=1024, description="Longest trajectory, in tokens (a cut one "
                                         "is kept, marked unfinished). Code: room for the whole function, e.g. "
                                         "160 as code RL (ppo.code.max_new_tokens).")] = 16
    temperature: Annotated[float, Field(gt=0, le=10, description="Sampling temperature of the reference "
                                        "policy.")] = 1.0
    batch_size: Annotated[int, Field(ge=1, le=1024, description="Trajectories generated together (one KV "
                                     "cache); each batch draws from a generator seeded by (seed, split, batch "
                                     "index), so the file does not depend on which worker generates it.")] = 16
    workers: Annotated[int, Field(ge=0, le=64, description="0: generate in the stage's process. N >= 1: N Ray "
                                  "tasks (1 CPU, 1 torch thread each; local Ray or ray.address), each loading the "
                                  "reference policy once and generating every N-th batch; the same file as "
                                  "0.")] = 0
    output_dir: Annotated[Path, Field(description="Where trajectories.parquet (one row per trajectory) and "
                                      "metrics.json go.")] = Path("artifacts/critic_data")

    @property
    def trajectories_path(self) -> Path:
        """The trajectories file the critic_data stage writes and the critic's stages read."""
        return self.output_dir / "trajectories.parquet"


class CriticDistillConfig(OptimFields):
    """The critic_distill stage: the policy (`model`, LoRA) trained either by reverse-KL distillation of the
    Q-weighted policy pi_new (the trained critic's Q over pi_ref's min-p candidates, critic.q) or, as the
    baseline, by rejection fine-tuning (cross-entropy on the critic_data train trajectories that succeeded). Both
    take the same optimizer steps on the same number of prompts per step. A section of its own (`critic_distill`,
    not under `critic`) so that DVC reruns the critic stage only when the critic's own parameters change."""

    method: Annotated[Literal["reverse_kl", "rft"], Field(description="reverse_kl: each step samples one "
                                                          "trajectory per drawn prompt from pi_new and minimises "
                                                          "KL(pi_theta || pi_new) over its states' candidates. rft: "
                                                          "cross-entropy on successful trajectories.")] = "reverse_kl"
    learning_rate: Annotated[float, Field(gt=0, le=1, description="AdamW learning rate.")] = 1e-4
    max_steps: Annotated[int, Field(ge=1, description="Optimizer steps to run.")] = 20
    eval_samples: Annotated[int, Field(ge=0, le=64, description="Answers sampled (temperature 1) per held-out "
                                       "prompt at each evaluation: val_reward is their mean exact-match reward "
                                       "(0: no evaluation).")] = 4
    lr_schedule: Annotated[Literal["constant", "linear"], Field(description="After warm-up: constant, or "
                                                                "linear decay to 0 at max_steps.")] = "constant"
    output_dir: Annotated[Path, Field(description="Stage output folder (the policy adapter, metrics).")] = Path(
        "artifacts/critic_distill")


class CriticConfig(OptimFields):
    """The in-context critic (docs/CRITIC.md): the policy backbone with LoRA and R x L added joint-bin tokens,
    trained on packed contexts (a prompt, `context_trajectories` sampled answers each followed by its feedback
    line), supervised on the answers from the `supervise_from`-th on."""

    learning_rate: Annotated[float, Field(gt=0, le=1, description="AdamW learning rate (LoRA and the added "
                                          "tokens' embedding rows).")] = 1e-3
    lr_schedule: Annotated[Literal["constant", "linear"], Field(description="After warm-up: constant, or "
                                                                "linear decay to 0 at max_steps.")] = "constant"
    bins: CriticBins = Field(default_factory=CriticBins, description="Reward and remaining-length bins.")
    context_trajectories: Annotated[int, Field(ge=1, le=64, description="Trajectories of one prompt packed into "
                                               "one training context (K).")] = 4
    supervise_from: Annotated[int, Field(ge=1, le=64, description="The critic loss covers the trajectories from "
                                         "the N-th of a packed context on (1-based): each has at least N - 1 "
                                         "earlier attempts and their feedback to read.")] = 2
    feedback_template: Annotated[str, Field(min_length=1, description="The feedback line after each earlier "
                                            "trajectory, written on a line of its own ({reward}: its reward, "
                                            "{length}: its tokens).")] = "Reward: {reward:g} / Length: {length}"
    q: QSampling = Field(default_factory=QSampling, description="Q-labelling and Q-weighted sampling.")
    data: CriticDataConfig = Field(default_factory=CriticDataConfig, description="The critic_data stage.")
    html_trajectories: Annotated[int, Field(ge=0, le=1000, description="Held-out trajectories shown in the HTML "
                                            "view, each token coloured by its Q-value.")] = 8
    max_eval_contexts: Annotated[int | None, Field(ge=1, description="Validation contexts used at each "
                                                   "evaluation (empty = all).")] = 64
    output_dir: Annotated[Path, Field(description="Stage output folder (critic weights, metrics, the HTML "
                                      "view).")] = Path("artifacts/critic")

    @model_validator(mode="after")
    def _supervised_trajectory_exists(self) -> CriticConfig:
        if self.supervise_from > self.context_trajectories:
            raise ValueError(f"supervise_from={self.supervise_from} > context_trajectories="
                             f"{self.context_trajectories}: no trajectory of a context would be supervised")
        return self

"""The config schema of the policy-optimization objectives (`ppo.objective`, a union discriminated on `kind`, and
`ppo.distill`), beside their losses in icrl_core/objectives.py. Kept free of torch so that reading or validating a
config (`icrl --help`, `icrl config show`, a user error) does not pay torch's import."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from icrl_core.schema import Section


class PPOObjective(Section):
    """PPO (Schulman et al., 2017): value head, GAE over the steps of a stream (ppo.gamma, ppo.gae_lambda), the
    clipped ratio (ppo.clip_range), a clipped value loss (ppo.vf_coef, ppo.value_clip), the KL to the reference
    in the reward (ppo.kl_beta). Its knobs are the ppo.* fields."""

    kind: Literal["ppo"] = "ppo"


class GRPOObjective(Section):
    """GRPO: group-normalised advantages over the streams of a group, clipped ratio, sequence-mean loss, KL to
    the reference as a loss term (k3, weight ppo.kl_beta)."""

    kind: Literal["grpo"] = "grpo"
    scale_advantages: Annotated[bool, Field(description="Divide by the group's standard deviation (off: the "
                                            "advantage is only centred).")] = True
    clip_low: Annotated[float, Field(gt=0, lt=1, description="Lower ratio clip: rho >= 1 - clip_low.")] = 0.2
    clip_high: Annotated[float, Field(gt=0, description="Upper ratio clip: rho <= 1 + clip_high (DAPO's "
                                      "clip-higher raises it).")] = 0.2


class RLOOObjective(Section):
    """RLOO: each stream's baseline is the mean return of the other streams of its group; clipped ratio,
    sequence-mean loss, KL term (k3, ppo.kl_beta)."""

    kind: Literal["rloo"] = "rloo"
    clip_range: Annotated[float, Field(gt=0, lt=1, description="Ratio clip epsilon.")] = 0.2


class DrGRPOObjective(Section):
    """Dr.GRPO (GRPO done right): centred advantages without std normalisation, the clipped token losses summed
    and divided by a constant (streams x steps x the longest label path), so neither group difficulty nor
    answer length rescales the gradient. KL term (k3, ppo.kl_beta)."""

    kind: Literal["dr_grpo"] = "dr_grpo"
    clip_range: Annotated[float, Field(gt=0, lt=1, description="Ratio clip epsilon.")] = 0.2


class GSPOObjective(Section):
    """GSPO (Zheng et al., 2025): the importance ratio of a whole stream, exp(mean over its action tokens of
    log rho), clipped (token form: each token's gradient flows through its own log-prob), GRPO advantages."""

    kind: Literal["gspo"] = "gspo"
    scale_advantages: Annotated[bool, Field(description="Divide by the group's standard deviation.")] = True
    clip_low: Annotated[float, Field(gt=0, lt=1, description="Lower clip of the sequence ratio (the paper: "
                                     "3e-4; sequence ratios stay much closer to 1 than token ratios).")] = 3e-4
    clip_high: Annotated[float, Field(gt=0, description="Upper clip of the sequence ratio (the paper: "
                                      "4e-4).")] = 4e-4


class OPOObjective(Section):
    """OPO (Hao et al., 2025): exactly on-policy policy gradient with the length-weighted optimal baseline (use
    ppo.epochs 1: every update on fresh streams). KL term (k3, ppo.kl_beta)."""

    kind: Literal["opo"] = "opo"


class AIPOObjective(Section):
    """AIPO (Llama-RL; prime-rl's default loss): advantage times the importance ratio to the behaviour policy,
    capped from above at delta, token mean; group-centred advantages. KL term (k3, ppo.kl_beta)."""

    kind: Literal["aipo"] = "aipo"
    delta: Annotated[float, Field(gt=1, description="Cap of the importance ratio pi / mu.")] = 8.0


Objective = Annotated[PPOObjective | GRPOObjective | RLOOObjective | DrGRPOObjective | GSPOObjective
                      | OPOObjective | AIPOObjective, Field(discriminator="kind")]
OBJECTIVE_KINDS = ("ppo", "grpo", "rloo", "dr_grpo", "gspo", "opo", "aipo")
OBJECTIVE_TYPES = (PPOObjective, GRPOObjective, RLOOObjective, DrGRPOObjective, GSPOObjective, OPOObjective,
                   AIPOObjective)


class ContextDistillation(Section):
    """Context distillation in stream mode (the asynchronous RL framework's context-distillation loss): the teacher
    is the same weights shown the in-context-learning view of the stream (every past query with its gold label, no
    feedback: the ICL upper bound), the student is the policy with its own answers and their feedback in context.
    Each step's reward becomes (`distillation_rewards`)

        r'_t = adv_tau * r_t + teacher_tau * log pi_teacher(a_t) - student_tau * log pi(a_t | s_t)

    before returns and advantages, a_t the student's answer, both log-probs under the constrained decoding at
    ppo.temperature. teacher_tau = student_tau = 0 (the default) is plain task reward."""

    adv_tau: Annotated[float, Field(ge=0, description="Weight of the task reward r_t (1 or 0).")] = 1.0
    teacher_tau: Annotated[float, Field(ge=0, description="Weight of the teacher's log-probability of the "
                                        "student's answer (the distillation signal; 0: no teacher pass).")] = 0.0
    student_tau: Annotated[float, Field(ge=0, description="Weight of minus the student's own log-probability of "
                                        "its answer (an entropy bonus through the reward).")] = 0.0

    @property
    def active(self) -> bool:
        return self.teacher_tau > 0 or self.student_tau > 0 or self.adv_tau != 1.0

"""Code tasks as a trajectory source of the in-context critic (critic.data.source = code; docs/CRITIC.md): the
critic_data stage's batches of (code task, sample) jobs answered by the reference policy with the prompt of code RL
(icrl_core/code_rl.py) and scored by the composed code reward of the sandbox. A module of its own so that only
the critic_data stage depends on the code tasks, the sandbox and code RL; the critic's own stages read the
trajectories file alone.

    reward  = reward_scale * gate * max(0, sum_c w_c c - w_length penalty)     (code_reward.compose, `code.reward`)
    success = every test passed                                                 (code_rl.passes)
    gold    = ""  (no answer to match exactly: the exact-match measurements of the critic skip these prompts)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from icrl_core.code_config import CodeConfig
from icrl_core.code_rl import code_episode, passes, score_completions
from icrl_core.code_tasks import CodeTask
from icrl_core.critic import GenerationBatch, batch_generator, trajectory_row
from icrl_core.rollout import Sampling, generate_rollouts


@torch.no_grad()
def sample_code_batch(policy, batch: GenerationBatch, shot: CodeTask, code: CodeConfig, sampling: Sampling,
                      max_new_tokens: int, max_tokens: int, seed: int) -> list[dict]:
    """Completions of each job's code task, prompted as code RL prompts them (`code_rl.code_episode`: one worked
    example, `shot`, then the task), generated together with `batch_generator(seed, split, index)`, scored by
    `code_rows`. -> one row per job, in job order."""
    rollouts = generate_rollouts(policy, [code_episode(task, shot) for task in batch.prompts], sampling,
                                 max_new_tokens, max_tokens, batch_generator(seed, batch.split, batch.index))
    return code_rows(batch, rollouts, code)


def code_rows(batch: GenerationBatch, rollouts: Sequence, code: CodeConfig) -> list[dict]:
    """The rows of a code batch's completions (rollouts[i] answers job i): each program runs against its task's
    tests in the sandbox only and gets the composed code reward (`code_rl.score_completions` with the `code`
    config: reward_scale * gate * max(0, sum_c w_c c - w_length penalty)); success = every test passed; gold is
    empty (there is no answer to match exactly)."""
    breakdowns = score_completions(rollouts, list(batch.prompts), code)
    return [trajectory_row(task.task_id, batch.split, sample, rollout, breakdown.total, passes(breakdown), "")
            for task, sample, rollout, breakdown in zip(batch.prompts, batch.samples, rollouts, breakdowns,
                                                        strict=True)]

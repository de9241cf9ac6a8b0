"""The `ppo` stage refuses bad inputs with clear errors (tiny model). The stage end to end, its resume after
SIGKILL and its CLI options: tests/integration/test_ppo_stage.py."""

from __future__ import annotations

import pytest

from tasks.settings import load_config
from tests.ppo_helpers import write_keyword_dataset

TINY_PPO = [
    "model.spec=tiny", "tracking.enabled=false", "data.output_dir=data", "ppo.max_steps=4", "ppo.save_steps=1",
    "ppo.rollout_episodes=4", "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.epochs=2", "ppo.eval_steps=2",
    "ppo.eval_episodes=2", "ppo.max_new_tokens=3", "ppo.epsilon_mixture=0.2", "ppo.learning_rate=1e-3",
    "ppo.kl_control={kind: adaptive, target: 0.05, horizon: 100}",
]


def test_ppo_stage_refuses_bad_inputs_with_clear_errors(in_tmp):
    from icrl_core.errors import UserError
    from tasks.ppo import run

    with pytest.raises(UserError, match="build_dataset"):
        run(load_config(None, TINY_PPO, environ={}))
    write_keyword_dataset(in_tmp / "data", train=4, val=1)
    with pytest.raises(UserError, match="ppo.reward_model_path"):
        run(load_config(None, TINY_PPO + ["ppo.reward={kind: reward_model}"], environ={}))
    with pytest.raises(UserError, match="trainable"):
        run(load_config(None, TINY_PPO + ["model.adapter={kind: none}"], environ={}))

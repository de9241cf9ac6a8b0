"""Asynchronous stream rollouts (ppo.async_rollouts): the schedule of icrl_core/async_rollouts.py by hand and the
config's bad settings. The Ray actors on the tiny model (weights, lag bound, resume, the stage, exit 2):
tests/integration/test_async_rollouts.py."""

from __future__ import annotations

import pytest

from icrl_core.async_rollouts import behaviour_version, pending_steps, rollout_lag, steps_opened_by
from icrl_core.errors import ConfigError
from tasks.settings import load_config


@pytest.mark.parametrize("level", [0, 1, 3])
def test_every_step_is_opened_once_by_the_version_it_is_generated_with(level):
    max_steps = 7
    opened = {step: version for version in range(max_steps) for step in steps_opened_by(version, level, max_steps)}
    assert sorted(opened) == list(range(1, max_steps + 1))
    for step, version in opened.items():
        assert version == behaviour_version(step, level)
        assert rollout_lag(step, version) == min(step - 1, level)  # never above the bound
    if level == 0:
        assert all(version == step - 1 for step, version in opened.items())  # the synchronous order
    assert list(pending_steps(2, level, max_steps)) == list(range(3, min(3 + level, max_steps) + 1))


@pytest.mark.parametrize("override, message", [
    ("ppo.async_rollouts.enabled=true", "async_rollouts.enabled needs ppo.mode=stream"),
    ("ppo.async_rollouts.max_async_level=-1", "ppo.async_rollouts.max_async_level"),
    ("ppo.async_rollouts.actors=0", "ppo.async_rollouts.actors"),
    ("ppo.async_rollouts.transport=nfs", "'object_store' or 'file'"),
    ("ppo.async_rollouts.max_async_levle=1", "ppo.async_rollouts.max_async_levle: unknown key"),
])
def test_bad_async_settings_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, [override], environ={})

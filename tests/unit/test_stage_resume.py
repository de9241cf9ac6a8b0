"""What a stage's checkpoint folder is keyed by: it changes only with what the stage depends on. The kill -9
resume of `icrl stage bootstrap`: tests/integration/test_stage_resume.py."""

from __future__ import annotations


def test_checkpoint_key_changes_only_with_what_the_stage_depends_on():
    from tasks.runtime import checkpoint_dir_for
    from tasks.settings import PipelineConfig, with_overrides

    base = PipelineConfig()
    key = checkpoint_dir_for(base, "bootstrap")
    for unrelated in ({"icrl_eval.test_k": 7}, {"evaluate.workers": 2}, {"ppo.kl_beta": 0.5},
                      {"tracking.enabled": False}, {"ray.address": "127.0.0.1:6379"}):
        assert checkpoint_dir_for(with_overrides(base, unrelated), "bootstrap") == key, unrelated
    flipped_exemplars = not base.tokenize.train_exemplars
    for related in ({"bootstrap.learning_rate": 1.23e-4}, {"data.num_episodes": 7}, {"model.adapter.rank": 4},
                    {"seed": 3}, {"ray.num_workers": 2}, {"tokenize.train_exemplars": flipped_exemplars}):
        assert checkpoint_dir_for(with_overrides(base, related), "bootstrap") != key, related
    # a value set to its default is the default; a new field at its default leaves the key alone
    assert checkpoint_dir_for(with_overrides(base, {"bootstrap.replay.beta": 0.0}), "bootstrap") == key
    assert checkpoint_dir_for(with_overrides(base, {"bootstrap.replay.beta": 0.5}), "bootstrap") != key
    # ppo reads the bootstrap adapter, so a bootstrap change is a ppo change; the reverse is not.
    changed_bootstrap = with_overrides(base, {"bootstrap.max_steps": 3})
    assert checkpoint_dir_for(changed_bootstrap, "ppo") != checkpoint_dir_for(base, "ppo")

"""Test-time adaptation end to end: the `adapt` stage and the `icrl adapt` command leave the adapter on disk
untouched (tiny model). Its parts: tests/unit/test_adapt.py."""

from __future__ import annotations

import json

import pytest

from icrl_core.config import LoraAdapter, ModelConfig
from tasks.settings import load_config
from tests.ppo_helpers import write_keyword_dataset


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    from icrl_core.reward_model import load_reward_model, new_reward_model, save_reward_model

    folder = save_reward_model(tmp_path_factory.mktemp("rm") / "rm",
                               new_reward_model(ModelConfig(spec="tiny"), None, seed=2))
    return folder, load_reward_model(folder, ModelConfig(spec="tiny"))


def test_adapt_stage_and_cli_leave_the_adapter_on_disk_untouched(in_tmp, scorer, capsys):
    from icrl_core.io import sha256_folder
    from icrl_core.model import load_policy
    from tasks.adapt import run

    write_keyword_dataset(in_tmp / "data", train=2, val=3, k=3, n=1)
    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(), value_head=True)
    policy.save_adapter(in_tmp / "artifacts" / "ppo" / "adapter")
    digest = sha256_folder(in_tmp / "artifacts/ppo/adapter")
    overrides = ["model.spec=tiny", "tracking.enabled=false", "data.output_dir=data", "adapt.num_requests=2",
                 "adapt.num_rollouts=2", "adapt.steps=2", "adapt.max_new_tokens=3", "adapt.reward={kind: both}",
                 f"adapt.reward_model_path={scorer[0]}"]
    metrics = run(load_config(None, overrides, environ={}))
    assert metrics["num_requests"] == 2 and metrics["base_adapter_unchanged"] is True
    assert metrics["base_adapter"].endswith("artifacts/ppo/adapter")
    report = json.loads((in_tmp / "artifacts/adapt/report.json").read_text())
    assert [r["episode_id"] for r in report["requests"]] == ["val-1-0", "val-1-1"]
    assert report["summary"]["num_requests"] == 2  # the full record; metrics/adapt.json has the headline
    assert set(json.loads((in_tmp / "metrics/adapt.json").read_text())) == {"mean_reward_before", "mean_reward_after"}

    from tasks.cli import main

    args = ["adapt", "data/val.jsonl", "--episode-id", "val-1-2", "--output", "out.json"]
    for item in overrides:
        args += ["--set", item]
    with pytest.raises(SystemExit) as done:  # the real command, in this process (saves a model-loading start-up)
        main(args)
    printed = capsys.readouterr()
    assert done.value.code == 0, printed.err
    assert "reward before" in printed.out and "base adapter unchanged: True" in printed.out
    out = json.loads((in_tmp / "out.json").read_text())
    assert [r["episode_id"] for r in out["requests"]] == ["val-1-2"]
    assert sha256_folder(in_tmp / "artifacts/ppo/adapter") == digest
    with pytest.raises(SystemExit) as done:
        main(["adapt", "--episode-id", "nope", *args[4:]])
    assert done.value.code == 2 and "nope" in capsys.readouterr().err

"""DPO / IPO (icrl_core/dpo.py) on the tiny model: the margin is 0 where the policy is its reference;
policy_optimization picks the pipeline's stages. Training, resume and the stage: tests/integration/test_dpo.py."""

from __future__ import annotations

import pytest
import torch

from icrl_core.config import LoraAdapter
from icrl_core.dpo import answer_start, preference_margins
from icrl_core.model import load_policy
from icrl_core.supervised import Pair, episode_pairs
from tasks.settings import PipelineConfig, with_overrides
from tests.stage_helpers import keyword_rows


def _policy():
    return load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))


def test_answers_start_where_the_pair_differs_and_the_margin_starts_at_zero(tokens):
    assert answer_start(Pair([1, 2, 3, 9], [1, 2, 4, 9])) == 2
    assert answer_start(Pair([1, 2, 3], [1, 2, 3, 4])) == 2  # never the whole sequence
    train, _ = keyword_rows(tokens)
    pairs = episode_pairs(train)[:4]
    policy = _policy()  # LoRA B = 0: the policy is its reference
    assert torch.allclose(preference_margins(policy, pairs), torch.zeros(4), atol=1e-5)


def test_policy_optimization_picks_the_pipelines_stages(tmp_path):
    import shutil

    import yaml

    from icrl_core.errors import UserError
    from tasks.stages import pipeline_stages
    from tests.conftest import ROOT

    ppo = pipeline_stages("ppo", ROOT)
    # a project that chose dpo: evaluate (and promote) read the dpo adapter, so they follow dpo
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["policy_optimization"] = "dpo"
    params["evaluate"]["adapter"] = "artifacts/dpo/adapter"
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    dpo = pipeline_stages("dpo", tmp_path)
    assert "dpo" not in ppo and {"reward_model", "ppo", "adapt"} <= set(ppo)
    assert "dpo" in dpo and not {"reward_model", "ppo", "adapt"} & set(dpo)
    assert {"bootstrap", "evaluate", "promote"} <= set(dpo)
    with_overrides(PipelineConfig(), {"policy_optimization": "dpo", "evaluate.adapter": "artifacts/dpo/adapter"})
    with pytest.raises((UserError, ValueError), match="policy_optimization=dpo skips"):
        with_overrides(PipelineConfig(), {"policy_optimization": "dpo"})  # still evaluates artifacts/ppo/adapter

"""DPO / IPO (icrl_core/dpo.py) on the tiny model: the margin is 0 where the policy is its reference;
policy_optimization picks the pipeline's stages. Training, resume and the stage: tests/integration/test_dpo.py."""

from __future__ import annotations

import pytest
import torch

from icrl_core.config import LoraAdapter
from icrl_core.dpo import answer_logps, answer_start, preference_margins
from icrl_core.model import load_policy
from icrl_core.supervised import Pair, episode_pairs
from tasks.settings import PipelineConfig, with_overrides
from tests.stage_helpers import keyword_rows


def _policy():
    return load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))


def _start_adapter():
    """The tiny policy with LoRA weights away from 0 (a stand-in for the bootstrap adapter DPO starts from)."""
    policy = _policy()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=generator))
    return policy


def test_a_reference_frozen_at_the_start_adapter_stays_there_while_the_policy_trains(tokens):
    """dpo.reference=start: margins start at 0 from a non-zero adapter (against the base model they do not), the
    reference keeps the start weights after an update, a graph built before a reference pass still backpropagates,
    and the frozen copies are not trainable weights."""
    pairs = episode_pairs(keyword_rows(tokens)[0])[:4]
    policy = _start_adapter()
    assert preference_margins(policy, pairs).abs().max() > 1e-3  # reference = base model
    names = set(policy.trainable_state_dict())
    sequences, starts = [p.preferred for p in pairs], [answer_start(p) for p in pairs]
    with torch.no_grad():
        start_logps = answer_logps(policy, sequences, starts)
    policy.freeze_reference()
    assert set(policy.trainable_state_dict()) == names and len(policy.trainable_parameters()) == len(names)
    margins = preference_margins(policy, pairs)  # policy pass with a graph, then the reference pass
    assert torch.allclose(margins.detach(), torch.zeros(4), atol=1e-5)
    optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=0.05)
    (-margins.sum()).backward()
    optimizer.step()
    assert preference_margins(policy, pairs).sum() > 1e-3  # the policy moved ...
    with torch.no_grad(), policy.reference():
        assert torch.allclose(answer_logps(policy, sequences, starts), start_logps, atol=1e-6)  # ... its reference not


def test_a_reference_frozen_at_the_start_needs_lora():
    from icrl_core.config import LastBlocksAdapter
    from icrl_core.errors import UserError

    policy = load_policy("tiny", seed=0, adapter=LastBlocksAdapter(n_blocks=1))
    with pytest.raises(UserError, match="needs model.adapter.kind=lora"):
        policy.freeze_reference()


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


def test_shared_prefix_margins_and_gradients_equal_the_full_pass(tokens):
    """model.share_prefix: a pair's two sequences share their context, which then runs once per pair."""
    pairs = episode_pairs(keyword_rows(tokens)[0])[:4]
    policy = _start_adapter()

    def run(share: bool):
        policy.share_prefix = share
        try:
            for p in policy.trainable_parameters():
                p.grad = None
            margins = preference_margins(policy, pairs)
            margins.sum().backward()
        finally:
            policy.share_prefix = False
        return margins.detach(), [p.grad.clone() for p in policy.trainable_parameters()]

    (full, full_grads), (shared, shared_grads) = run(False), run(True)
    assert full.abs().max() > 1e-3 and torch.allclose(full, shared, atol=1e-5)
    for a, b in zip(full_grads, shared_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)

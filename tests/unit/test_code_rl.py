"""Code tasks as RL, the pure parts (icrl_core/code_rl.py): pass@k by hand, the per-level summary, group
advantages by hand and the code-mode config checks. With the sandbox and the model: tests/integration/test_code_rl.py."""

from __future__ import annotations

import math

import pytest
import torch

from icrl_core.code_rl import completion_advantages, pass_at_k, pass_at_k_summary
from icrl_core.config import PPOConfig
from icrl_core.errors import ConfigError
from tasks.settings import load_config

T = torch.tensor


# --------------------------------------------------------------------------------------------------------------
# pass@k


def test_pass_at_k_by_hand():
    # n = 5 samples, c = 2 pass: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10; pass@3 = 1 - C(3,3)/C(5,3)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    assert pass_at_k(5, 2, 4) == 1.0  # only 3 fail: any 4 hold a passing one
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    for bad in [(3, 4, 1), (3, 1, 4), (3, 1, 0)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_pass_at_k_summary_averages_tasks_per_level():
    rows = [{"level": 1, "n": 4, "c": 4, "mean_pass_fraction": 1.0, "mean_reward": 2.0},
            {"level": 1, "n": 4, "c": 1, "mean_pass_fraction": 0.5, "mean_reward": 1.0},
            {"level": 3, "n": 4, "c": 0, "mean_pass_fraction": 0.0, "mean_reward": 0.0}]
    table = pass_at_k_summary(rows, [1, 2])
    assert table["level_1"]["pass_at_1"] == pytest.approx((1 + 0.25) / 2)
    assert table["level_1"]["pass_at_2"] == pytest.approx((1 + (1 - math.comb(3, 2) / math.comb(4, 2))) / 2)
    assert table["level_3"] == {"tasks": 1, "pass_at_1": 0.0, "pass_at_2": 0.0, "mean_pass_fraction": 0.0,
                                "mean_reward": 0.0}
    assert table["overall"]["tasks"] == 3 and table["overall"]["pass_at_1"] == pytest.approx(1.25 / 3)


def test_group_advantages_by_hand():
    rewards = T([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    groups = T([0, 0, 0, 0, 1, 1, 1, 1])
    lengths = T([10, 20, 30, 40, 5, 5, 5, 5])

    def cfg(kind: str) -> PPOConfig:
        return PPOConfig(mode="code", objective={"kind": kind})

    std = math.sqrt(sum((r - 0.5) ** 2 for r in [1, 0, 0, 1]) / 3)  # unbiased, as TRL
    grpo = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4)]
    assert torch.allclose(completion_advantages(cfg("grpo"), rewards, groups, lengths),
                          T([grpo[0], grpo[1], grpo[1], grpo[0], 0, 0, 0, 0]))
    # RLOO: R_i - mean of the other three: 1 - 1/3, 0 - 2/3
    assert torch.allclose(completion_advantages(cfg("rloo"), rewards, groups, lengths),
                          T([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0]))
    assert torch.allclose(completion_advantages(cfg("dr_grpo"), rewards, groups, lengths),
                          T([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    # OPO: baseline = sum l R / sum l = (10 + 40) / 100
    assert torch.allclose(completion_advantages(cfg("opo"), rewards, groups, lengths),
                          T([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


def test_code_mode_config_is_checked():
    load_config(None, ["ppo.mode=code", "ppo.objective.kind=grpo"], environ={})
    with pytest.raises(ConfigError, match=r"needs ppo.code.group_size >= 2"):
        load_config(None, ["ppo.mode=code", "ppo.objective.kind=rloo", "ppo.code.group_size=1"], environ={})
    with pytest.raises(ConfigError, match=r"code rollouts are rewarded by the code.reward components"):
        load_config(None, ["ppo.mode=code", "ppo.reward={kind: both}"], environ={})
    with pytest.raises(ConfigError, match=r"k=\[8\] needs at least that many samples"):
        load_config(None, ["code.eval.samples=4", "code.eval.k=[1, 8]"], environ={})
    assert load_config(None, ["code.eval.samples=6"], environ={}).code.eval.ks == [1, 2, 4, 6]

"""The in-context RL protocol on the real SmolLM2-135M and real data: reuse == recompute. The protocol's parts:
tests/unit/test_icrl_eval.py."""

from __future__ import annotations

import numpy as np
import pytest

from icrl_core.config import EvalConfig
from icrl_core.task_data import load_task
from tests.unit.test_icrl_eval import _deterministic, _run


@pytest.mark.real_model
def test_reuse_equals_recompute_on_real_text_with_smollm2(smollm2, tasks_dir):
    """The real model on real data: reuse and full recompute make the same predictions (fp32)."""
    task = load_task("trec_coarse", tasks_dir)
    cfg = EvalConfig(task="trec_coarse", strategy="naive", train_k=4, test_every=2, test_k=4)
    fast = _run(smollm2, task, cfg, reuse=True)
    slow = _run(smollm2, task, cfg, reuse=False)
    assert _deterministic(fast[0]) == _deterministic(slow[0])
    assert _deterministic(fast[1]) == _deterministic(slow[1])
    probs_fast = [s["prob"] for s in fast[0]]
    probs_slow = [s["prob"] for s in slow[0]]
    assert np.allclose(probs_fast, probs_slow, atol=1e-4)
    assert sum(s["tokens_computed"] for s in fast[0]) < sum(s["tokens_computed"] for s in slow[0])

"""experiments/icrl_stream_rl/test_sharpness.py: a test step's sampled, expected and argmax accuracies and the split
by whether a query's gold label has an episode in the context (hand-computed values)."""

from __future__ import annotations

import importlib.util

import pytest

from icrl_core.errors import UserError
from tests.conftest import ROOT


def _module():
    spec = importlib.util.spec_from_file_location("test_sharpness", ROOT / "experiments" / "icrl_stream_rl" /
                                                  "test_sharpness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sharpness_row_by_hand():
    row = _module().sharpness_row(p_gold=[0.9, 0.5, 0.02, 0.0], argmax_right=[True, True, False, False],
                                  sampled_accuracy=0.5, gold_absent=[False, False, True, True],
                                  p_absent=[0.0, 0.1, 0.02, 0.0])
    assert row["expected_accuracy"] == pytest.approx(0.355)
    assert row["argmax_accuracy"] == 0.5 and row["sampled_accuracy"] == 0.5
    assert row["absent_share"] == 0.5
    assert row["expected_accuracy_present"] == pytest.approx(0.7)
    assert row["expected_accuracy_absent"] == pytest.approx(0.01)
    assert row["mass_on_absent_labels"] == pytest.approx(0.03)


def test_sharpness_row_refuses_mismatched_lengths():
    with pytest.raises(UserError):
        _module().sharpness_row([0.5], [True, False], 0.5, [False], [0.0])

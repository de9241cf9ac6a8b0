"""The code-task family: size, determinism, split by template, every template's reference passing its hidden tests
in the sandbox, the reward's pure components. `icrl tasks` listing it: tests/integration/test_code_tasks.py."""

from __future__ import annotations

import pytest

from icrl_core.code_reward import (
    CodeConfig,
    CodeRewardConfig,
    HarnessReport,
    complexity_score,
    compose,
    cyclomatic_complexity,
    docstring_score,
    extract_code,
    length_penalty,
    lint_findings,
    score_many,
    time_efficiency,
)
from icrl_core.code_tasks import TEST_TEMPLATES, code_tasks, split_tasks, summary


def test_at_least_300_tasks_at_three_levels_and_four_families():
    tasks = code_tasks()
    assert len(tasks) >= 300
    assert len({t.task_id for t in tasks}) == len(tasks)
    assert len({(t.template, t.name) for t in tasks}) == len(tasks)  # distinct variants
    assert {t.level for t in tasks} == {1, 2, 3}
    assert {t.family for t in tasks} == {"string", "list", "arithmetic", "dict"}
    assert all(len(t.tests) == 6 for t in tasks)
    assert summary().tasks == len(tasks)


def test_same_seed_same_tasks_other_seed_other_tasks():
    assert code_tasks(0) == code_tasks.__wrapped__(0, 11)
    assert [t.tests for t in code_tasks(0)] != [t.tests for t in code_tasks(1)]


def test_the_split_is_by_template():
    train, test = split_tasks("train"), split_tasks("test")
    assert {t.template for t in train}.isdisjoint({t.template for t in test})
    assert {t.template for t in test} == TEST_TEMPLATES
    assert {t.level for t in test} == {1, 2, 3}
    assert len(train) + len(test) == len(code_tasks())


def test_every_templates_reference_passes_its_hidden_tests_in_the_sandbox():
    one_per_template = list({t.template: t for t in code_tasks()}.values())
    breakdowns = score_many([t.reference for t in one_per_template], one_per_template, CodeConfig())
    failed = [(t.task_id, b.reason) for t, b in zip(one_per_template, breakdowns) if b.tests_passed != 6]
    assert failed == []
    assert all(b.components["docstring"] == 1.0 and b.components["length_penalty"] == 0.0 for b in breakdowns)


def test_reward_components_are_pure_functions():
    task = code_tasks()[0]
    fast = HarnessReport(passed=[True] * 6, seconds=[0.001] * 6)
    slow = HarnessReport(passed=[True] * 6, seconds=[1.0] * 6)
    assert time_efficiency(fast, task.time_budget_ms) == pytest.approx(1 - 6 / task.time_budget_ms)
    assert time_efficiency(slow, task.time_budget_ms) == 0.0
    assert time_efficiency(HarnessReport(passed=[True, False], seconds=[0, 0]), 50) == 0.0
    assert docstring_score(task.reference, task.name) == 1.0
    assert docstring_score("def f(:", task.name) == 0.0
    branchy = f"def {task.name}(x):\n" + "".join(f"    if x == {i}:\n        return {i}\n" for i in range(9)) + \
        "    return x\n"
    assert cyclomatic_complexity(branchy, task.name) == 10
    assert complexity_score(branchy, task.name, target=5) == 0.5
    assert length_penalty(task.reference, task.reference, 3.0) == 0.0
    assert length_penalty(task.reference * 6, task.reference, 3.0) == 1.0
    assert lint_findings([task.reference, "import os\n", "x = undefined_name\n"], ["E", "F", "W"], ["E501"]) == \
        [0, 1, 1]
    weights = CodeRewardConfig(reward_scale=2.0)
    components = {"pass_fraction": 0.5, "all_pass": 0.0, "lint": 1.0}
    assert compose(components, 0.0, True, weights) == pytest.approx(2.0 * (0.5 + 0.1))
    assert compose(components, 0.0, False, weights) == 0.0
    assert compose({"pass_fraction": 0.01}, 1.0, True, weights) == 0.0  # never below 0


def test_extract_code_from_a_completion():
    task = code_tasks()[0]
    body = f"    return x + {task.name.split('_')[1]}\n"
    fenced = f"Here it is:\n```python\n{task.prompt}{body}```\nDone."
    assert extract_code(fenced, task) == task.prompt + body
    assert extract_code(body, task) == task.prompt + body  # a bare body gets the signature

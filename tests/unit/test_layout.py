"""The test suite's two tiers: tests/unit (`make test-fast`, under 2 minutes) and tests/integration (services,
console scripts, the real model, the sandbox, multi-process and long training runs); `make test` runs both.
Every test module sits in one tier, and the unit tier keeps out of what makes the other slow."""

from __future__ import annotations

import ast

from tests.conftest import ROOT

TESTS = ROOT / "tests"
TIERS = (TESTS / "unit", TESTS / "integration")


def test_every_test_module_is_in_a_tier():
    stray = sorted(path.relative_to(ROOT).as_posix() for path in TESTS.rglob("test_*.py") if path.parent not in TIERS)
    assert stray == [], f"move these into tests/unit or tests/integration: {stray}"


def test_unit_tests_start_no_console_script_real_model_or_service():
    for path in sorted((TESTS / "unit").glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    for alias in node.names}
        imported |= {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                     for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & {"run_cli", "own_ray_train_workers", "a_ray_train_worker_killed_after", "ray", "mlflow", "prefect", "dvc"}, path.name
        fixtures = {arg.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) for arg in node.args.args}
        assert "smollm2" not in fixtures, f"{path.name}: the real model belongs in tests/integration"
        marks = {ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        assert not marks & {"pytest.mark.integration", "pytest.mark.real_model"}, path.name

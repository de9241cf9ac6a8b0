"""icrl_core is a pure library: importing all of it pulls in no orchestration package."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_icrl_core_imports_no_orchestration_package():
    modules = sorted(p.stem for p in (ROOT / "icrl_core").glob("*.py") if p.stem != "__init__")
    code = (
        "import sys, importlib\n"
        f"for m in {modules!r}: importlib.import_module('icrl_core.' + m)\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'prefect', 'ray', 'mlflow', 'dvc'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"icrl_core imported: {out.stdout}"
    for path in (ROOT / "icrl_core").rglob("*.py"):
        text = path.read_text()
        for pkg in ("prefect", "ray", "mlflow", "dvc"):
            assert f"import {pkg}" not in text and f"from {pkg}" not in text, (path, pkg)



def test_cli_and_config_import_no_heavy_library():
    """`icrl --help`, reading and validating a config and a user error's message do not wait for torch,
    transformers or the orchestration packages (seconds of imports each): those load inside the commands."""
    code = (
        "import sys\n"
        "from tasks.cli import app\n"
        "from tasks.settings import load_config\n"
        "load_config('params.yaml')\n"
        "heavy = {'torch', 'transformers', 'peft', 'prefect', 'ray', 'mlflow', 'dvc', 'vllm'}\n"
        "print(','.join(sorted({m.split('.')[0] for m in sys.modules} & heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported: {out.stdout}"

def project_imports() -> dict[str, set[str]]:
    """Each project module (icrl_core, tasks, flows) -> the project modules it imports, at the top or inside a
    function (a deferred import still ties the two modules together)."""
    import ast

    modules = {".".join(path.relative_to(ROOT).with_suffix("").parts): path
               for package in ("icrl_core", "tasks", "flows") for path in (ROOT / package).rglob("*.py")
               if path.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {module for module in found if module in modules and module != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def test_cycle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_project_modules_import_no_circle():
    """A circle (even through an import inside a function) means neither module can be understood, tested or
    moved without the other: the lower one must not know the upper one."""
    assert import_cycles(project_imports()) == []

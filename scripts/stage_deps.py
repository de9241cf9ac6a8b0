"""The code deps of every dvc.yaml stage: the stage module tasks/NAME.py and every module of icrl_core/ and tasks/
it imports, directly or not (any import statement, also those inside functions), found with `ast`. So a code
change reruns exactly the stages whose code it touches.

    python scripts/stage_deps.py --check    exit 1 (listing the differences) when dvc.yaml is not current
    python scripts/stage_deps.py --write    rewrite the code deps of dvc.yaml (comments and other deps are kept)

Only the `.py` deps under icrl_core/ and tasks/ are managed; data deps (artifacts, metrics) are left as written.
Package `__init__.py` files are empty and not listed.
"""

from __future__ import annotations

import argparse
import ast
import sys
from io import StringIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("icrl_core", "tasks")


def _module_file(name: str, root: Path) -> Path | None:
    parts = name.split(".")
    if parts[0] not in PACKAGES:
        return None
    path = root.joinpath(*parts).with_suffix(".py")
    return path if path.is_file() else None


def imported_modules(path: Path, root: Path = ROOT) -> set[Path]:
    """The project modules one file imports (anywhere in it)."""
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from tasks import evaluate` imports a module; `from tasks.evaluate import gates` a name of one
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            module = _module_file(name, root)
            if module is not None:
                found.add(module)
    return found


def code_deps(stage: str, root: Path = ROOT) -> list[str]:
    """tasks/STAGE.py and its transitive project imports, as sorted paths relative to `root`."""
    start = root / "tasks" / f"{stage}.py"
    seen: set[Path] = set()
    todo = [start]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(imported_modules(path, root) - seen)
    return sorted(str(p.relative_to(root)) for p in seen)


def _is_code(dep: str) -> bool:
    return dep.endswith(".py") and dep.split("/")[0] in PACKAGES


def expected_deps(stage: str, current: list[str], root: Path = ROOT) -> list[str]:
    """The stage's data deps as written, then its code deps."""
    return [d for d in current if not _is_code(d)] + code_deps(stage, root)


def _yaml():
    from ruamel.yaml import YAML

    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.width = 120
    yaml.indent(mapping=2, sequence=4, offset=2)
    return yaml


def differences(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """stage -> {"missing": [...], "extra": [...]} for every stage whose deps are not current."""
    import yaml

    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    out = {}
    for name, spec in stages.items():
        current = [str(d) for d in spec.get("deps") or []]
        expected = expected_deps(name, current, root)
        missing, extra = sorted(set(expected) - set(current)), sorted(set(current) - set(expected))
        if missing or extra:
            out[name] = {"missing": missing, "extra": extra}
    return out


def write(root: Path = ROOT) -> list[str]:
    """Rewrite the code deps of dvc.yaml; return the stages that changed."""
    from ruamel.yaml.comments import CommentedSeq

    yaml = _yaml()
    path = root / "dvc.yaml"
    data = yaml.load(path.read_text())
    changed = []
    for name, spec in data["stages"].items():
        current = [str(d) for d in spec.get("deps") or []]
        expected = expected_deps(name, current, root)
        if expected != current:
            deps = spec.get("deps")
            if deps is None:
                spec["deps"] = deps = CommentedSeq()
            deps[:] = expected
            changed.append(name)
    if changed:
        buffer = StringIO()
        yaml.dump(data, buffer)
        path.write_text(buffer.getvalue())
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when dvc.yaml's code deps are not current")
    mode.add_argument("--write", action="store_true", help="rewrite dvc.yaml's code deps")
    args = parser.parse_args(argv)
    if args.write:
        changed = write()
        print(f"dvc.yaml: code deps of {', '.join(changed)} rewritten" if changed else "dvc.yaml is current")
        return 0
    diff = differences()
    for stage, change in diff.items():
        for dep in change["missing"]:
            print(f"{stage}: missing dep {dep}")
        for dep in change["extra"]:
            print(f"{stage}: dep {dep} is not imported by the stage")
    if diff:
        print("run `python scripts/stage_deps.py --write`")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())

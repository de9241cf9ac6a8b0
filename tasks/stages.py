"""The stage graph, read from dvc.yaml: the one declaration of the pipeline's stages, their order, deps, params,
outs and metrics. Everything else (the checkpoint keys of tasks/runtime.py, `icrl stage NAME`, the Prefect
pipeline flow, the tests) reads it from here instead of keeping its own list.

A stage NAME runs `icrl stage NAME`, i.e. `run(config)` of the module tasks/NAME.py. Its upstream stages are the
ones whose outs its deps name (the same folder, or a file or folder inside it): DVC derives its DAG the same way.
Deps may use DVC's templating (`${evaluate.adapter}`), resolved from params.yaml beside dvc.yaml as DVC does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from icrl_core.errors import UserError

DVC_FILE = "dvc.yaml"
PARAMS_FILE = "params.yaml"
SOURCE_ROOT = Path(__file__).resolve().parents[1]  # the checkout: its dvc.yaml when the working folder has none

_TEMPLATE = re.compile(r"\$\{\s*([A-Za-z0-9_.]+)\s*\}")


@dataclass(frozen=True)
class Stage:
    name: str
    cmd: str
    deps: tuple[str, ...]       # templates resolved
    params: tuple[str, ...]     # dotted keys of params.yaml (a section or one value)
    outs: tuple[str, ...]       # cached outputs (folders or files)
    metrics: tuple[str, ...]    # the stage's DVC metrics files
    upstream: tuple[str, ...]   # stages whose outs (or metrics) its deps name, in pipeline order

    @property
    def module(self) -> str:
        """The module whose `run(config)` is the stage (`icrl stage NAME`)."""
        return f"tasks.{self.name}"


def project_dvc_file(project: Path | str | None = None) -> Path:
    """dvc.yaml of `project`, else of the working folder, else of this checkout."""
    if project is not None:
        return Path(project) / DVC_FILE
    local = Path.cwd() / DVC_FILE
    return local if local.exists() else SOURCE_ROOT / DVC_FILE


def load_stages(project: Path | str | None = None) -> dict[str, Stage]:
    """The stages of dvc.yaml in their declared order (which is also a valid execution order: checked)."""
    path = project_dvc_file(project).resolve()
    try:
        stamp = path.stat().st_mtime_ns
    except FileNotFoundError:
        raise UserError(f"{path}: not found (run in the project folder)") from None
    params = path.parent / PARAMS_FILE
    params_stamp = params.stat().st_mtime_ns if params.exists() else None
    return dict(_load(str(path), stamp, params_stamp))


def stage_names(project: Path | str | None = None) -> list[str]:
    return list(load_stages(project))


def check_stage_names(names, project: Path | str | None = None) -> None:
    """A UserError (exit 2) naming the first of `names` that is not a stage of dvc.yaml."""
    known = stage_names(project)
    for name in names:
        if name not in known:
            raise UserError(f"unknown stage '{name}'; the stages of dvc.yaml are {', '.join(known)}")


def _entries(items) -> list[str]:
    """A dvc.yaml list whose items are paths or {path: options}."""
    out = []
    for item in items or []:
        out.extend(item if isinstance(item, dict) else [item])
    return [str(x) for x in out]


def _lookup(tree: dict, dotted: str):
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def resolve_template(text: str, params: dict) -> str:
    """`${key}` replaced by params.yaml's value, as DVC does; an unknown key is left as it is."""
    def value(match: re.Match) -> str:
        found = _lookup(params, match.group(1))
        return match.group(0) if found is None or isinstance(found, (dict, list)) else str(found)

    return _TEMPLATE.sub(value, text)


def _inside(path: str, folder: str) -> bool:
    path, folder = path.rstrip("/"), folder.rstrip("/")
    return path == folder or path.startswith(folder + "/")


@lru_cache(maxsize=8)
def _load(path: str, _stamp: int, _params_stamp: int | None) -> tuple[tuple[str, Stage], ...]:
    import yaml

    dvc_file = Path(path)
    try:
        stages = (yaml.safe_load(dvc_file.read_text()) or {}).get("stages") or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{dvc_file}: not valid YAML: {exc}") from None
    params_file = dvc_file.parent / PARAMS_FILE
    params = (yaml.safe_load(params_file.read_text()) or {}) if params_file.exists() else {}
    produced: dict[str, str] = {}  # out or metrics path -> stage
    parsed: list[tuple[str, dict]] = []
    for name, spec in stages.items():
        spec = spec or {}
        for out in _entries(spec.get("outs")) + _entries(spec.get("metrics")):
            produced[resolve_template(out, params)] = name
        parsed.append((name, spec))
    result, seen = [], set()
    for name, spec in parsed:
        deps = tuple(resolve_template(d, params) for d in _entries(spec.get("deps")))
        upstream = {stage for dep in deps for out, stage in produced.items()
                    if stage != name and (_inside(dep, out) or _inside(out, dep))}
        late = upstream - seen
        if late:
            raise UserError(f"{dvc_file}: stage '{name}' reads outputs of {sorted(late)}, declared after it; "
                            "list the stages in execution order")
        seen.add(name)
        result.append((name, Stage(
            name=name, cmd=str(spec.get("cmd", "")), deps=deps,
            params=tuple(_entries(spec.get("params"))),
            outs=tuple(resolve_template(o, params) for o in _entries(spec.get("outs"))),
            metrics=tuple(resolve_template(m, params) for m in _entries(spec.get("metrics"))),
            upstream=tuple(s for s, _ in result if s in upstream),
        )))
    return tuple(result)


def upstream_closure(stage: str, project: Path | str | None = None) -> list[str]:
    """`stage` and every stage it reads from, directly or not, in pipeline order."""
    stages = load_stages(project)
    if stage not in stages:
        raise UserError(f"unknown stage '{stage}'; stages are {', '.join(stages)}")
    todo, seen = [stage], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(stages[name].upstream)
    return [name for name in stages if name in seen]


# The two ways to train the policy after the bootstrap (config `policy_optimization`): the stages of each branch.
POLICY_OPTIMIZATION = {"ppo": ("reward_model", "ppo"), "dpo": ("dpo",)}


# Stages a pipeline run executes only when asked to (config critic_in_pipeline): the in-context critic's.
CRITIC_STAGES = ("critic_data", "critic", "critic_distill")


def pipeline_stages(policy_optimization: str, project: Path | str | None = None, critic: bool = False) -> list[str]:
    """The stages a pipeline run executes, in order: all of dvc.yaml's but the other branches' stages and the
    stages that read their outputs (e.g. adapt, which adapts the PPO adapter, under dpo), and without the critic's
    stages unless `critic`."""
    stages = load_stages(project)
    skipped = {name for choice, names in POLICY_OPTIMIZATION.items() if choice != policy_optimization
               for name in names if name in stages}
    if not critic:
        skipped |= {name for name in CRITIC_STAGES if name in stages}
    for name, stage in stages.items():  # pipeline order: upstream stages come first
        if skipped & set(stage.upstream):
            skipped.add(name)
    return [name for name in stages if name not in skipped]

"""The stage graph comes from dvc.yaml alone (tasks/stages.py)."""

from __future__ import annotations

import importlib

import pytest

from icrl_core.errors import UserError
from tasks.stages import load_stages, stage_names, upstream_closure
from tests.conftest import ROOT


def test_the_stages_of_dvc_yaml_each_run_their_module():
    stages = load_stages(ROOT)
    assert list(stages) == stage_names(ROOT)
    for name, stage in stages.items():
        assert stage.cmd == f"icrl stage {name}", name
        assert callable(importlib.import_module(stage.module).run), name


def test_upstream_stages_are_derived_from_the_outs_each_stage_reads():
    stages = load_stages(ROOT)
    assert stages["build_dataset"].upstream == ()
    assert stages["tokenize"].upstream == ("build_dataset",)
    assert stages["reward_model"].upstream == ("tokenize", "bootstrap")
    assert stages["ppo"].upstream == ("build_dataset", "bootstrap", "reward_model")
    assert upstream_closure("ppo", ROOT) == ["build_dataset", "tokenize", "bootstrap", "reward_model", "ppo"]
    # a dep inside another stage's out (a weights subfolder) is an edge too; ${...} is resolved from params.yaml
    assert "ppo" in stages["evaluate"].upstream


def _project(tmp_path, stages: str, params: str = "a: {path: out/x}\n"):
    (tmp_path / "dvc.yaml").write_text(stages)
    (tmp_path / "params.yaml").write_text(params)
    return tmp_path


def test_templated_deps_resolve_from_params_yaml(tmp_path):
    project = _project(tmp_path, "stages:\n  one: {cmd: a, outs: [out]}\n"
                                 "  two: {cmd: b, deps: ['${a.path}/w'], params: [a]}\n")
    stages = load_stages(project)
    assert stages["two"].deps == ("out/x/w",) and stages["two"].upstream == ("one",)
    # an edit of params.yaml is seen at once (the loader caches on both files' mtimes)
    import os

    (project / "params.yaml").write_text("a: {path: elsewhere}\n")
    os.utime(project / "params.yaml", ns=(1, 1))
    assert load_stages(project)["two"].upstream == ()


def test_a_stage_declared_before_what_it_reads_is_refused(tmp_path):
    project = _project(tmp_path, "stages:\n  two: {cmd: b, deps: [out]}\n  one: {cmd: a, outs: [out]}\n")
    with pytest.raises(UserError, match="declared after it"):
        load_stages(project)
    with pytest.raises(UserError, match="unknown stage"):
        upstream_closure("three", _project(tmp_path, "stages:\n  one: {cmd: a}\n"))


def _stage_deps_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("stage_deps", ROOT / "scripts" / "stage_deps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dvc_yaml_code_deps_are_the_stage_modules_transitive_imports():
    stage_deps = _stage_deps_script()
    assert stage_deps.differences() == {}, "run `python scripts/stage_deps.py --write`"
    evaluate = stage_deps.code_deps("evaluate")
    for module in ("general_ability", "choice_probe", "feedback_probe", "model", "task_data", "prompting", "chat"):
        assert f"icrl_core/{module}.py" in evaluate, module
    assert {"icrl_core/model.py", "icrl_core/reward_model.py", "icrl_core/episodes.py"} <= set(
        stage_deps.code_deps("ppo"))


def test_stage_deps_finds_imports_inside_functions_and_rewrites_only_code_deps(tmp_path):
    stage_deps = _stage_deps_script()
    (tmp_path / "tasks").mkdir()
    (tmp_path / "icrl_core").mkdir()
    (tmp_path / "tasks" / "one.py").write_text("def run(config):\n    from tasks import helper\n")
    (tmp_path / "tasks" / "helper.py").write_text("import json\nfrom icrl_core.lib import thing\n")
    (tmp_path / "icrl_core" / "lib.py").write_text("thing = 1\n")
    (tmp_path / "icrl_core" / "unused.py").write_text("")
    (tmp_path / "dvc.yaml").write_text("stages:\n  one:\n    cmd: icrl stage one  # kept\n    deps:\n"
                                       "      - data/in\n      - icrl_core/unused.py\n")
    assert stage_deps.differences(tmp_path) == {"one": {
        "missing": ["icrl_core/lib.py", "tasks/helper.py", "tasks/one.py"], "extra": ["icrl_core/unused.py"]}}
    assert stage_deps.write(tmp_path) == ["one"] and stage_deps.differences(tmp_path) == {}
    text = (tmp_path / "dvc.yaml").read_text()
    assert "# kept" in text and text.index("data/in") < text.index("icrl_core/lib.py")

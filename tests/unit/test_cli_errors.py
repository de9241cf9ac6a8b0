"""Every command of the `icrl` CLI turns every bad value into one message and exit code 2, never a traceback.

The commands and their parameters are enumerated from the typer app, so a new command or option is walked too:
an unknown option for every command and group; for every numeric or choice parameter a value of the wrong type
and values outside its bounds; for every path parameter a missing path, a directory where a file is expected, a
file where a folder is expected, and a file that is not UTF-8; for every `--set` an unknown key and an item
without `=`. The walk runs in-process (`tasks.cli.main`); the issue's examples through the real console script:
tests/integration/test_cli_errors.py."""

from __future__ import annotations

import enum
import types
import typing
from pathlib import Path

import pytest
import typer.main
from typer.core import TyperGroup

from tasks.cli import app
from tests.conftest import call_cli

# Path parameters a command reads itself (config layers, the metrics file of `promote`): no parse-time check, the
# command's reader (icrl_core.io.read_user_text) names the problem.
READ_BY_COMMAND = {"params", "experiment", "metric_file"}
NOT_UTF8 = b"seed: 1 # caf\xe9 \xff\n"


def commands():
    """(argv prefix, click command) of every group and command, depth first."""
    def walk(command, path):
        yield path, command
        if isinstance(command, TyperGroup):
            for name, sub in command.commands.items():
                yield from walk(sub, path + [name])

    return list(walk(typer.main.get_command(app), []))


def leaf_commands():
    return [(path, command) for path, command in commands() if not isinstance(command, TyperGroup)]


def _scalar(annotation):
    """The element type of an annotation (list[Path] -> Path, Optional[int] or int | None -> int)."""
    while typing.get_origin(annotation) in (list, typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def path_kind(param) -> str:
    """What a path parameter names, from its declared checks (tasks/cli_common.py INPUT_FILE etc.)."""
    info = param.type_descriptor.parameter_info
    if param.name in READ_BY_COMMAND or (info.exists and not info.dir_okay):
        return "input_file"
    if info.exists and not info.file_okay:
        return "input_folder"
    if info.exists:
        return "input_path"
    if not info.dir_okay:
        return "output_file"
    if not info.file_okay:
        return "output_folder"
    raise AssertionError(f"path parameter '{param.name}' declares none of INPUT_FILE, INPUT_FOLDER, INPUT_PATH, "
                         "OUTPUT_FILE, OUTPUT_FOLDER (tasks/cli_common.py), nor is it read by its command")


def bad_values(param, tmp: Path) -> list[str]:
    """Values of `param` a user can get wrong."""
    kind = _scalar(param.type_descriptor.annotation)
    info = param.type_descriptor.parameter_info
    if param.name == "overrides":
        return ["no_such_section.key=1", "ppo.kl_beta"]
    if kind in (int, float):
        values = ["bogus"]
        if info.min is not None:
            values.append(str(info.min - 1))
        if info.max is not None:
            values.append(str(info.max + 1))
        return values
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return ["bogus"]
    if kind is Path:
        missing, directory, not_utf8 = tmp / "missing", tmp / "a-directory", tmp / "not-utf8.txt"
        return {"input_file": [missing, directory, not_utf8], "input_folder": [missing, not_utf8], "input_path": [missing],
                "output_file": [directory], "output_folder": [not_utf8]}[path_kind(param)]
    return []  # free text and flags: any value parses (commands check the meaning: `icrl eval --task bogus`)


# Free-text parameters whose value a command checks before anything else: a valid value for the walk.
VALID_TEXT = {"stage": "build_dataset"}


def valid_value(param, tmp: Path, command: str = "") -> str:
    if param.name == "name" and command in VALID_TEXT:
        return VALID_TEXT[command]
    kind = _scalar(param.type_descriptor.annotation)
    info = param.type_descriptor.parameter_info
    if kind is int:
        return str(max(info.min or 1, 1))
    if kind is float:
        return str(info.min if info.min is not None else 0.5)
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return next(iter(kind)).value
    if kind is Path:
        return str(tmp / ("a-directory" if path_kind(param).endswith(("folder", "path")) else "valid.txt"))
    return "x"


def call(argv: list[str]) -> tuple[int, str]:
    done = call_cli(*argv, cwd=Path.cwd())
    return done.returncode, done.stderr


def walk_cases(tmp: Path):
    for path, command in leaf_commands():
        for param in command.params:
            for value in bad_values(param, tmp):
                others = [p for p in command.params if p.required and p is not param]
                argv = list(path)
                if param.param_type_name == "option":  # the bad one first: click checks in command-line order
                    argv += [param.opts[0], str(value)]
                argv += [tok for p in others if p.param_type_name == "option"
                         for tok in (p.opts[0], valid_value(p, tmp, path[-1]))]
                argv += [str(value) if p is param else valid_value(p, tmp, path[-1]) for p in command.params
                         if p.param_type_name == "argument" and (p.required or p is param)]
                yield param, str(value), argv


def test_every_command_exits_2_with_one_message_on_every_bad_value(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no params.yaml here: the built-in defaults
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "not-utf8.txt").write_bytes(NOT_UTF8)
    (tmp_path / "valid.txt").write_text("x\n")
    walked = set()
    for param, value, argv in walk_cases(tmp_path):
        code, err = call(argv)
        assert code == 2, (argv, code, err)
        assert "Traceback" not in err and err.strip(), (argv, err)
        names = [*param.opts, param.name, value, value.split("=")[0].split(".")[0]]
        assert any(name in err for name in names), (argv, err)  # the message is about this value
        walked.add(argv[0])
    assert walked >= {"eval", "stage", "validate-episodes", "pipeline", "up", "config", "model"}, walked


@pytest.mark.parametrize("path", [path for path, _ in commands()], ids=lambda p: " ".join(p) or "icrl")
def test_an_unknown_option_exits_2(path):
    code, err = call([*path, "--no-such-option", "x"])
    assert code == 2 and "No such option: --no-such-option" in err and "Traceback" not in err, err


def test_free_text_values_a_command_checks(tmp_path, monkeypatch):
    """Values any text parses as (task, model, strategy target, a folder that exists but is the wrong kind): the
    command names the problem, exit 2; a failed `icrl eval` leaves no run folder behind that would need --resume."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    fast = ["--model", "tiny", "--no-tracking", "--train-k", "1", "--test-k", "1"]
    cases = {
        ("eval", "--task", "bogus", *fast): "unknown task 'bogus'",
        ("eval", "--task", "./empty", *fast): "empty/labels.txt: label list not found",
        ("eval", "--model", "bogus-model", "--no-tracking"): "unknown model spec 'bogus-model'",
        ("eval", "--adapter", "empty", *fast): "empty: not a saved adapter",
        ("eval", "--strategy", "icl", "--icrl", *fast): "cannot run with icrl_eval.icrl=true",
        ("eval", "--run-name", "../elsewhere", *fast): "'../elsewhere' is not a folder name",
        ("config", "show", "--set", "icrl_eval.strategy=random_biased_start"): "or the paper's 'random_biased_end'",
        ("max-examples", "--task", "bogus"): "unknown task 'bogus'",
        ("probe-feedback", "--task", "keyword_map", "--target", "bogus", "--model", "tiny"): "not a label of task",
        ("inspect", "empty"): "is it an icrl eval run folder?",
        ("model", "interpolate", "empty", "--scale", "0.5", "--output", "out"): "not a trained adapter folder",
        ("model", "extrapolate", "empty", "empty", "--scale", "2", "--output", "out"): "start empty: no saved adapter",
        ("model", "combine", "empty", "empty", "--weight", "0.5", "--weight", "0.5", "--output", "out"):
            "adapter 1 empty: no saved adapter",
        ("tasks", "./empty"): "label list not found",
        ("pipeline", "--stage", "bogus"): "unknown stage 'bogus'",
    }
    for argv, message in cases.items():
        code, err = call(list(argv))
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "artifacts" / "icrl_eval").exists() or not any((tmp_path / "artifacts" / "icrl_eval"
                                                                             ).iterdir())

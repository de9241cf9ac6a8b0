"""Options and helpers shared by every CLI module (no heavy imports)."""

from pathlib import Path
from typing import Annotated

import typer

DEFAULT_PARAMS = Path("params.yaml")

# What a path option or argument names, checked when the command line is parsed (a bad one exits 2 naming it):
# `typer.Option(help=..., **INPUT_FOLDER)`. Files a command reads are read with icrl_core.io.read_user_text.
INPUT_FILE = {"exists": True, "dir_okay": False}
INPUT_FOLDER = {"exists": True, "file_okay": False}
INPUT_PATH = {"exists": True}  # a file or a folder
OUTPUT_FILE = {"dir_okay": False}
OUTPUT_FOLDER = {"file_okay": False}

ParamsOpt = Annotated[
    list[Path] | None,
    typer.Option("--config", "-c", "--params", "-p", help="YAML config file of sections and/or dotted keys; repeat "
                 "to layer several, later files win (`@FILE` is short for `-c FILE`). Default: ./params.yaml if "
                 "it exists, else built-in defaults. ICRL_* environment variables and --set apply on top.",
                 show_default=False),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override one config key, e.g. --set ppo.kl_beta=0.02 (repeatable; values "
                 "are YAML).", show_default=False),
]


def config_files(params: list[Path] | None | Path) -> list[Path]:
    """The config files a command layers: the ones given (-c/--params/@FILE, in order), else ./params.yaml if it
    exists, else none (built-in defaults)."""
    if isinstance(params, Path):
        return [params]
    if params:
        return list(params)
    return [DEFAULT_PARAMS] if DEFAULT_PARAMS.exists() else []


def resolve_config(params: list[Path] | None | Path, overrides: list[str] | None, extra: dict | None = None):
    from tasks.settings import load_config

    return load_config(config_files(params), overrides or [], extra=extra)


def expand_at_files(argv: list[str]) -> list[str]:
    """prime-rl's `@ FILE`: an argument `@FILE` (or `@` followed by FILE) means `-c FILE`."""
    expanded: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg == "@":
            following = next(args, None)
            if following is None:
                from icrl_core.errors import UserError

                raise UserError("`@` must be followed by a config file, e.g. `@ experiments/debug/tiny.yaml`")
            expanded += ["-c", following]
        elif arg.startswith("@"):
            expanded += ["-c", arg[1:]]
        else:
            expanded.append(arg)
    return expanded


def console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)

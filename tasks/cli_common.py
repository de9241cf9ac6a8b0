"""Options and helpers shared by every CLI module (no heavy imports)."""

from pathlib import Path
from typing import Annotated, Optional

import typer

DEFAULT_PARAMS = Path("params.yaml")

ParamsOpt = Annotated[
    Optional[Path],
    typer.Option("--params", "-p", help="YAML params file. Default: ./params.yaml if it exists, else built-in "
                 "defaults.", show_default=False),
]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Override one config key, e.g. --set ppo.kl_beta=0.02 (repeatable; values "
                 "are YAML).", show_default=False),
]


def resolve_config(params: Optional[Path], overrides: Optional[list[str]], extra: dict | None = None):
    from tasks.settings import load_config

    if params is None and DEFAULT_PARAMS.exists():
        params = DEFAULT_PARAMS
    return load_config(params, overrides or [], extra=extra)


def console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)

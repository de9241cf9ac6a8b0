"""The experiment scripts' positional NAME=VALUE arguments (e.g. NAME=ADAPTER), parsed once."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from icrl_core.errors import UserError


def named_pairs(items: list[str], form: str = "NAME=ADAPTER") -> list[tuple[str, str]]:
    """Split each 'name=value' at its first '=' (a value may hold more); a missing '=' or an empty side is a user
    error naming `form`."""
    pairs = []
    for item in items:
        name, separator, value = item.partition("=")
        if not separator or not name or not value:
            raise UserError(f"'{item}': expected {form}")
        pairs.append((name, value))
    return pairs

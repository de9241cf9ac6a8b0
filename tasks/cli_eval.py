"""CLI commands of the in-context RL evaluation harness (filled in by the evaluation harness)."""

from __future__ import annotations


def register(app) -> None:
    return None

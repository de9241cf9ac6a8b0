"""CLI commands of the orchestration layer (pipeline, sweep, promote, up)."""

from __future__ import annotations


def register(app) -> None:
    return None

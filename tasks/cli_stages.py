"""CLI commands of the pipeline stages (`icrl stage NAME`)."""

from __future__ import annotations


def register(app) -> None:
    return None

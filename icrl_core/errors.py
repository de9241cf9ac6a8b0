"""Errors a user can cause and fix. The CLI turns every `UserError` into a message and exit code 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input (config, file, option). Its message says what is wrong and how to fix it."""

    exit_code = 2


class ConfigError(UserError):
    """A config key is unknown or a value is out of bounds."""


class EpisodeFileError(UserError):
    """An episodes JSONL file has bad lines. `problems` holds one `path:line: reason` string per bad line."""

    def __init__(self, path: str, problems: list[str]):
        self.path = path
        self.problems = problems
        shown = "\n".join(problems[:200])
        more = f"\n... and {len(problems) - 200} more" if len(problems) > 200 else ""
        lines = {p[len(path) + 1:].split(":", 1)[0] for p in problems}
        super().__init__(f"{path}: {len(problems)} problem(s) on {len(lines) or 1} line(s):\n{shown}{more}")


class EpisodeTooLongError(UserError):
    """An episode cannot fit the token budget even with every exemplar dropped."""


class CheckpointError(UserError):
    """A checkpoint is missing files, truncated or corrupt."""


class OutOfMemoryError(UserError):
    """The machine ran low on memory while a stage trained and its workers were stopped. The stage's checkpoints
    are kept: after freeing memory (or lowering the batch) a rerun resumes from the latest one."""

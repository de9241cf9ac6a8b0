"""The ICRL episode format: one JSON object per line.

    {"episode_id": "e1", "task_type": "banking77",
     "exemplars": [{"prompt": "...", "answer": "...", "reward": 1.0}, ...],
     "queries":   [{"prompt": "...", "preferred_answer": "...", "rejected_answer": "..."}, ...]}

`task_type` is optional (it picks the prompt template); `reward` on an exemplar is optional: without it the
exemplar is a gold (prompt, answer) pair; with it, the exemplar is a past attempt and the reward feedback is
rendered after it as the in-context RL harness does. `metadata` (an object) is optional and ignored.

Blank-line policy: lines holding only whitespace are skipped (line numbers still count them); a file without
any episode is an error. Every other problem is reported as `path:line: reason`, all of them at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from icrl_core.chat import Conversation, Tokens
from icrl_core.errors import EpisodeFileError, EpisodeTooLongError
from icrl_core.io import atomic_write_text, read_user_bytes
from icrl_core.prompting import PromptTemplate, template_for

NonEmpty = Annotated[str, StringConstraints(min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Exemplar(_Strict):
    prompt: NonEmpty
    answer: NonEmpty
    reward: float | None = None


class Query(_Strict):
    prompt: NonEmpty
    preferred_answer: NonEmpty
    rejected_answer: NonEmpty

    @model_validator(mode="after")
    def _distinct(self) -> Query:
        if self.preferred_answer == self.rejected_answer:
            raise ValueError("preferred_answer and rejected_answer are the same")
        return self


class Episode(_Strict):
    episode_id: NonEmpty
    exemplars: Annotated[list[Exemplar], Field(min_length=1)]
    queries: Annotated[list[Query], Field(min_length=1)]
    task_type: str | None = None
    metadata: dict[str, Any] | None = None

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)


def _reason(err: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"])
    kind = err["type"]
    if kind == "missing":
        return f"missing field '{loc}'"
    if kind == "extra_forbidden":
        return f"unknown field '{loc}'"
    if kind == "too_short":
        return f"'{loc}' must not be empty"
    if kind == "string_too_short":
        return f"'{loc}' must be a non-empty string"
    if kind in ("string_type", "float_type", "list_type", "dict_type", "model_type", "bool_type", "int_type"):
        got = type(err.get("input")).__name__
        want = kind.removesuffix("_type").replace("model", "object").replace("dict", "object")
        return f"'{loc}' must be of type {want}, got {got}"
    msg = err["msg"].removeprefix("Value error, ")
    return f"'{loc}': {msg}" if loc else msg


def parse_episode_lines(path: str, lines: Iterable[bytes]) -> tuple[list[Episode], list[str]]:
    """Parse raw lines; return (episodes, problems). Problems are `path:line: reason` strings."""
    episodes: list[Episode] = []
    problems: list[str] = []
    first_line_of: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problems.append(f"{path}:{number}: not valid UTF-8 (byte {exc.start})")
            continue
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            problems.append(f"{path}:{number}: invalid JSON: {exc.msg} (column {exc.colno})")
            continue
        if not isinstance(obj, dict):
            problems.append(f"{path}:{number}: expected a JSON object, got {type(obj).__name__}")
            continue
        try:
            episode = Episode.model_validate(obj)
        except ValidationError as exc:
            problems.extend(f"{path}:{number}: {_reason(err)}" for err in exc.errors())
            continue
        if episode.episode_id in first_line_of:
            problems.append(f"{path}:{number}: duplicate episode_id '{episode.episode_id}' "
                            f"(first seen on line {first_line_of[episode.episode_id]})")
            continue
        first_line_of[episode.episode_id] = number
        episodes.append(episode)
    if not episodes and not problems:
        problems.append(f"{path}:1: the file holds no episodes")
    return episodes, problems


def read_episodes(path: Path | str) -> list[Episode]:
    """Read and validate a whole episodes file; raise `EpisodeFileError` listing every bad line."""
    path = Path(path)
    raw = read_user_bytes(path, "episodes JSONL file")
    episodes, problems = parse_episode_lines(str(path), raw.splitlines())
    if problems:
        raise EpisodeFileError(str(path), problems)
    return episodes


def write_episodes(path: Path | str, episodes: Iterable[Episode]) -> int:
    """Write episodes as JSONL atomically; return how many were written."""
    lines = [episode.to_json() for episode in episodes]
    atomic_write_text(Path(path), "".join(line + "\n" for line in lines))
    return len(lines)


def iter_episode_ids(episodes: Iterable[Episode]) -> Iterator[str]:
    for episode in episodes:
        yield episode.episode_id


# ---------------------------------------------------------------------------------------------------------------
# Rendering


@dataclass(frozen=True)
class QuerySpan:
    """Where a query's preferred answer sits in the rendered ids: input_ids[start:end] are its answer tokens
    (end-of-turn included); input_ids[:start] is its prompt. `rejected_ids` is the rejected answer as tokens."""

    start: int
    end: int
    rejected_ids: tuple[int, ...]


@dataclass(frozen=True)
class RenderedEpisode:
    episode_id: str
    input_ids: list[int]
    loss_mask: list[int]
    queries: list[QuerySpan]
    exemplars_kept: int
    exemplars_dropped: int

    @property
    def shaved(self) -> bool:
        return self.exemplars_dropped > 0

    def longest_sequence(self) -> int:
        """Length of the longest sequence this episode produces (the full one, or a prompt + rejected answer)."""
        return max([len(self.input_ids)] + [q.start + len(q.rejected_ids) for q in self.queries])


def _render(episode: Episode, exemplars: list[Exemplar], tokens: Tokens, template: PromptTemplate,
            train_exemplars: bool, train_end_of_turn: bool = True) -> RenderedEpisode:
    with_feedback = any(ex.reward is not None for ex in exemplars)
    conv = Conversation(tokens, separator=template.separator)
    conv.system(template.system(with_feedback))
    for ex in exemplars:
        conv.user(template.query(ex.prompt))
        # A past attempt with a negative reward is context, never a training target.
        trained = train_exemplars and (ex.reward is None or ex.reward > 0)
        conv.assistant_answer(template.answer_prefix, ex.answer, trained=trained,
                              train_end_of_turn=train_end_of_turn)
        if ex.reward is not None:
            conv.user(template.feedback(ex.answer, ex.reward))
    spans = []
    for query in episode.queries:
        conv.user(template.query(query.prompt))
        conv.assistant_prompt(template.answer_prefix)
        start = conv.mark()
        preferred = conv.answer_ids(template.answer_prefix, query.preferred_answer)
        conv._emit(preferred[:-1], trained=True)
        conv._emit(preferred[-1:], trained=train_end_of_turn)  # the end-of-turn token
        conv._emit(tokens.assistant_suffix_rest)
        spans.append(QuerySpan(start, start + len(preferred),
                               conv.answer_ids(template.answer_prefix, query.rejected_answer)))
    return RenderedEpisode(episode.episode_id, conv.ids, conv.mask, spans, len(exemplars),
                           len(episode.exemplars) - len(exemplars))


def render_episode(episode: Episode, tokens: Tokens, max_tokens: int, template: PromptTemplate | None = None,
                   train_exemplars: bool = True, train_end_of_turn: bool = True) -> RenderedEpisode:
    """Render an episode into token ids and a loss mask over answer tokens (exemplar answers when
    `train_exemplars`, every query's preferred answer, each with its end-of-turn token unless
    `train_end_of_turn` is off).

    If the episode is longer than `max_tokens`, exemplars are dropped from the front until it fits; if the
    queries alone do not fit, `EpisodeTooLongError` names the episode."""
    template = template or template_for(episode.task_type)
    exemplars = list(episode.exemplars)
    rendered = _render(episode, exemplars, tokens, template, train_exemplars, train_end_of_turn)
    if rendered.longest_sequence() <= max_tokens:
        return rendered
    # Binary search on the number of exemplars dropped from the front: length is monotone in what is kept.
    low, high = 1, len(exemplars)
    best = None
    while low <= high:
        drop = (low + high) // 2
        candidate = _render(episode, exemplars[drop:], tokens, template, train_exemplars,
                            train_end_of_turn)
        if candidate.longest_sequence() <= max_tokens:
            best, high = candidate, drop - 1
        else:
            low = drop + 1
    if best is None:
        bare = _render(episode, [], tokens, template, train_exemplars)
        raise EpisodeTooLongError(
            f"episode '{episode.episode_id}' does not fit {max_tokens} tokens even without exemplars "
            f"(its queries take {bare.longest_sequence()} tokens); raise data.episode_tokens or shorten its queries"
        )
    return best


@dataclass
class RenderReport:
    rendered: list[RenderedEpisode]
    shaved: int
    too_long: list[str]


def render_episodes(episodes: Iterable[Episode], tokens: Tokens, max_tokens: int,
                    train_exemplars: bool = True) -> RenderReport:
    """Render many episodes; count shaved ones and collect every episode that cannot fit."""
    rendered, too_long = [], []
    for episode in episodes:
        try:
            rendered.append(render_episode(episode, tokens, max_tokens, train_exemplars=train_exemplars))
        except EpisodeTooLongError as exc:
            too_long.append(str(exc))
    return RenderReport(rendered, sum(r.shaved for r in rendered), too_long)

"""Stage 2: episodes -> one columnar Parquet file of token ids and masks, named by a content hash.

Why Parquet (pyarrow) and not HDF5: variable-length token lists are native `list<int32>` columns (HDF5 needs
ragged-array workarounds), reads are zero-copy into Arrow/numpy, the file is readable as is by pandas,
`datasets`, DuckDB and Spark, columns compress well (zstd), and pyarrow is already a dependency (h5py is not).

One row per episode:

    episode_id      string
    split           string          "train" | "val"
    task_type       string          (may be empty)
    input_ids       list<int32>     the rendered episode (system, exemplars, queries with preferred answers)
    loss_mask       list<int8>      1 on trained answer tokens (exemplar answers if train_exemplars, queries)
    length          int32           len(input_ids); the attention mask is `arange(T) < length` after padding
    query_start     list<int32>     per query: input_ids[:start] is its prompt ...
    query_end       list<int32>     ... and input_ids[start:end] its preferred answer (end-of-turn included)
    preferred_ids   list<list<int32>>  per query: = input_ids[start:end]
    rejected_ids    list<list<int32>>  per query: the rejected answer's tokens (end-of-turn included)
    exemplars_kept  int32
    exemplars_dropped int32         exemplars shaved from the front to fit the budget

The file name is sha256 over (format version, each episode file's sha256, the tokenizer identity, the
rendering settings); `manifest.json` (a fixed path, for DVC) points to the current file.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

import icrl_core.task_data  # noqa: F401  (registers the synthetic tasks' prompt templates used by template_for)
from icrl_core.chat import Tokens
from icrl_core.episodes import Episode, render_episode
from icrl_core.errors import EpisodeTooLongError, UserError
from icrl_core.io import atomic_write_bytes, sha256_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"

SCHEMA = pa.schema([
    ("episode_id", pa.string()),
    ("split", pa.string()),
    ("task_type", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("length", pa.int32()),
    ("query_start", pa.list_(pa.int32())),
    ("query_end", pa.list_(pa.int32())),
    ("preferred_ids", pa.list_(pa.list_(pa.int32()))),
    ("rejected_ids", pa.list_(pa.list_(pa.int32()))),
    ("exemplars_kept", pa.int32()),
    ("exemplars_dropped", pa.int32()),
])


@dataclass(frozen=True)
class TokenizedEpisode:
    """One row of the tokenized file."""

    episode_id: str
    split: str
    input_ids: list[int]
    loss_mask: list[int]
    query_start: list[int]
    query_end: list[int]
    rejected_ids: list[list[int]]
    task_type: str = ""
    exemplars_dropped: int = 0

    @property
    def length(self) -> int:
        return len(self.input_ids)

    def pairs(self) -> list[tuple[list[int], list[int]]]:
        """Per query: (prompt + preferred answer, prompt + rejected answer) token ids, for the reward model."""
        return [(self.input_ids[:end], self.input_ids[:start] + list(rejected))
                for start, end, rejected in zip(self.query_start, self.query_end, self.rejected_ids)]


def tokenizer_identity(tokenizer) -> str:
    """sha256 of what decides token ids: the tokenizer's serialized vocabulary/merges/normalizer, its special
    tokens and its chat template. Two model specs sharing a tokenizer (smollm2-135m and tiny) share it."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode("utf-8"))
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode("utf-8"))
    digest.update(json.dumps(tokenizer.all_special_tokens).encode("utf-8"))
    digest.update((getattr(tokenizer, "chat_template", None) or "").encode("utf-8"))
    return digest.hexdigest()


def content_hash(episode_files: Mapping[str, Path], tokenizer_id: str, settings: Mapping) -> str:
    """The name of a tokenized file: changes iff an input file, the tokenizer or a rendering setting does."""
    digest = hashlib.sha256()
    digest.update(f"icrl-tokenized-v{FORMAT_VERSION}\n".encode())
    for split in sorted(episode_files):
        path = Path(episode_files[split])
        file_hash = sha256_file(path) if path.exists() else "missing"
        digest.update(f"{split}:{file_hash}\n".encode())
    digest.update(f"tokenizer:{tokenizer_id}\n".encode())
    digest.update(json.dumps(dict(settings), sort_keys=True).encode())
    return digest.hexdigest()


def tokenize_episodes(episodes: Iterable[Episode], split: str, tokens: Tokens, max_tokens: int,
                      train_exemplars: bool = True, train_end_of_turn: bool = True) -> tuple[list[dict], list[str]]:
    """Render episodes into rows (dicts following SCHEMA); return (rows, messages of episodes that do not fit)."""
    rows, too_long = [], []
    for episode in episodes:
        try:
            rendered = render_episode(episode, tokens, max_tokens, train_exemplars=train_exemplars,
                                      train_end_of_turn=train_end_of_turn)
        except EpisodeTooLongError as exc:
            too_long.append(str(exc))
            continue
        ids = rendered.input_ids
        rows.append({
            "episode_id": episode.episode_id,
            "split": split,
            "task_type": episode.task_type or "",
            "input_ids": ids,
            "loss_mask": rendered.loss_mask,
            "length": len(ids),
            "query_start": [q.start for q in rendered.queries],
            "query_end": [q.end for q in rendered.queries],
            "preferred_ids": [ids[q.start:q.end] for q in rendered.queries],
            "rejected_ids": [list(q.rejected_ids) for q in rendered.queries],
            "exemplars_kept": rendered.exemplars_kept,
            "exemplars_dropped": rendered.exemplars_dropped,
        })
    return rows, too_long


def tokenized_stats(rows: list[dict]) -> dict:
    """Sequences, tokens, mean/max length, loss tokens, queries and shaved episodes, overall and per split."""

    def stats(part: list[dict]) -> dict:
        lengths = [r["length"] for r in part]
        return {
            "sequences": len(part),
            "tokens": sum(lengths),
            "mean_length": round(sum(lengths) / len(lengths), 1) if lengths else 0.0,
            "max_length": max(lengths, default=0),
            "loss_tokens": sum(sum(r["loss_mask"]) for r in part),
            "queries": sum(len(r["query_start"]) for r in part),
            "shaved": sum(r["exemplars_dropped"] > 0 for r in part),
        }

    out = stats(rows)
    out["per_split"] = {split: stats([r for r in rows if r["split"] == split]) for split in ("train", "val")}
    return out


def parquet_bytes(rows: list[dict]) -> bytes:
    """The rows as a zstd-compressed Parquet file (in memory, so the caller can write it atomically)."""
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def write_tokenized(folder: Path | str, digest: str, rows: list[dict], manifest_extra: Mapping) -> Path:
    """Write `<digest>.parquet`, then `manifest.json` pointing to it (both atomic); remove stale files."""
    folder = Path(folder)
    path = folder / f"{digest}.parquet"
    atomic_write_bytes(path, parquet_bytes(rows))
    manifest = {"format": FORMAT_VERSION, "file": path.name, "sha256": digest, **manifest_extra}
    atomic_write_bytes(folder / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    for old in folder.glob("*.parquet"):  # the manifest names the only current file
        if old.name != path.name:
            old.unlink(missing_ok=True)
    return path


def tokenized_path(folder: Path | str) -> Path:
    """The Parquet file `folder/manifest.json` points to."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise UserError(f"{manifest_path}: not found; run the tokenize stage first (`icrl stage tokenize`)") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{manifest_path}: corrupt manifest ({exc.msg}); rerun `icrl stage tokenize`") from None
    path = folder / manifest["file"]
    if not path.exists():
        raise UserError(f"{path}: named by {manifest_path} but missing; rerun `icrl stage tokenize`")
    return path


def read_tokenized(path: Path | str, split: str | None = None) -> list[TokenizedEpisode]:
    """Rows of a tokenized file (a folder means: the file its manifest points to), optionally one split."""
    path = Path(path)
    if path.is_dir():
        path = tokenized_path(path)
    try:
        table = pq.read_table(path, columns=["episode_id", "split", "task_type", "input_ids", "loss_mask",
                                             "query_start", "query_end", "rejected_ids", "exemplars_dropped"])
    except (pa.ArrowInvalid, OSError) as exc:
        raise UserError(f"{path}: not a readable tokenized Parquet file ({exc})") from None
    rows = table.to_pylist()
    return [TokenizedEpisode(r["episode_id"], r["split"], r["input_ids"], r["loss_mask"], r["query_start"],
                             r["query_end"], r["rejected_ids"], r["task_type"], r["exemplars_dropped"])
            for r in rows if split is None or r["split"] == split]


def load_tokenizer(spec: str, cache_dir: Path | None = None):
    """The tokenizer of a model spec, without loading the model's weights."""
    from transformers import AutoTokenizer

    from icrl_core.model import resolve_spec

    _, where = resolve_spec(spec, cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(where))
    except OSError as exc:
        raise UserError(f"cannot load the tokenizer of model '{spec}': {exc}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer

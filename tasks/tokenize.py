"""Stage `tokenize`: data.output_dir/{train,val}.jsonl -> tokenize.output_dir/<content hash>.parquet, plus
manifest.json (a fixed path naming the current file, for DVC) and stats.json. See icrl_core/tokenized.py for
the columns and why Parquet.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from icrl_core.errors import UserError
from tasks.settings import PipelineConfig

STAGE = "tokenize"
HEADLINE = ("sequences", "tokens")  # metrics/tokenize.json; the rest: output_dir/stats.json


def read_split(path: Path):
    """Episodes of one split file; an empty file is an empty split, a missing one an error."""
    from icrl_core.episodes import read_episodes
    from icrl_core.io import read_user_bytes

    if not read_user_bytes(path, "episodes file", "run `icrl stage build_dataset` first, or set "
                           "data.output_dir").strip():
        return []
    return read_episodes(path)


def render_settings(config: PipelineConfig, task_types: set[str], chat_format) -> dict:
    """Everything besides the files and the tokenizer that decides the token ids."""
    from icrl_core.prompting import template_for

    return {
        "episode_tokens": config.data.episode_tokens,
        "train_exemplars": config.tokenize.train_exemplars,
        "chat_format": dataclasses.asdict(chat_format),
        "templates": {t: template_for(t or None).model_dump() for t in sorted(task_types)},
        # only when off, so data tokenized before the option existed keeps its content hash
        **({} if config.tokenize.train_end_of_turn else {"train_end_of_turn": False}),
    }


def tokenize(config: PipelineConfig) -> tuple[dict, Path]:
    from tqdm.auto import tqdm

    from icrl_core.chat import Tokens
    from icrl_core.io import atomic_write_json
    from icrl_core.tokenized import (
        content_hash,
        load_tokenizer,
        tokenize_episodes,
        tokenized_stats,
        tokenizer_identity,
        write_tokenized,
    )

    started = time.perf_counter()
    folder = Path(config.data.output_dir)
    files = {"train": folder / "train.jsonl", "val": folder / "val.jsonl"}
    episodes = {split: read_split(path) for split, path in files.items()}
    tokenizer = load_tokenizer(config.model.spec, config.model.cache_dir)
    tokens = Tokens(tokenizer)
    task_types = {e.task_type or "" for split in episodes.values() for e in split}
    settings = render_settings(config, task_types, tokens.format)
    digest = content_hash(files, tokenizer_identity(tokenizer), settings)
    rows, too_long = [], []
    for split, items in episodes.items():
        part, long_ = tokenize_episodes(tqdm(items, desc=f"tokenize {split}", unit="episode", leave=False), split,
                                        tokens, config.data.episode_tokens, config.tokenize.train_exemplars,
                                        config.tokenize.train_end_of_turn)
        rows += part
        too_long += long_
    if too_long:
        raise UserError(f"{len(too_long)} episode(s) do not fit data.episode_tokens={config.data.episode_tokens} "
                        f"(was the dataset built with another budget or model?):\n" + "\n".join(too_long[:20]))
    if not any(r["split"] == "train" for r in rows):
        raise UserError(f"{files['train']}: no training episodes")
    stats = tokenized_stats(rows)
    out = Path(config.tokenize.output_dir)
    path = write_tokenized(out, digest, rows, {
        "inputs": {split: str(p) for split, p in files.items()}, "tokenizer": config.model.spec,
        "settings": {k: v for k, v in settings.items() if k != "templates"}, "stats": stats,
    })
    atomic_write_json(out / "stats.json", {"file": path.name, **stats})
    metrics = {k: v for k, v in stats.items() if not isinstance(v, dict)}
    metrics.update({f"{split}_sequences": s["sequences"] for split, s in stats["per_split"].items()})
    metrics["seconds"] = round(time.perf_counter() - started, 2)
    return metrics, path


def run(config: PipelineConfig) -> dict:
    from tasks.cli_common import console
    from tasks.runtime import write_stage_metrics
    from tasks.tracking import stage_run

    with stage_run(config, STAGE) as tracker:
        metrics, path = tokenize(config)
        tracker.log_metrics(metrics)
        tracker.log_artifact(path.parent / "stats.json", "tokenized")
        tracker.log_artifact(path.parent / "manifest.json", "tokenized")
    write_stage_metrics(STAGE, metrics, headline=HEADLINE)
    console(stderr=True).print(
        f"tokenized -> {path}: {metrics['sequences']} sequences ({metrics['train_sequences']} train, "
        f"{metrics['val_sequences']} val), {metrics['tokens']} tokens, mean length {metrics['mean_length']}, "
        f"max {metrics['max_length']}, {metrics['loss_tokens']} loss tokens, {metrics['shaved']} shaved")
    return metrics

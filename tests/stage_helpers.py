"""Helpers shared by the tests of stages 1-4 (dataset build, tokenize, bootstrap, reward model)."""

from __future__ import annotations

from icrl_core.config import DataConfig, SyntheticSource
from icrl_core.dataset_build import build_episodes, resolve_sources
from icrl_core.tokenized import TokenizedEpisode, tokenize_episodes

TINY_STAGE_SETTINGS = [
    "model.spec=tiny", "tracking.enabled=false", "data.num_episodes=40", "data.k_exemplars=3",
    "data.n_queries=2", "data.n_queries_min=1", "data.episode_tokens=512",
]


def keyword_data(**overrides) -> DataConfig:
    fields = {"sources": [SyntheticSource(name="keyword_map")], "num_episodes": 24, "k_exemplars": 3,
              "n_queries": 1, "val_fraction": 0.25}
    fields.update(overrides)
    return DataConfig(**fields)


def keyword_rows(tokens, seed: int = 0, **overrides) -> tuple[list[TokenizedEpisode], list[TokenizedEpisode]]:
    """(train rows, val rows) of a small keyword_map dataset, tokenized in memory."""
    data = keyword_data(**overrides)
    built = build_episodes(resolve_sources(data, seed), data, seed)
    out = {}
    for split in ("train", "val"):
        rows, too_long = tokenize_episodes([b.episode for b in built if b.split == split], split, tokens, 2048)
        assert not too_long
        out[split] = [TokenizedEpisode(r["episode_id"], r["split"], r["input_ids"], r["loss_mask"],
                                       r["query_start"], r["query_end"], r["rejected_ids"], r["task_type"])
                      for r in rows]
    return out["train"], out["val"]


def stage_args(*overrides: str) -> list[str]:
    args = []
    for item in [*TINY_STAGE_SETTINGS, *overrides]:
        args += ["--set", item]
    return args

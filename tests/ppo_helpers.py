"""Keyword-map episodes for the PPO/adapt tests, built here so those tests do not depend on the dataset stage."""

from __future__ import annotations

import random
from pathlib import Path

from icrl_core.episodes import Episode, Exemplar, Query, write_episodes
from icrl_core.task_data import load_task


def keyword_episodes(count: int, k: int = 3, n: int = 1, seed: int = 0, tasks_dir: Path | str = ".",
                     split: str = "train") -> list[Episode]:
    """Episodes of the synthetic keyword_map task. Each query gets one exemplar with the same keyword (so its
    answer can be read from the context); the other k - 1 exemplars are random gold pairs; order shuffled.
    Preferred answer = gold label, rejected = another label."""
    task = load_task("keyword_map", tasks_dir, seed=0)
    pool = task.train if split == "train" else task.test
    rng = random.Random(seed)
    by_keyword: dict[str, list] = {}
    for example in pool:
        by_keyword.setdefault(example.text.split()[3], []).append(example)
    episodes = []
    for index in range(count):
        queries = rng.sample(pool, n)
        exemplars = []
        for query in queries:
            same = [e for e in by_keyword[query.text.split()[3]] if e is not query]
            exemplars.append(rng.choice(same))
        while len(exemplars) < k:
            exemplars.append(rng.choice(pool))
        rng.shuffle(exemplars)
        episodes.append(Episode(
            episode_id=f"{split}-{seed}-{index}", task_type="keyword_map",
            exemplars=[Exemplar(prompt=e.text, answer=e.label) for e in exemplars],
            queries=[Query(prompt=q.text, preferred_answer=q.label,
                           rejected_answer=rng.choice([lb for lb in task.labels if lb != q.label]))
                     for q in queries]))
    return episodes


def write_keyword_dataset(folder: Path, train: int = 64, val: int = 16, k: int = 3, n: int = 1,
                          seed: int = 0) -> Path:
    """data.output_dir layout: train.jsonl and val.jsonl."""
    folder.mkdir(parents=True, exist_ok=True)
    write_episodes(folder / "train.jsonl", keyword_episodes(train, k, n, seed, split="train"))
    write_episodes(folder / "val.jsonl", keyword_episodes(val, k, n, seed + 1, split="val"))
    return folder

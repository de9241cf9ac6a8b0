"""Addendum 44's dry run (its numbers are not results): under the bootstrap adapter, how often a trained step of a
training stream has a gold label missing from its context (gold_absent_rate) and is a discovery (novel_rate), for
setting 16's stream design and the variants the addendum names, two training draws each (iterations 1 and 2; no
update, no trec_coarse). Prints one JSON line per draw (dry_run_s26.json holds the session's lines).

    .venv/bin/python experiments/icrl_stream_rl/dry_run_s26.py   # from the project root, the bootstrap in
                                                                  # artifacts/bootstrap/adapter (run.sh bootstrap)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from icrl_core.dataset_build import resolve_sources
from icrl_core.model import policy_from_config
from icrl_core.stream_rl import roll_out, stream_statistics
from tasks.settings import load_config

E = "experiments/icrl_stream_rl"
FILES = ["params.yaml", "experiments/icrl_skill.yaml", f"{E}/h32_ppo.yaml", f"{E}/stream_rl.yaml",
         f"{E}/explorative_streams.yaml", f"{E}/burn_in_streams.yaml"]
VARIANTS = {"setting16": [], "six_labels": ["data.labels_per_episode=6", "data.labels_per_episode_min=6"],
            "p_keep_0.1": ["ppo.stream.context.p_keep=0.1"], "p_keep_0.25": ["ppo.stream.context.p_keep=0.25"]}


def main() -> None:
    torch.set_num_threads(2)
    policy = None
    for name, overrides in VARIANTS.items():
        config = load_config(FILES, overrides)
        if policy is None:
            policy = policy_from_config(config.model, seed=config.seed, init_adapter="artifacts/bootstrap/adapter")
        sources = resolve_sources(config.data, config.seed)
        for iteration in (1, 2):
            started = time.perf_counter()
            streams = roll_out(policy, sources, config.data, config.ppo, config.seed, iteration, range(1), "train",
                               policy.context_window)
            stats = stream_statistics(streams)
            print(json.dumps({"variant": name, "iteration": iteration, "labels": len(streams[0].task.labels),
                              "mean_reward": stats["mean_reward"], "gold_absent_rate": stats["gold_absent_rate"],
                              "novel_rate": stats["novel_rate"],
                              "seconds": round(time.perf_counter() - started)}), flush=True)


if __name__ == "__main__":
    main()

"""Dry run of a stream config (addenda 33 and 36): roll out the first training iterations' groups with the start
adapter, no update, training tasks only, and write the trained steps' rewards (their mean, and how many groups
earned the same rewards at every step, so that RLOO would have no advantage to follow), each stream's test value
when ppo.stream.test_reward.queries is set (measured, not rewarded) and the phases' times: a measurement of the
rollouts, not a result.

    .venv/bin/python experiments/icrl_stream_rl/dry_run_test_reward.py ITERATIONS OUTPUT.json -c ... [--set ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str]) -> None:
    from icrl_core.dataset_build import resolve_sources
    from icrl_core.model import policy_from_config
    from icrl_core.stream_rl import roll_out_tasks, stream_tasks
    from icrl_core.streams import context_values
    from tasks.ppo import max_episode_tokens
    from tasks.settings import load_config

    iterations, output, rest = int(argv[0]), Path(argv[1]), argv[2:]
    layers = [rest[i + 1] for i in range(len(rest)) if rest[i] == "-c"]
    sets = [rest[i + 1] for i in range(len(rest)) if rest[i] == "--set"]
    config = load_config(layers, sets)
    cfg = config.ppo
    policy = policy_from_config(config.model, value_head=False, seed=config.seed,
                                init_adapter=cfg.init_adapter or config.model.init_adapter)
    sources = resolve_sources(config.data, config.seed)
    max_tokens = max_episode_tokens(config, policy)
    measured = cfg.model_copy(update={"stream": cfg.stream.model_copy(update={"test_reward": cfg.stream.test_reward
                                                                                .model_copy(update={"queries": 0})})})
    groups = []
    for iteration in range(1, iterations + 1):
        for group, task in stream_tasks(sources, config.data, cfg, config.seed, iteration, range(cfg.stream.groups),
                                        "train"):
            started = time.perf_counter()
            streams = roll_out_tasks(policy, [(group, task)], measured, config.seed, iteration, max_tokens)
            rolled = time.perf_counter() - started
            values = (context_values(policy, streams, cfg.stream.test_reward.temperature)
                      if cfg.stream.test_reward.queries else None)
            groups.append({"iteration": iteration, "group": group, "task": task.name, "labels": len(task.labels),
                           "rewards": [s.rewards for s in streams], "test_values": values,
                           "rollout_seconds": rolled, "test_value_seconds": time.perf_counter() - started - rolled})
            print(json.dumps(groups[-1]), flush=True)
    totals = [[sum(r) for r in g["rewards"]] for g in groups]
    reward_spread = [max(t) - min(t) for t in totals]
    rewards = [r for g in groups for stream in g["rewards"] for r in stream]
    summary = {"groups": groups, "threads": torch.get_num_threads(), "mean_reward": sum(rewards) / len(rewards),
               "decisions": len(rewards),
               "uniform_groups": sum(all(s == g["rewards"][0] for s in g["rewards"]) for g in groups),
               "mean_within_group_reward_range": sum(reward_spread) / len(reward_spread)}
    if cfg.stream.test_reward.queries:
        spread = [max(g["test_values"]) - min(g["test_values"]) for g in groups]
        summary["mean_within_group_range"] = sum(spread) / len(spread)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])

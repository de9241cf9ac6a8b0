"""Benchmark: asynchronous vs synchronous stream rollouts (ppo.async_rollouts, docs/ASYNC.md) on the 2 CPUs.

Both sides run the real `ppo` stage in stream mode (`tasks.ppo.run`) on the embedded SmolLM2-135M-Instruct
(model.spec=smollm2-135m, float32), the same seed, the same streams per iteration and the same number of
iterations (the budget), from the same fresh LoRA, objective grpo, no evaluation groups:

- sync:  one process, one torch thread: roll out the iteration's streams, then update (today's loop);
- async: the trainer (one thread) and `--actors` rollout actor(s) (one thread each) on a local Ray with 2 CPUs;
         the actors generate the next iterations' streams with weights at most `--level` versions old while the
         trainer updates.

Each side runs in its own subprocess (`--side`). Reported per side: the stage's wall time (model load, Ray start
and actor start included), the loop's time (sum over iterations of rollout + update seconds as the trainer saw
them: under async, `rollout_seconds` is the trainer's wait for a finished rollout), the mean and final stream
reward (history.json `mean_reward`), and per-iteration rollout/update/actor seconds; the machine's load average
before and after (the 2 cores are shared with other jobs); ratio = sync / async for the times.

    .venv/bin/python bench/async_rollouts.py                  # both sides -> bench/results/async_rollouts.json
    .venv/bin/python bench/async_rollouts.py --iterations 2   # quicker
    .venv/bin/python bench/async_rollouts.py --side async     # one side, JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIDES = ("sync", "async")


def stage_items(args, side: str) -> list[str]:
    items = [
        "model.spec=smollm2-135m", "model.dtype=float32", "tracking.enabled=false", f"seed={args.seed}",
        "ray.enabled=false", "ray.num_cpus=2", "ppo.mode=stream", "ppo.objective={kind: grpo}",
        f"ppo.max_steps={args.iterations}", f"ppo.save_steps={args.iterations}", f"ppo.eval_steps={args.iterations}",
        f"ppo.stream={{steps: {args.steps}, group_size: {args.group_size}, groups: {args.groups}, eval_groups: 0}}",
        "ppo.epochs=1", f"ppo.minibatch_size={args.group_size}", f"ppo.batch_size={args.group_size}",
        "ppo.learning_rate=1e-4", "ppo.kl_beta=0.0", "ppo.entropy_beta=0.0", "ppo.temperature=1.0",
        "data.sources=[{kind: synthetic, name: keyword_map}]", "data.labels_per_episode=3",
    ]
    if side == "async":
        items.append(f"ppo.async_rollouts={{enabled: true, actors: {args.actors}, max_async_level: {args.level}, "
                     "actor_cpus: 1}")
    return items


def run_side(args) -> dict:
    """One side in this process: the ppo stage in a temporary working directory."""
    import torch

    from tasks.env import apply_defaults

    apply_defaults()
    torch.set_num_threads(1)
    from tasks.ppo import run
    from tasks.settings import load_config

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="icrl-bench-", dir="/tmp") as folder:  # short: Ray's socket paths
        os.chdir(folder)
        started = time.perf_counter()
        run(load_config(None, stage_items(args, args.side), environ={}))
        wall = time.perf_counter() - started
        history = json.loads(Path(folder, "artifacts", "ppo", "history.json").read_text())
    rewards = [row["mean_reward"] for row in history]
    per_step = [{key: row.get(key) for key in ("step", "mean_reward", "rollout_seconds", "update_seconds",
                                                "actor_rollout_seconds", "async_version", "async_lag",
                                                "is_ratio_mean", "is_ratio_min", "is_ratio_max")
                 if key in row} for row in history]
    loop = sum(row["rollout_seconds"] + row["update_seconds"] for row in history)
    return {"side": args.side, "wall_seconds": wall, "loop_seconds": loop,
            "seconds_per_iteration": loop / len(history),
            "trainer_wait_seconds": sum(row["rollout_seconds"] for row in history),
            "update_seconds": sum(row["update_seconds"] for row in history),
            "actor_rollout_seconds": sum(row.get("actor_rollout_seconds", 0.0) for row in history) or None,
            "final_reward": rewards[-1], "mean_reward": sum(rewards) / len(rewards),
            "load_average_before": load_before, "load_average_after": os.getloadavg(), "iterations": per_step}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=SIDES, help="run one side here and print its JSON")
    parser.add_argument("--iterations", type=int, default=4, help="PPO iterations per side (the budget)")
    parser.add_argument("--steps", type=int, default=8, help="queries per stream (T)")
    parser.add_argument("--group-size", type=int, default=4, help="streams per group (G)")
    parser.add_argument("--groups", type=int, default=2, help="groups per iteration")
    parser.add_argument("--level", type=int, default=1, help="ppo.async_rollouts.max_async_level")
    parser.add_argument("--actors", type=int, default=1, help="rollout actors (1 CPU each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "async_rollouts.json")
    args = parser.parse_args(argv)
    if args.side:
        print(json.dumps(run_side(args)))
        return 0
    flags = [f"--iterations={args.iterations}", f"--steps={args.steps}", f"--group-size={args.group_size}",
             f"--groups={args.groups}", f"--level={args.level}", f"--actors={args.actors}", f"--seed={args.seed}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    results = {}
    for side in SIDES:
        done = subprocess.run([sys.executable, __file__, "--side", side, *flags], capture_output=True, text=True,
                              cwd=ROOT, env=env, check=False)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        results[side] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{side}: wall {results[side]['wall_seconds']:.0f} s, loop {results[side]['loop_seconds']:.0f} s, "
              f"final reward {results[side]['final_reward']:.3f}", file=sys.stderr)
    import torch

    sync, asyn = results["sync"], results["async"]
    report = {
        "settings": {**{k: v for k, v in vars(args).items() if k not in ("side", "output")},
                     "model": "smollm2-135m", "dtype": "float32", "objective": "grpo",
                     "stage_overrides": {side: stage_items(args, side) for side in SIDES}},
        "environment": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                        "platform": platform.platform(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
                        "threads": "1 torch thread per process (trainer, each actor)"},
        "results": results,
        "ratio": {"wall_sync_over_async": sync["wall_seconds"] / asyn["wall_seconds"],
                  "loop_sync_over_async": sync["loop_seconds"] / asyn["loop_seconds"],
                  "rollout_actor_over_sync": (asyn["actor_rollout_seconds"] or 0) / sync["trainer_wait_seconds"],
                  "update_async_over_sync": asyn["update_seconds"] / sync["update_seconds"]},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["ratio"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

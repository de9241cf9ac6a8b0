"""`icrl probe-closure` (the label-closure probe, icrl_core/closure_probe.py) of several adapters on a task's
training split (REPORT.md#label-closure), one result file.

    .venv/bin/python experiments/icrl_stream_rl/closure_probe.py --task trec_coarse NAME=ADAPTER [NAME=ADAPTER ...] \
        [--queries 20] [--episodes 20] [--seed 0] [--output F]     # ADAPTER: a PEFT adapter folder, or 'base'

float32, the embedded SmolLM2-135M, tasks from data.tasks_dir of params.yaml (run from the project root).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from named_args import named_pairs

from icrl_core.errors import UserError
from icrl_core.io import atomic_write_json


def probe(task_name: str, adapter: str, queries: int, episodes: int, seed: int) -> dict:
    """`icrl probe-closure`'s probe (tasks.icrl_eval.probe_closure, tracked in MLflow as it is) of one adapter."""
    from tasks.icrl_eval import probe_closure
    from tasks.settings import load_config, with_overrides

    config = with_overrides(load_config([ROOT / "params.yaml"]), {
        "model.dtype": "float32", "model.init_adapter": None if adapter == "base" else adapter,
        "icrl_eval.task": task_name, "icrl_eval.seed": seed})
    return probe_closure(config, queries, episodes, progress=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="+", help="NAME=ADAPTER (ADAPTER: an adapter folder or 'base')")
    parser.add_argument("--task", default="trec_coarse")
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    results = {}
    try:
        for name, adapter in named_pairs(args.adapters):
            results[name] = {"adapter": adapter, **probe(args.task, adapter, args.queries, args.episodes, args.seed)}
            row = results[name]
            print(f"{name}: absent_recall {row['absent_recall']:.3f}, present_recall {row['present_recall']:.3f}, "
                  f"false_alarm {row['false_alarm']:.3f}", flush=True)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.output:
        atomic_write_json(args.output, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

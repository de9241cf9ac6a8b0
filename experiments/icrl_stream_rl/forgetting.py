"""The forgetting measures of addendum 14 for one adapter: the evaluate stage's general-ability check (greedy answers
to 197 questions, the 1509-item probe) on the base model and on the adapter, with the skill recipe's evaluate
settings, written as one JSON that `collect.py --forgetting NAME=OUT` reads:

    .venv/bin/python experiments/icrl_stream_rl/forgetting.py artifacts/dpo_one_stage/adapter runs/forgetting-s14.json \
        -c params.yaml -c experiments/icrl_skill.yaml -c experiments/icrl_stream_rl/h32_ppo.yaml

The config layers are run.sh's (its SKILL list).

Each model's measurement is also kept in the evaluate stage's result cache (a rerun reuses it)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from icrl_core.errors import UserError
from icrl_core.io import atomic_write_json
from tasks.evaluate import general_ability
from tasks.settings import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("adapter", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("-c", "--config", dest="configs", action="append", required=True,
                        help="config file, layered in the order given (run.sh passes its SKILL list)")
    args = parser.parse_args()
    # the feedback probe is measured by `icrl probe-feedback` (gate 1), not here
    try:
        config = load_config(args.configs, ["evaluate.feedback_probe_target=null"])
    except UserError as exc:  # a missing or bad config file: one message, exit 2
        parser.exit(2, f"forgetting.py: {exc}\n")
    start = time.time()
    base = general_ability(config, None)
    trained = general_ability(config, args.adapter)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.output, {"seconds": round(time.time() - start), "base": base, "trained": trained})


if __name__ == "__main__":
    main()

"""Addendum 58's check L51 (PREREGISTERED.md): can the model use, in context, what check L50 asked its RL to teach?

On streams drawn as check L50 draws its validation streams (2 opaque labels renamed per stream, 8 queries, each
query's label independent), the probe reads p(gold) of every step t (its context: the t queries before it) under
three contexts that carry the same information about the classes:

    gold     the ICL upper bound's view: each past query answered with its gold label, no feedback turn
    right    the stream's view: each past query answered with its gold label, marked right
    verdict  the stream's view: each past query answered with a label drawn uniformly (seeded), marked right or
             wrong by the truth; with two labels a verdict fixes the past query's label, so a reader that matches
             the query to a past query of its class has what `gold` gives

p(gold) is the harness's constrained decoding at temperature 1 (`label_distribution`). Each step is also put in a
category by the latest past query of the query's class: none, right (in `verdict`: its answer was marked right) or
wrong (marked wrong: a reader answers the other label). A reader that recognises a query's class earns
1 - 0.5^(t+1) at step t (0.985 on steps 4-7); one that ignores the context 0.5.

    .venv/bin/python experiments/icrl_stream_rl/class_verdict_ceiling.py NAME=ADAPTER [NAME=ADAPTER ...] \
        [--tasks 64] [--layer F.yaml ...] [--split val|train] [--output F]   # ADAPTER: a PEFT adapter folder, or 'base'

The config is check L50's (run.sh's layers), float32; run from the project root. `--layer` adds config layers
after them (addendum 60's check L53 draws its streams from trec_coarse's named labels this way) and `--split` picks
the pool the queries come from (val: the task's test split, as checks L51 and L52 drew from the training tasks;
train: the one a held-out task's evaluations never read).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from named_args import named_pairs

from icrl_core.errors import UserError
from icrl_core.io import atomic_write_json

E = "experiments/icrl_stream_rl"
LAYERS = ["params.yaml", "experiments/icrl_skill.yaml", f"{E}/h32_ppo.yaml", f"{E}/stream_rl.yaml",
          f"{E}/feedback_learnability.yaml", f"{E}/feedback_learnability_lr.yaml", f"{E}/class_verdict_learnability.yaml"]
CONDITIONS = ("gold", "right", "verdict")
LATE = range(4, 8)  # the steps the decision reads: the last half of an 8-query stream
SEED = 51


def stream_tasks(config, n_tasks: int, split: str = "val"):
    from icrl_core.dataset_build import resolve_sources
    from icrl_core.streams import sample_stream_task

    sources = resolve_sources(config.data, config.seed)
    steps = config.ppo.stream.burn_in + config.ppo.stream.steps
    return [sample_stream_task(sources, config.data, steps, SEED, f"ceiling-{i}", split,
                               repeat_label=config.ppo.stream.repeat_label) for i in range(n_tasks)]


def episodes(task, condition: str, rng: random.Random):
    """The EpisodeRecords of every query of `task` under `condition` (a step's context is the prefix before it)."""
    from icrl_core.icrl_eval import EpisodeRecord

    records = []
    for t, query in enumerate(task.queries):
        answer = rng.choice(task.labels) if condition == "verdict" else query.label
        reward = int(answer == query.label)
        records.append(EpisodeRecord(t, query.text, query.label, answer, reward, reward))
    return records


def category(records, t: int) -> str:
    """none / right / wrong: the verdict on the latest past query of step t's class."""
    for record in reversed(records[:t]):
        if record.gold == records[t].gold:
            return "right" if record.reward else "wrong"
    return "none"


def probe(config, adapter: str, tasks) -> dict:
    from icrl_core.icrl_eval import Predictor, Show, label_distribution, render_context
    from icrl_core.streams import STREAM_VIEW, TEACHER_VIEW
    from tasks.icrl_eval import load_eval_policy
    from tasks.settings import with_overrides

    policy = load_eval_policy(with_overrides(config, {"model.init_adapter": None if adapter == "base" else adapter}))
    shows: dict[str, Show] = {"gold": TEACHER_VIEW, "right": STREAM_VIEW, "verdict": STREAM_VIEW}
    rows = []  # (condition, step, category, p(gold))
    for index, task in enumerate(tasks):
        predictor = Predictor(policy, policy.tokens, task.template, list(task.labels), None, 1.0)
        for condition in CONDITIONS:
            records = episodes(task, condition, random.Random(f"{SEED}:{index}"))
            for t, query in enumerate(task.queries):
                if t == 0 and condition != "gold":
                    continue  # no context: every condition's step 0 is the same prompt up to the system sentence
                ids, user_open = render_context(policy.tokens, task.template, records[:t], shows[condition])
                p = label_distribution(predictor, ids, user_open, query.text, temperature=1.0)
                rows.append((condition, t, category(records, t), float(p[list(task.labels).index(query.label)])))
        predictor.engine.close()

    def mean(selected) -> dict:
        values = [p for *_, p in selected]
        return {"p_gold": round(float(np.mean(values)), 4) if values else None, "n": len(values)}

    out = {"adapter": adapter, "step0_p_gold": mean([r for r in rows if r[1] == 0])}
    for condition in CONDITIONS:
        mine = [r for r in rows if r[0] == condition]
        out[condition] = {"late": mean([r for r in mine if r[1] in LATE]),
                          "per_step": {t: mean([r for r in mine if r[1] == t])["p_gold"] for t in range(1, 8)},
                          "late_by_category": {c: mean([r for r in mine if r[1] in LATE and r[2] == c])
                                               for c in ("none", "right", "wrong")}}
    return out


def verdict(results: dict, name: str) -> dict:
    """Addendum 58's reading, on model `name` (the H32 bootstrap)."""
    row = results[name]
    gold, reading = row["gold"]["late"]["p_gold"], row["verdict"]["late"]["p_gold"]
    if gold < 0.60:
        outcome = "ceiling"  # even gold-labelled examples of the query's class are not used
    elif round(reading - gold, 9) < -0.10:  # rounded: a gap exactly at 0.10 must not turn on a float's last bit
        outcome = "reading gap"  # the information is used as gold labels, not as verdicts
    else:
        outcome = "already read"
    return {"model": name, "gold_late": gold, "verdict_late": reading, "outcome": outcome,
            "rule": "ceiling if gold_late < 0.60; else reading gap if verdict_late < gold_late - 0.10; "
                    "else already read"}


def reading_check(results: dict, trained: str, start: str, gain: float = 0.10) -> dict:
    """Addendum 59's check L52: passed when `trained`'s verdict p(gold) on steps 4-7 is at least `start`'s + `gain`."""
    mine, theirs = results[trained]["verdict"]["late"]["p_gold"], results[start]["verdict"]["late"]["p_gold"]
    delta = round(mine - theirs, 9)  # rounded: a gain exactly at the threshold must not fail on a float's last bit
    return {"model": trained, "start": start, "verdict_late": mine, "start_verdict_late": theirs,
            "gain": round(delta, 4), "verdict": "passed" if delta >= gain else "failed",
            "rule": f"verdict_late({trained}) - verdict_late({start}) >= +{gain}"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapters", nargs="+", help="NAME=ADAPTER (ADAPTER: an adapter folder or 'base')")
    parser.add_argument("--tasks", type=int, default=64)
    parser.add_argument("--decide", default="bootstrap", help="the model whose numbers decide (addendum 58)")
    parser.add_argument("--check", metavar="TRAINED", help="addendum 59's check L52 on model TRAINED against the "
                        "--decide model (instead of addendum 58's reading)")
    parser.add_argument("--gain", type=float, default=0.10, help="--check's threshold (addendum 59: 0.10; "
                        "addendum 60's check L53: 0.08)")
    parser.add_argument("--layer", type=Path, action="append", default=[],
                        help="a config layer after check L50's (repeatable)")
    parser.add_argument("--split", choices=("val", "train"), default="val")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    from tasks.settings import load_config, with_overrides

    try:
        layers = [ROOT / layer for layer in LAYERS] + list(args.layer)
        config = with_overrides(load_config(layers), {"model.dtype": "float32"})
        tasks = stream_tasks(config, args.tasks, args.split)
        results: dict = {"tasks": args.tasks, "seed": SEED, "steps": len(tasks[0].queries), "split": args.split,
                         "layers": [str(layer) for layer in args.layer],
                         "sources": sorted({task.name for task in tasks}),
                         "labels": sorted({len(task.labels) for task in tasks})}
        for name, adapter in named_pairs(args.adapters):
            start = time.monotonic()
            results[name] = probe(config, adapter, tasks)
            results[name]["seconds"] = round(time.monotonic() - start, 1)
            print(f"== {name} done in {results[name]['seconds']} s", flush=True)
        if args.check:
            results["decision"] = reading_check(results, args.check, args.decide, args.gain)
        elif args.decide in results:
            results["decision"] = verdict(results, args.decide)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.output:
        atomic_write_json(args.output, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

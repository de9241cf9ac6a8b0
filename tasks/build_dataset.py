"""Stage `build_dataset`: ICRL episodes from the configured sources -> data.output_dir/{train,val}.jsonl, the
dataset card (card.json, card.md) and a few sample episodes (samples.md), all written atomically.

Every input is read and validated before anything is written: a bad episodes file (or task folder) fails with
a clear message and exit code 2, and leaves the previous outputs untouched.
"""

from __future__ import annotations

import time
from pathlib import Path

from icrl_core.errors import UserError
from tasks.settings import PipelineConfig

STAGE = "build_dataset"
HEADLINE = ("train_episodes", "val_episodes")  # metrics/build_dataset.json; the rest: the dataset card
N_SAMPLES = 3


def _progress(desc: str):
    from tqdm.auto import tqdm

    return lambda items: tqdm(items, desc=desc, unit="episode", leave=False)


def samples_markdown(episodes, tokens, max_tokens: int, train_exemplars: bool) -> str:
    """A few episodes as the model sees them; trained answer tokens are wrapped in [[ ]]."""
    from icrl_core.episodes import render_episode

    parts = ["# Sample episodes", "", "Rendered with the model's chat template; trained answer tokens in [[ ]]; "
             "each query's rejected answer below it.", ""]
    for episode in episodes:
        rendered = render_episode(episode, tokens, max_tokens, train_exemplars=train_exemplars)
        text, run, inside = [], [], False
        for token, trained in zip(rendered.input_ids, rendered.loss_mask):
            if bool(trained) != inside:
                text.append(tokens.decode(run) + ("[[" if trained else "]]"))
                run, inside = [], bool(trained)
            run.append(token)
        text.append(tokens.decode(run) + ("]]" if inside else ""))
        rejected = "; ".join(q.rejected_answer for q in episode.queries)
        parts += [f"## {episode.episode_id} ({episode.task_type or 'no task type'})", "", "```", "".join(text), "```",
                  "", f"rejected: {rejected}", ""]
    return "\n".join(parts)


def build(config: PipelineConfig) -> tuple[dict, dict[str, Path]]:
    """Build and write the dataset; return (metrics, written files)."""
    from icrl_core import dataset_build as db
    from icrl_core.chat import Tokens
    from icrl_core.episodes import write_episodes
    from icrl_core.io import atomic_write_json, atomic_write_text
    from icrl_core.tokenized import load_tokenizer

    data = config.data
    started = time.perf_counter()
    sources = db.resolve_sources(data, config.seed)  # raises before anything is written
    built = db.build_episodes(sources, data, config.seed, progress=_progress("build episodes"))
    extra: dict = {"sources": [{"name": s.name, "weight": s.weight} for s in sources]}
    policy = None
    if data.rejected == "model":
        from icrl_core.model import policy_from_config

        policy = policy_from_config(config.model, seed=config.seed)
        tokenizer = policy.tokenizer
    else:
        tokenizer = load_tokenizer(config.model.spec, config.model.cache_dir)
    tokens = Tokens(tokenizer)
    budget = db.apply_budget(built, tokens, data.episode_tokens, config.tokenize.train_exemplars,
                             progress=_progress("render"))
    if policy is not None:
        predictor = db.policy_predictor(policy, config.tokenize.train_exemplars)
        kept, stats = db.model_rejected_answers(budget.kept, sources, predictor)
        # a model-chosen rejected answer can be longer than the sampled one: apply the budget again
        again = db.apply_budget(kept, tokens, data.episode_tokens, config.tokenize.train_exemplars)
        budget = db.BudgetResult(again.kept, again.tokens, sorted(set(budget.shaved) | set(again.shaved)),
                                 budget.too_long + again.too_long)
        extra["model_rejected"] = stats
    if not budget.kept:
        raise UserError(f"no episode fits data.episode_tokens={data.episode_tokens}: "
                        + (budget.too_long[0] if budget.too_long else "no episodes were built"))
    card = db.dataset_card(budget, data, config.seed, config.model.spec, extra)
    by_split = db.group_by_split(budget.kept)
    out = Path(data.output_dir)
    files = {"train": out / "train.jsonl", "val": out / "val.jsonl", "card": out / "card.json",
             "card_md": out / "card.md", "samples": out / "samples.md"}
    for split in db.SPLITS:
        if by_split[split]:
            write_episodes(files[split], by_split[split])
        else:  # an empty split is an empty file
            atomic_write_text(files[split], "")
    atomic_write_json(files["card"], card)
    atomic_write_text(files["card_md"], db.card_markdown(card))
    sample_episodes = (by_split["train"] or by_split["val"])[:N_SAMPLES]
    atomic_write_text(files["samples"], samples_markdown(sample_episodes, tokens, data.episode_tokens,
                                                         config.tokenize.train_exemplars))
    metrics = {
        "episodes": card["episodes"], "train_episodes": card["splits"]["train"], "val_episodes": card["splits"]["val"],
        "queries": card["queries"], "tokens": card["tokens"]["total"], "mean_tokens": card["tokens"]["mean"],
        "max_tokens": card["tokens"]["max"], "shaved_episodes": card["shaved_episodes"],
        "dropped_too_long": card["dropped_too_long"], "seconds": round(time.perf_counter() - started, 2),
    }
    return metrics, files


def run(config: PipelineConfig) -> dict:
    from tasks.cli_common import console
    from tasks.runtime import write_stage_metrics
    from tasks.tracking import stage_run

    with stage_run(config, STAGE) as tracker:
        metrics, files = build(config)
        tracker.log_metrics(metrics)
        for key in ("card", "card_md", "samples"):
            tracker.log_artifact(files[key], "dataset")
    write_stage_metrics(STAGE, metrics, headline=HEADLINE)
    console(stderr=True).print(f"dataset: {metrics['train_episodes']} train + {metrics['val_episodes']} val "
                               f"episodes, {metrics['tokens']} tokens, {metrics['shaved_episodes']} shaved -> "
                               f"{files['train'].parent}")
    return metrics

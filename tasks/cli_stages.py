"""CLI commands of the pipeline stages: `icrl stage NAME` runs one stage from the config schema; `icrl adapt`
adapts to one request episode at test time."""

import importlib
from pathlib import Path
from typing import Annotated

import typer

from tasks.cli_common import INPUT_FILE, INPUT_FOLDER, OUTPUT_FILE, ParamsOpt, SetOpt, console, resolve_config


def run_stage(name: str, config) -> dict:
    """Run one stage of dvc.yaml (tasks/stages.py) in this process: `run(config)` of tasks/NAME.py; return its
    final metrics (also written to metrics/<name>.json)."""
    from icrl_core.task_data import register_task_templates
    from tasks.stages import check_stage_names, load_stages

    check_stage_names([name])
    stages = load_stages()
    register_task_templates(config.data)  # episodes of a task with its own prompt render with it
    module = importlib.import_module(stages[name].module)
    return module.run(config)


def register(app: typer.Typer) -> None:
    @app.command("stage")
    def stage(
        name: Annotated[str, typer.Argument(help="Stage to run: a stage of dvc.yaml, e.g. ppo.",
                                            show_default=False)],
        params: ParamsOpt = None,
        overrides: SetOpt = None,
    ) -> None:
        """Run one pipeline stage from the config: reads its inputs, writes its outputs atomically and
        metrics/NAME.json, logs to MLflow, and resumes from its last checkpoint if it was interrupted."""
        import json

        from tasks.stages import check_stage_names

        check_stage_names([name])  # before reading the config: a typo fails fast
        config = resolve_config(params, overrides)
        metrics = run_stage(name, config)
        console().print_json(json.dumps(metrics, default=str))

    @app.command("adapt")
    def adapt(
        episodes: Annotated[Path | None, typer.Argument(
            help="Episodes JSONL holding the request(s). Default: adapt.requests_file, else "
            "data.output_dir/val.jsonl.", show_default=False, **INPUT_FILE)] = None,
        episode_id: Annotated[str | None, typer.Option(
            "--episode-id", help="Adapt to the episode with this id (default: the first --count episodes).",
            show_default=False)] = None,
        count: Annotated[int, typer.Option(help="Number of episodes to adapt to, from the start of the file "
                                           "(ignored with --episode-id).", min=1)] = 1,
        adapter: Annotated[Path | None, typer.Option(
            help="Adapter folder to start from (never modified). Default: adapt.adapter, else "
            "ppo.output_dir/adapter if it exists, else model.init_adapter, else a fresh LoRA.",
            show_default=False, **INPUT_FOLDER)] = None,
        output: Annotated[Path | None, typer.Option(help="Also write the results as JSON to this file.",
                                                       show_default=False, **OUTPUT_FILE)] = None,
        params: ParamsOpt = None,
        overrides: SetOpt = None,
    ) -> None:
        """Test-time adaptation of one request episode: sample answers to its own exemplars held out one at a
        time, take a few LoRA steps on the best-scored ones (a temporary copy of the adapter), answer the real
        queries, and report the reward before and after. The base adapter is left untouched."""
        from rich.table import Table

        from icrl_core.adapt import adapt_and_answer
        from icrl_core.errors import UserError
        from icrl_core.io import atomic_write_json
        from tasks.adapt import (
            adapt_scorer,
            load_adapt_policy,
            load_requests,
            request_generator,
            start_adapter,
            start_digest,
            summarize,
        )
        from tasks.ppo import max_episode_tokens

        config = resolve_config(params, overrides)
        if adapter is not None:
            config = config.model_copy(update={"adapt": config.adapt.model_copy(update={"adapter": adapter})})
        requests = load_requests(config, episodes)
        if episode_id is not None:
            chosen = [(i, ep) for i, ep in enumerate(requests) if ep.episode_id == episode_id]
            if not chosen:
                raise UserError(f"no episode with id '{episode_id}' in the requests file")
        else:
            chosen = list(enumerate(requests))[:count]
        start = start_adapter(config)
        digest = start_digest(start)
        policy = load_adapt_policy(config, start)
        scorer = adapt_scorer(config)
        out = console()
        out.print(f"adapter: {start or 'fresh LoRA'}; {config.adapt.steps} LoRA steps on the best of "
                  f"{config.adapt.num_rollouts} rollouts per held-out exemplar")
        table = Table("episode", "reward before", "reward after", "answers before", "answers after",
                      "synthetic reward", "trained on")
        results = []
        for index, episode in chosen:
            result = adapt_and_answer(policy, episode, config.adapt, max_episode_tokens(config, policy),
                                      request_generator(config.seed, index), scorer).as_dict()
            results.append(result)
            table.add_row(result["episode_id"], f"{result['reward_before']:.2f}", f"{result['reward_after']:.2f}",
                          ", ".join(result["answers_before"]), ", ".join(result["answers_after"]),
                          f"{result['synthetic_reward']:.2f}", str(result["trained_on"]))
        out.print(table)
        unchanged = start_digest(start) == digest
        summary = {**summarize(results), "base_adapter_unchanged": unchanged}
        out.print(f"mean reward before {summary['mean_reward_before']:.3f} -> after "
                  f"{summary['mean_reward_after']:.3f}; base adapter unchanged: {unchanged}")
        if output is not None:
            atomic_write_json(output, {"summary": summary, "requests": results})

"""The `icrl` command line. Heavy libraries are imported inside commands so `icrl --help` stays fast.

Every command that reads the pipeline config takes repeatable `-c FILE` (alias `--params`; `@FILE` for short;
later files win) and repeatable `--set KEY=VALUE`; precedence is --set > ICRL_* environment > config files >
defaults (tasks/settings.py). User errors exit with code 2.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

import click
import typer
from typer._click import exceptions as typer_click

from icrl_core.errors import UserError
from tasks.env import apply_defaults

app = typer.Typer(
    name="icrl",
    help="Fine-tune language models to be better in-context reinforcement learners, and measure in-context RL.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
config_app = typer.Typer(help="Inspect the resolved configuration and its documentation.", no_args_is_help=True)
model_app = typer.Typer(help="Load, cache and query models.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(model_app, name="model")

from tasks.cli_common import (
    INPUT_FILE,
    INPUT_FOLDER,
    OUTPUT_FILE,
    OUTPUT_FOLDER,
    ParamsOpt,
    SetOpt,
    console,
    resolve_config,
)

CodeSplit = Enum("CodeSplit", {s: s for s in ("test", "train")}, type=str)


# ---------------------------------------------------------------------------------------------------------------


@app.command("validate-episodes")
def validate_episodes(
    file: Annotated[Path, typer.Argument(help="ICRL episodes JSONL file to check.", show_default=False,
                                         **INPUT_FILE)],
    max_tokens: Annotated[int | None, typer.Option(help="Also render every episode with the model's tokenizer "
                                                      "and check it fits this many tokens (shaving exemplars "
                                                      "from the front if needed).", min=32)] = None,
    model: Annotated[str, typer.Option(help="Model spec whose tokenizer renders episodes (with "
                                       "--max-tokens).")] = "smollm2-135m",
) -> None:
    """Check an episodes file: every bad line is listed as `path:line: reason`; exit code 2 if any.

    Checks: UTF-8, valid JSON object per line, required fields and their types, non-empty exemplars and
    queries, preferred != rejected, unique episode_id. Blank lines are skipped. With --max-tokens, also the
    token budget: shaved episodes are counted, episodes whose queries alone do not fit are errors."""
    from icrl_core.episodes import read_episodes

    episodes = read_episodes(file)
    out = console()
    out.print(f"{file}: {len(episodes)} episode(s), schema OK")
    if max_tokens is not None:
        from icrl_core.chat import Tokens
        from icrl_core.episodes import render_episodes
        from icrl_core.model import load_base_model

        _, tokenizer = load_base_model(model)
        report = render_episodes(episodes, Tokens(tokenizer), max_tokens)
        lengths = [len(r.input_ids) for r in report.rendered]
        if report.too_long:
            raise UserError("\n".join(report.too_long))
        out.print(f"{file}: all episodes fit {max_tokens} tokens ({report.shaved} shaved); tokens per episode "
                  f"min {min(lengths)}, mean {sum(lengths) / len(lengths):.0f}, max {max(lengths)}")


@app.command("tasks")
def list_tasks(
    names: Annotated[list[str] | None, typer.Argument(
        help="Tasks to show: names or task folder paths. Default: every task (built-in, the folders of "
        "data.tasks_dir, the data.sources and icrl_eval.task given as paths).", show_default=False)] = None,
    params: ParamsOpt = None,
    overrides: SetOpt = None,
) -> None:
    """List the classification tasks (real, unsemantic, your task folders, synthetic) with their label and example
    counts and prompt prefixes, and the code-task family (Python functions with hidden tests) per template, level
    and split. Tasks named on the command line: only those, and one that cannot be read is an error."""
    from rich.table import Table

    from icrl_core.task_data import available_tasks, is_task_path, load_task

    cfg = resolve_config(params, overrides)
    table = Table("task", "labels", "train", "test", "query prefix", "answer prefix")
    listed = names or available_tasks(cfg.data.tasks_dir) + [
        name for name in dict.fromkeys([*(s.name for s in cfg.data.sources if s.kind == "task"), cfg.icrl_eval.task])
        if is_task_path(name)]
    for name in listed:
        try:
            task = load_task(name, cfg.data.tasks_dir, seed=cfg.seed, prompt=cfg.data.prompt_of(name))
        except UserError as exc:
            if names:
                raise
            table.add_row(name, "-", "-", "-", str(exc)[:40], "")
            continue
        table.add_row(task.name if is_task_path(name) else name, str(len(task.labels)), str(len(task.train)),
                      str(len(task.test)), task.template.query_prefix, task.template.answer_prefix)
    console().print(table)
    if not names:
        console().print(_code_task_table(cfg.code.task_seed, cfg.code.variants))


def _code_task_table(seed: int, variants: int):
    from rich.markup import escape
    from rich.table import Table

    from icrl_core.code_tasks import code_tasks

    tasks = code_tasks(seed, variants)
    table = Table("code template", "family", "level", "split", "tasks", "example",
                  title=f"code_tasks: {len(tasks)} Python function tasks "
                  f"({sum(t.split == 'train' for t in tasks)} train, {sum(t.split == 'test' for t in tasks)} test; "
                  f"split by template; seed {seed})")
    by_template: dict[str, list] = {}
    for task in tasks:
        by_template.setdefault(task.template, []).append(task)
    for name, group in by_template.items():
        first = group[0]
        table.add_row(name, first.family, str(first.level), first.split, str(len(group)), escape(first.signature))
    return table


@app.command("code-eval")
def code_eval(
    adapter: Annotated[Path | None, typer.Option(help="Trained adapter folder to evaluate, e.g. "
                                                    "artifacts/ppo/adapter. Default: the base model (model.spec; "
                                                    "model.init_adapter is not applied).", show_default=False,
                                                    **INPUT_FOLDER)] = None,
    model: Annotated[str | None, typer.Option(help="Model spec (model.spec): smollm2-135m, tiny, a .gguf, a "
                                                 "folder or a HF id.", show_default=False)] = None,
    split: Annotated[CodeSplit | None, typer.Option(help="Tasks to evaluate (code.eval.split): test = the "
                                                       "held-out templates, train = the training ones.",
                                                       show_default=False)] = None,
    samples: Annotated[int | None, typer.Option(help="Completions per task, the n of pass@k "
                                                   "(code.eval.samples).", min=1, max=200,
                                                   show_default=False)] = None,
    k: Annotated[list[int] | None, typer.Option("--k", help="A k of pass@k, repeatable, each at most --samples "
                                                   "(code.eval.k).", min=1, max=200, show_default=False)] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature, 0 = greedy with one sample "
                                                         "(code.eval.temperature).", min=0, max=10,
                                                         show_default=False)] = None,
    tasks_per_level: Annotated[int | None, typer.Option(help="Tasks per difficulty level, a seeded sample "
                                                           "(code.eval.tasks_per_level; default all).", min=1,
                                                           max=1000, show_default=False)] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens per completion "
                                                          "(code.eval.max_new_tokens).", min=16, max=512,
                                                          show_default=False)] = None,
    batch_size: Annotated[int | None, typer.Option(help="Completions generated together "
                                                      "(code.eval.batch_size).", min=1, max=256,
                                                      show_default=False)] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the task sample and the sampling (seed).",
                                                show_default=False)] = None,
    threads: Annotated[int, typer.Option(help="torch CPU threads (0 = torch's default).", min=0, max=256)] = 0,
    output: Annotated[Path | None, typer.Option(help="JSON file to write (code.eval.output).",
                                                   show_default=False, **OUTPUT_FILE)] = None,
    params: ParamsOpt = None,
    overrides: SetOpt = None,
) -> None:
    """pass@1 and pass@k (the unbiased estimator of Chen et al., 2021: 1 - C(n-c, k) / C(n, k) from n samples
    of which c pass every test) on held-out code tasks, per difficulty level and overall, for the base model or
    an adapter; each completion runs against its task's hidden tests in the sandbox. Writes JSON
    (docs/CODE_RL.md)."""
    from rich.table import Table

    from tasks.code_eval import run_code_eval

    if temperature == 0 and samples is None:
        samples = 1  # greedy: one completion per task
    flags = {"split": split.value if split is not None else None, "samples": samples, "k": k,
             "temperature": temperature, "tasks_per_level": tasks_per_level, "max_new_tokens": max_new_tokens,
             "batch_size": batch_size, "output": None if output is None else str(output)}
    extra: dict = {"code": {"eval": {key: value for key, value in flags.items() if value is not None}}}
    if model is not None:
        extra["model"] = {"spec": model}
    if seed is not None:
        extra["seed"] = seed
    config = resolve_config(params, overrides, extra=extra)
    out = console()
    result = run_code_eval(config, adapter, threads, echo=out.print)
    ks = result["k"]
    table = Table("level", "tasks", *(f"pass@{k}" for k in ks), "test pass fraction", "reward",
                  title=f"{result['model']} + {result['adapter'] or 'no adapter'} on the {result['split']} split "
                  f"({result['samples']} sample(s) per task, {result['decoding']})")
    for name, row in [*result["levels"].items(), ("overall", result["overall"])]:
        table.add_row(name, str(row["tasks"]), *(f"{row[f'pass_at_{k}']:.3f}" for k in ks),
                      f"{row['mean_pass_fraction']:.3f}", f"{row['mean_reward']:.3f}")
    out.print(table)
    out.print(f"wrote {config.code.eval.output} ({result['seconds']} s, sandbox isolation {result['isolation']})")


@config_app.command("show")
def config_show(
    params: ParamsOpt = None,
    overrides: SetOpt = None,
    origin: Annotated[bool, typer.Option("--origin", help="Print every key on its own line with the file, "
                                         "ICRL_* variable or --set item it came from (or `default`).")] = False,
) -> None:
    """Print the resolved configuration as YAML (defaults < config files in order < ICRL_* env < --set)."""
    import yaml

    if origin:
        from tasks.cli_common import config_files
        from tasks.settings import resolve

        typer.echo(resolve(config_files(params), overrides or []).origin_lines(), nl=False)
        return
    cfg = resolve_config(params, overrides)
    typer.echo(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), nl=False)


@config_app.command("docs")
def config_docs(
    output: Annotated[Path | None, typer.Option(help="Write the Markdown here instead of stdout.",
                                                   **OUTPUT_FILE)] = None,
) -> None:
    """Print every config key with its default and description (Markdown), generated from the schema."""
    from icrl_core.io import atomic_write_text
    from tasks.settings import config_reference

    text = config_reference()
    if output:
        atomic_write_text(output, text)
    else:
        typer.echo(text, nl=False)


@model_app.command("warm")
def model_warm(
    spec: Annotated[str, typer.Option(help="Model spec to load (and cache, for GGUF specs).")] = "smollm2-135m",
) -> None:
    """Load a model once so its dequantized copy is cached; print load times (first vs cached)."""
    import time

    from icrl_core.model import load_policy

    started = time.perf_counter()
    policy = load_policy(spec)
    first = time.perf_counter() - started
    started = time.perf_counter()
    load_policy(spec)
    second = time.perf_counter() - started
    n_params = sum(p.numel() for p in policy.model.parameters())
    console().print(f"{spec}: {n_params / 1e6:.1f}M parameters; load {first:.2f}s, again {second:.2f}s")


@model_app.command("interpolate")
def model_interpolate(
    adapter: Annotated[Path, typer.Argument(help="Trained adapter folder (see docs/FORMATS.md).",
                                            show_default=False, **INPUT_FOLDER)],
    scale: Annotated[float, typer.Option(help="Keep this fraction of the change training made: the weights "
                                         "become base + scale * (trained - base) (WiSE-FT). 0 = the base model, "
                                         "1 = the adapter unchanged.", min=0.0, max=1.0)],
    output: Annotated[Path, typer.Option(help="Folder for the interpolated adapter (written atomically).",
                                         show_default=False, **OUTPUT_FOLDER)],
    spec: Annotated[str | None, typer.Option(help="Base model spec the adapter was trained on (default: the one "
                                                "the adapter folder names); a LoRA adapter in PEFT's files is "
                                                "scaled in its files and needs none.")] = None,
) -> None:
    """Interpolate a trained adapter toward the base model (as evaluate.adapter_scale does in the pipeline)."""
    from icrl_core.adapter_format import require_adapter
    from icrl_core.adapter_tools import interpolate_adapter, policy_for_adapter

    interpolate_adapter(require_adapter(adapter, "adapter"), scale, output, lambda: policy_for_adapter(adapter, spec))
    console().print(f"{output}: base + {scale:g} x ({adapter} - base)")


@model_app.command("extrapolate")
def model_extrapolate(
    start: Annotated[Path, typer.Argument(help="The adapter the stage started from (e.g. the bootstrap's).",
                                          show_default=False, **INPUT_FOLDER)],
    trained: Annotated[Path, typer.Argument(help="The adapter that stage wrote by continuing `start` (same LoRA "
                                            "rank, alpha and modules).", show_default=False, **INPUT_FOLDER)],
    scale: Annotated[float, typer.Option(help="How many times to take the step from start to trained: the "
                                         "weights become start + scale * (trained - start). 1 = trained, > 1 "
                                         "goes past it (ExPO).", min=0.0, max=10.0)],
    output: Annotated[Path, typer.Option(help="Folder for the extrapolated adapter, a PEFT LoRA of twice the rank "
                                         "(written atomically).", show_default=False, **OUTPUT_FOLDER)],
) -> None:
    """Extrapolate the step a fine-tuning stage took from one adapter to another (exact, as a LoRA of rank 2r)."""
    from icrl_core.adapter_format import require_adapter
    from icrl_core.adapter_tools import extrapolate_adapter

    extrapolate_adapter(require_adapter(start, "start"), require_adapter(trained, "trained"), scale, output)
    console().print(f"{output}: {start} + {scale:g} x ({trained} - {start})")


@model_app.command("combine")
def model_combine(
    adapters: Annotated[list[Path], typer.Argument(help="Two or more LoRA adapter folders of one base model, in PEFT's "
                                                   "files, with one alpha / r.", show_default=False, **INPUT_FOLDER)],
    weight: Annotated[list[float], typer.Option(help="One weight per adapter, in their order, summing to 1 (equal "
                                                "weights: a model soup; 1, 1, -1: task arithmetic, A + B - start).",
                                                show_default=False)],
    output: Annotated[Path, typer.Option(help="Folder for the combined adapter, a PEFT LoRA whose rank is the sum of "
                                         "theirs (written atomically).", show_default=False, **OUTPUT_FOLDER)],
) -> None:
    """Combine LoRA adapters into one: sum of weight x adapter, exact (soups, task arithmetic)."""
    from icrl_core.adapter_format import require_adapter
    from icrl_core.adapter_tools import combine_adapters

    combine_adapters([require_adapter(folder, f"adapter {i + 1}") for i, folder in enumerate(adapters)], weight,
                     output)
    console().print(f"{output}: " + " + ".join(f"{w:g} x {folder}" for w, folder in zip(weight, adapters)))


@model_app.command("convert")
def model_convert(
    adapter: Annotated[Path, typer.Argument(help="Adapter folder in the old layout (adapter.safetensors + "
                                            "adapter.json) or a plain PEFT LoRA folder.", show_default=False,
                                            **INPUT_FOLDER)],
    output: Annotated[Path | None, typer.Option(help="Write here instead of replacing the folder in place.",
                                                   **OUTPUT_FOLDER)]
    = None,
    spec: Annotated[str | None, typer.Option(help="Base model spec, if the folder does not name it.")] = None,
) -> None:
    """Rewrite a saved adapter in the current format (PEFT's own files for LoRA; docs/FORMATS.md)."""
    from icrl_core.adapter_format import require_adapter
    from icrl_core.adapter_tools import convert_adapter

    target = convert_adapter(require_adapter(adapter, "adapter"), output, spec)
    console().print(f"{target}: adapter in the current format")


@model_app.command("export")
def model_export(
    adapter: Annotated[Path, typer.Argument(help="Trained adapter folder.", show_default=False, **INPUT_FOLDER)],
    output: Annotated[Path, typer.Option(help="Folder to write (atomically).", show_default=False,
                                         **OUTPUT_FOLDER)],
    merge: Annotated[bool, typer.Option("--merge", help="Merge the adapter into the base weights and write a "
                                        "transformers model folder (AutoModelForCausalLM.from_pretrained loads "
                                        "it). Without it, the adapter is written in the current format.")]
    = False,
    spec: Annotated[str | None, typer.Option(help="Base model spec, if the folder does not name it.")] = None,
    dtype: Annotated[str, typer.Option(help="Weights dtype of the merged model: float32 or bfloat16.")]
    = "float32",
) -> None:
    """Export a trained adapter: merged into a standalone model folder (--merge), or as a PEFT adapter folder."""
    from icrl_core.adapter_format import require_adapter
    from icrl_core.adapter_tools import convert_adapter, export_merged
    from icrl_core.model import resolve_dtype

    require_adapter(adapter, "adapter")
    if merge:
        export_merged(adapter, output, spec, resolve_dtype(dtype))
        console().print(f"{output}: merged model (load with AutoModelForCausalLM.from_pretrained)")
    else:
        convert_adapter(adapter, output, spec)
        console().print(f"{output}: adapter (load with peft.PeftModel.from_pretrained)")


@model_app.command("ask")
def model_ask(
    question: Annotated[str, typer.Argument(help="A question for the model (one user turn).")],
    spec: Annotated[str, typer.Option(help="Model spec.")] = "smollm2-135m",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to generate.", min=1)] = 48,
) -> None:
    """Answer one question greedily (a quick check that a model loads and works)."""
    from icrl_core.generation import greedy_chat_answer
    from icrl_core.model import load_policy

    policy = load_policy(spec)
    typer.echo(greedy_chat_answer(policy, question, max_new_tokens=max_new_tokens))


@app.command("demo")
def demo(
    quick: Annotated[bool, typer.Option("--quick", help="Only in-context RL with the base model on keyword_map "
                                        "(about 2 minutes), not the whole pipeline.")] = False,
) -> None:
    """The main job on the embedded defaults: the whole pipeline (`icrl pipeline`: dataset -> tokenize ->
    bootstrap -> reward model -> PPO -> adapt -> evaluate -> promote, through Prefect, DVC, Ray and MLflow) with
    SmolLM2-135M + LoRA on the synthetic keyword_map task, then a summary of what it measured."""
    if quick:
        from tasks.icrl_eval import run_demo

        run_demo(console())
        return
    from flows.cli import run_pipeline_with_summary

    run_pipeline_with_summary(console())


def _register_subcommands() -> None:
    # Each area adds its commands from its own module.
    from tasks import cli_eval, cli_stages

    cli_eval.register(app)
    cli_stages.register(app)
    try:
        from flows import cli as flows_cli
    except ImportError:  # flows are optional at import time only if prefect is missing
        return
    flows_cli.register(app)


_register_subcommands()


# typer >= 0.29 vendors its own copy of click (typer._click): its exceptions are not click's, so both are caught.
_EXIT = (click.exceptions.Exit, typer.Exit)
_ABORT = (click.exceptions.Abort, typer.Abort)
_USAGE = (click.ClickException, typer_click.ClickException)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; every user error ends as one message on stderr and exit code 2 (a usage error of the
    parser, a `UserError` of a command), Ctrl-C as exit 130."""
    from tasks.cli_common import expand_at_files

    apply_defaults()
    try:
        result = app(args=expand_at_files(sys.argv[1:] if argv is None else argv), prog_name="icrl",
                     standalone_mode=False)
    except _EXIT as exc:
        sys.exit(exc.exit_code)
    except (*_ABORT, KeyboardInterrupt):
        console(stderr=True).print("aborted")
        sys.exit(130)
    except _USAGE as exc:
        # typer checks values with pydantic, whose messages start with "Value error, "
        exc.message = exc.message.removeprefix("Value error, ").replace(": Value error, ", ": ")
        exc.show()
        sys.exit(exc.exit_code)
    except UserError as exc:
        from rich.text import Text

        console(stderr=True).print(Text("error: ", style="bold red") + Text(str(exc)), soft_wrap=True)
        sys.exit(exc.exit_code)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()

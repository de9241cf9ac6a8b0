"""CLI commands of the in-context RL evaluation harness: `icrl eval`, `icrl max-examples`, `icrl count-tokens`,
`icrl inspect`, `icrl plot`, `icrl probe-feedback`, `icrl probe-closure`, `icrl redact`, `icrl check-text`. Each `icrl eval` flag sets one `icrl_eval.*` (or `model.*`) config key; `--set` can
set any key."""

import json
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from icrl_core.config import PAPER_STRATEGIES, STRATEGY_NAMES
from tasks.cli_common import (
    INPUT_FOLDER,
    INPUT_PATH,
    OUTPUT_FILE,
    OUTPUT_FOLDER,
    ParamsOpt,
    SetOpt,
    console,
    resolve_config,
)

Strategy = Enum("Strategy", {s: s for s in (*STRATEGY_NAMES, *PAPER_STRATEGIES)}, type=str)  # the config maps the
# paper's names (icrl_core.config.PAPER_STRATEGIES) to the project's
Sampling = Enum("Sampling", {s: s for s in ("uniform", "likelihood")}, type=str)
Source = Enum("Source", {s: s for s in ("dir", "hub", "disk")}, type=str)
Dtype = Enum("Dtype", {s: s for s in ("float32", "bfloat16", "auto")}, type=str)


def _flag_overrides(**flags) -> dict:
    """Nested config tree from the flags that were given (None = not given)."""
    keys = {"model": "model.spec", "dtype": "model.dtype", "tracking": "tracking.enabled",
            "tasks_dir": "data.tasks_dir", "adapter": "model.init_adapter"}
    tree: dict = {}
    for name, value in flags.items():
        if value is None:
            continue
        if isinstance(value, Enum):
            value = value.value
        if isinstance(value, Path):
            value = str(value)
        section, key = keys.get(name, f"icrl_eval.{name}").split(".")
        tree.setdefault(section, {})[key] = value
    return tree


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_command(
        task: Annotated[str | None, typer.Option(help="Task (see `icrl tasks`): banking77, clinc150, "
                                                    "trec_coarse, trec_fine, nlu, <task>_unsemantic, keyword_map, "
                                                    "modular_sum.", show_default=False)] = None,
        strategy: Annotated[Strategy | None, typer.Option(help="Context strategy (the paper's "
                                                              "--context_strategy_name).", show_default=False)] = None,
        temperature: Annotated[float | None, typer.Option(help="Sampling temperature of constrained decoding "
                                                             "(0 = greedy).", min=0, show_default=False)] = None,
        test_temperature: Annotated[float | None, typer.Option(help="Temperature of the test predictions only "
                                                                  "(0 = greedy). Default: --temperature.", min=0,
                                                                  show_default=False)] = None,
        p_keep: Annotated[float | None, typer.Option(help="Probability of keeping a past episode, for the "
                                                        "strategy that runs (the paper's --context_p_keep). "
                                                        "Default: 0.1 for explorative and approximate, 1.0 for "
                                                        "naive, naive_plus and icl (icrl_eval.p_keep).",
                                                        min=0, max=1, show_default=False)] = None,
        max_examples: Annotated[int | None, typer.Option(help="Cap on in-context episodes (the paper's "
                                                            "--max_context_examples). Default: computed from the "
                                                            "context window.", min=0, show_default=False)] = None,
        context_window: Annotated[int | None, typer.Option(help="Window the prompts must fit when the cap is "
                                                              "computed. Default: the model's.", min=64,
                                                              show_default=False)] = None,
        icrl: Annotated[bool | None, typer.Option("--icrl/--no-icrl", help="In-context RL (own predictions + "
                                                     "rewards) or supervised ICL (gold labels). Default: ICL for "
                                                     "--strategy icl, else ICRL.", show_default=False)] = None,
        omit_feedback: Annotated[bool | None, typer.Option("--omit-feedback/--no-omit-feedback",
                                                              help="Leave reward feedback out of the context (the "
                                                              "paper's --icrl_omit_feedback).",
                                                              show_default=False)] = None,
        flip_feedback_prob: Annotated[float | None, typer.Option(help="Flip the feedback shown in context with "
                                                                    "this probability (the paper's "
                                                                    "--icrl_flip_feedback + prob; 0 = off).",
                                                                    min=0, max=1, show_default=False)] = None,
        max_contexts: Annotated[int | None, typer.Option(help="Contexts kept by the approximate strategy.",
                                                            min=1, show_default=False)] = None,
        approximate_sampling: Annotated[Sampling | None, typer.Option(help="How the approximate strategy "
                                                                         "picks a context: uniform or likelihood "
                                                                         "(the paper's 'exact').",
                                                                         show_default=False)] = None,
        train_k: Annotated[int | None, typer.Option(help="Training steps.", min=1, show_default=False)] = None,
        test_every: Annotated[int | None, typer.Option(help="Test at step 0, whenever (step+1) % N == 0, and "
                                                          "at the last step.", min=1, show_default=False)] = None,
        test_k: Annotated[int | None, typer.Option(help="Test queries per evaluation.", min=1,
                                                      show_default=False)] = None,
        seed: Annotated[int | None, typer.Option(help="Seed of decoding, context sampling and flips.",
                                                    show_default=False)] = None,
        training_seed: Annotated[int | None, typer.Option(help="Seed of the training query order.",
                                                             show_default=False)] = None,
        test_seed: Annotated[int | None, typer.Option(help="Seed of the test query selection.",
                                                         show_default=False)] = None,
        debug_k: Annotated[int | None, typer.Option(help="Print the full prompt of the first k steps.", min=0,
                                                       show_default=False)] = None,
        source: Annotated[Source | None, typer.Option(help="Where real task data comes from: dir "
                                                         "(data.tasks_dir), hub (Hugging Face), disk "
                                                         "(--disk-path).", show_default=False)] = None,
        disk_path: Annotated[Path | None, typer.Option(help="With --source disk: a DatasetDict saved with "
                                                          "save_to_disk.", show_default=False,
                                                          **INPUT_FOLDER)] = None,
        tasks_dir: Annotated[Path | None, typer.Option(help="Folder of the task folders (data.tasks_dir).",
                                                          show_default=False, **INPUT_FOLDER)] = None,
        model: Annotated[str | None, typer.Option(help="Model spec (model.spec): smollm2-135m, tiny, a .gguf, "
                                                     "a folder or a HF id.", show_default=False)] = None,
        adapter: Annotated[Path | None, typer.Option(help="Trained adapter folder to evaluate on the model "
                                                        "(model.init_adapter), e.g. artifacts/ppo/adapter. "
                                                        "Default: the base model.", show_default=False,
                                                        **INPUT_FOLDER)] = None,
        dtype: Annotated[Dtype | None, typer.Option(help="Weight dtype: float32 is exact; bfloat16 is faster only "
                                                       "on CPUs with AMX/AVX512-BF16; auto picks.",
                                                       show_default=False)] = None,
        reuse_cache: Annotated[bool | None, typer.Option("--reuse-cache/--no-reuse-cache",
                                                            help="Reuse KV caches of shared prefixes (exact); "
                                                            "--no-reuse-cache recomputes every prompt.",
                                                            show_default=False)] = None,
        threads: Annotated[int | None, typer.Option(help="torch CPU threads (0 = default).", min=0,
                                                       show_default=False)] = None,
        run_name: Annotated[str | None, typer.Option(help="Run folder name under icrl_eval.output_dir "
                                                        "(default <task>-<strategy>-seed<seed>).",
                                                        show_default=False)] = None,
        output_dir: Annotated[Path | None, typer.Option(help="Parent folder of run folders.",
                                                           show_default=False, **OUTPUT_FOLDER)] = None,
        tracking: Annotated[bool | None, typer.Option("--tracking/--no-tracking", help="Log to MLflow "
                                                         "(tracking.enabled).", show_default=False)] = None,
        resume: Annotated[bool, typer.Option("--resume", help="Continue the run folder of a killed run from its "
                                             "last logged step.")] = False,
        progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
        params: ParamsOpt = None,
        overrides: SetOpt = None,
    ) -> None:
        """Measure in-context RL (Monea et al., 2024): each step the model answers a training query with
        constrained decoding, is rewarded, and the episode joins its history; test accuracy is measured at step
        0, every --test-every steps and at the end. Writes a run folder (steps.jsonl, tests.jsonl,
        metrics.json, learning_curve.png) and logs to MLflow."""
        from tasks.icrl_eval import evaluate

        extra = _flag_overrides(
            task=task, strategy=strategy, temperature=temperature, test_temperature=test_temperature,
            p_keep=None if p_keep is None else {name: p_keep for name in STRATEGY_NAMES if name != "zero_shot"},
            max_examples=max_examples, context_window=context_window, icrl=icrl, omit_feedback=omit_feedback,
            flip_feedback_prob=flip_feedback_prob, max_contexts=max_contexts,
            approximate_sampling=approximate_sampling, train_k=train_k, test_every=test_every, test_k=test_k,
            seed=seed, training_seed=training_seed, test_seed=test_seed, debug_k=debug_k, source=source,
            disk_path=disk_path, tasks_dir=tasks_dir, model=model, adapter=adapter, dtype=dtype,
            reuse_cache=reuse_cache,
            threads=threads, run_name=run_name, output_dir=output_dir, tracking=tracking)
        config = resolve_config(params, overrides, extra=extra)
        out = console()

        def show_test(record: dict) -> None:
            out.print(f"step {record['step']:>6}: test accuracy {record['accuracy']:.3f} "
                      f"({record['seconds']:.1f}s, context {record['context_size']} episodes)")

        def echo(text: str) -> None:  # prompts verbatim: no wrapping, no rich markup
            out.print(text, soft_wrap=True, markup=False, highlight=False)

        metrics = evaluate(config, resume=resume, progress=progress, echo=echo, on_test=show_test)
        _print_summary(metrics)

    @app.command("max-examples")
    def max_examples_command(
        task: Annotated[str | None, typer.Option(help="Task (default: icrl_eval.task).",
                                                    show_default=False)] = None,
        model: Annotated[str | None, typer.Option(help="Model spec whose tokenizer and window are used "
                                                     "(default: model.spec).", show_default=False)] = None,
        window: Annotated[int | None, typer.Option(help="Token window (default: icrl_eval.context_window, "
                                                      "else the model's).", min=64, show_default=False)] = None,
        icrl: Annotated[bool | None, typer.Option("--icrl/--no-icrl", help="Count ICRL episodes (prediction + "
                                                     "feedback) or supervised ones (gold answer only).",
                                                     show_default=False)] = None,
        omit_feedback: Annotated[bool | None, typer.Option("--omit-feedback/--no-omit-feedback",
                                                              help="ICRL episodes without the feedback turn.",
                                                              show_default=False)] = None,
        tasks_dir: Annotated[Path | None, typer.Option(help="Folder of the task folders (data.tasks_dir).",
                                                          show_default=False, **INPUT_FOLDER)] = None,
        params: ParamsOpt = None,
        overrides: SetOpt = None,
    ) -> None:
        """How many in-context episodes fit the model's context window (the paper's
        find_max_examples_given_max_window): binary search on n so that n of the longest queries, each with the
        longest label and feedback, plus the longest query and answer, fit the window."""
        from icrl_core.icrl_eval import is_supervised, max_context_examples, show_for
        from tasks.icrl_eval import load_eval_task, load_tokens_and_window

        extra = _flag_overrides(task=task, model=model, icrl=icrl, omit_feedback=omit_feedback, tasks_dir=tasks_dir)
        config = resolve_config(params, overrides, extra=extra)
        cfg = config.icrl_eval
        task_obj = load_eval_task(config)  # before the tokenizer: a bad task fails fast
        tokens, model_window = load_tokens_and_window(config.model.spec, config.model.cache_dir)
        size = window or cfg.context_window or model_window
        n = max_context_examples(task_obj, tokens, show_for(cfg), size)
        mode = ("supervised ICL" if is_supervised(cfg) else
                "ICRL without feedback" if cfg.omit_feedback else "ICRL")
        console().print(f"{task_obj.name} with {config.model.spec} ({mode}): {n} in-context episodes fit a "
                        f"{size}-token window")
        typer.echo(n)

    @app.command("count-tokens")
    def count_tokens_command(
        run_dirs: Annotated[list[Path], typer.Argument(help="Run folders of `icrl eval`.", show_default=False,
                                                       **INPUT_FOLDER)],
    ) -> None:
        """Tokens each run fed through the model (with key/value reuse) and what recomputing every prompt would
        have fed (the paper's run_count_tokens.py counts the same thing)."""
        from rich.table import Table

        from tasks.icrl_eval import count_tokens

        table = Table("run", "steps", "tokens computed", "per step", "prompt tokens (no reuse)", "reuse factor")
        for run_dir in run_dirs:
            c = count_tokens(run_dir)
            table.add_row(run_dir.name, str(c["steps"]), f"{c['tokens_computed']:,}", f"{c['tokens_per_step']:.0f}",
                          f"{c['prompt_tokens']:,}", f"{c['reuse_factor']:.1f}x")
        console().print(table)

    @app.command("inspect")
    def inspect_command(
        run_dir: Annotated[Path, typer.Argument(help="Run folder of `icrl eval`.", show_default=False,
                                                **INPUT_FOLDER)],
        window: Annotated[int, typer.Option(min=1, help="Training steps per row of the table.")] = 250,
        as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON instead of tables.")] = False,
    ) -> None:
        """How a run behaved, to tell learning from collapse: per window of training steps the accuracy, the
        labels predicted and rewarded, how often an answer after wrong feedback repeats the last one (near 1:
        copying whatever the reward), the mean probability of the sampled answer (near 1: no exploration left)
        and the context size; per evaluation the test accuracy and the labels of the test answers."""
        from rich.table import Table

        from tasks.icrl_eval import inspect_run

        report = inspect_run(run_dir, window)
        if as_json:
            typer.echo(json.dumps(report, indent=2))
            return

        def counts(c: dict) -> str:
            return ", ".join(f"{label} {n}" for label, n in c.items()) or "-"

        train = Table("steps", "accuracy", "predicted", "rewarded", "top label share", "repeat after wrong",
                      "answer prob", "context episodes", title=f"{run_dir.name}: training stream")
        for w in report["windows"]:
            prob = "-" if w["mean_answer_prob"] is None else f"{w['mean_answer_prob']:.2f}"
            repeat = "-" if w["repeat_after_wrong"] is None else f"{w['repeat_after_wrong']:.2f}"
            train.add_row(f"{w['first_step']}-{w['last_step']}", f"{w['accuracy']:.3f}", counts(w["predictions"]),
                          counts(w["rewarded"]), f"{w['top_share']:.2f}", repeat, prob,
                          f"{w['mean_context_episodes']:.1f}")
        test = Table("step", "accuracy", "context episodes", "test answers", "top label share",
                     title=f"{run_dir.name}: evaluations")
        for e in report["evaluations"]:
            share = "-" if e["top_share"] is None else f"{e['top_share']:.2f}"
            test.add_row(str(e["step"]), f"{e['accuracy']:.3f}", str(e["context_size"]), counts(e["predictions"]),
                         share)
        out = console()
        if report["windows"]:
            out.print(train)
        out.print(test)

    @app.command("probe-feedback")
    def probe_feedback_command(
        target: Annotated[str, typer.Option(help="The label every past attempt in context gives (for trec_coarse "
                                            "`entity`, the label naive in-context RL collapses onto).",
                                            show_default=False)],
        task: Annotated[str | None, typer.Option(help="Task (default: icrl_eval.task).",
                                                    show_default=False)] = None,
        attempts: Annotated[list[int] | None, typer.Option(help="Past attempts in context, repeatable "
                                                              "(default 1 and 4; n = 0 is always measured).",
                                                              min=1, show_default=False)] = None,
        queries: Annotated[int, typer.Option(help="Test queries whose gold label is not --target.", min=1)] = 40,
        adapter: Annotated[Path | None, typer.Option(help="Trained adapter folder to load on the model "
                                                        "(model.init_adapter). Default: the base model.",
                                                        show_default=False, **INPUT_FOLDER)] = None,
        seed: Annotated[int | None, typer.Option(help="Seed of the query and past-attempt choice "
                                                    "(icrl_eval.seed).", show_default=False)] = None,
        tasks_dir: Annotated[Path | None, typer.Option(help="Folder of the task folders (data.tasks_dir).",
                                                          show_default=False, **INPUT_FOLDER)] = None,
        model: Annotated[str | None, typer.Option(help="Model spec (model.spec).", show_default=False)] = None,
        dtype: Annotated[Dtype | None, typer.Option(help="Weight dtype (model.dtype).",
                                                       show_default=False)] = None,
        threads: Annotated[int | None, typer.Option(help="torch CPU threads (0 = default).", min=0,
                                                       show_default=False)] = None,
        output: Annotated[Path | None, typer.Option(help="JSON file for the result (written atomically).",
                                                       show_default=False, **OUTPUT_FILE)] = None,
        progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
        params: ParamsOpt = None,
        overrides: SetOpt = None,
    ) -> None:
        """Does the model read the reward feedback in its context? For test queries whose gold label is not
        TARGET, a context of n past attempts all answered TARGET is shown all marked wrong and all marked right;
        the probe reports p(TARGET) under the harness's constrained decoding (temperature 1) in both, and the
        feedback effect p(right) - p(wrong). Near 0: the model copies its past answers whatever the feedback
        says, which is how naive in-context RL collapses onto one label. Minutes, not the hour a naive run
        takes."""
        from rich.table import Table

        from tasks.icrl_eval import probe_feedback

        extra = _flag_overrides(task=task, seed=seed, tasks_dir=tasks_dir, model=model, adapter=adapter,
                                dtype=dtype, threads=threads)
        config = resolve_config(params, overrides, extra=extra)
        result = probe_feedback(config, target, attempts or [1, 4], queries, output=output, progress=progress)
        table = Table("context", f"p({target})", "p(gold)")
        for name, row in result["conditions"].items():
            table.add_row(name, f"{row['p_target']:.3f}", f"{row['p_gold']:.3f}")
        out = console()
        out.print(table)
        out.print("feedback effect p(right) - p(wrong) [95% interval over queries]: " + ", ".join(
            f"n={n}: {effect:+.3f} [{result['feedback_effect_ci95'][n][0]:+.3f}, "
            f"{result['feedback_effect_ci95'][n][1]:+.3f}]" for n, effect in result["feedback_effect"].items()))
        out.print("p(gold) after attempts marked wrong - p(gold) without context [95% interval]: " + ", ".join(
            f"n={n}: {gain:+.3f} [{result['gold_after_wrong_ci95'][n][0]:+.3f}, "
            f"{result['gold_after_wrong_ci95'][n][1]:+.3f}]" for n, gain in result["gold_after_wrong"].items()))
        if output is not None:
            out.print(f"wrote {output}")

    @app.command("probe-closure")
    def probe_closure_command(
        task: Annotated[str | None, typer.Option(help="Task (default: icrl_eval.task).",
                                                    show_default=False)] = None,
        queries: Annotated[int, typer.Option(help="Probe queries per label (training examples).", min=1)] = 20,
        episodes: Annotated[int, typer.Option(help="Rewarded episodes in each context.", min=1)] = 20,
        adapter: Annotated[Path | None, typer.Option(help="Trained adapter folder to load on the model "
                                                        "(model.init_adapter). Default: the base model.",
                                                        show_default=False, **INPUT_FOLDER)] = None,
        seed: Annotated[int | None, typer.Option(help="Seed of the queries' and contexts' draws "
                                                    "(icrl_eval.seed).", show_default=False)] = None,
        tasks_dir: Annotated[Path | None, typer.Option(help="Folder of the task folders (data.tasks_dir).",
                                                          show_default=False, **INPUT_FOLDER)] = None,
        model: Annotated[str | None, typer.Option(help="Model spec (model.spec).", show_default=False)] = None,
        dtype: Annotated[Dtype | None, typer.Option(help="Weight dtype (model.dtype).",
                                                       show_default=False)] = None,
        threads: Annotated[int | None, typer.Option(help="torch CPU threads (0 = default).", min=0,
                                                       show_default=False)] = None,
        output: Annotated[Path | None, typer.Option(help="JSON file for the result (written atomically).",
                                                       show_default=False, **OUTPUT_FILE)] = None,
        progress: Annotated[bool, typer.Option("--progress/--no-progress", help="Show a progress bar.")] = True,
        params: ParamsOpt = None,
        overrides: SetOpt = None,
    ) -> None:
        """Does the model answer a label its context lacks? For each label X and training queries of X, a
        context of rewarded episodes of the other labels is shown (the explorative view); the probe reports
        p(X) there (absent recall), with one episode of X in the context (present recall), and p(X) for queries
        of other labels (false alarm), under the harness's constrained decoding (temperature 1). Absent recall
        near the false alarm: the model is closed over its context's labels, so explorative in-context RL never
        finds the labels its context lacks (docs/EVAL.md)."""
        from rich.table import Table

        from tasks.icrl_eval import probe_closure

        extra = _flag_overrides(task=task, seed=seed, tasks_dir=tasks_dir, model=model, adapter=adapter,
                                dtype=dtype, threads=threads)
        config = resolve_config(params, overrides, extra=extra)
        result = probe_closure(config, queries, episodes, output=output, progress=progress)
        table = Table("label", "absent recall", "present recall", "false alarm")
        for label, row in result["labels"].items():
            table.add_row(label, f"{row['absent_recall']:.3f}", f"{row['present_recall']:.3f}",
                          f"{row['false_alarm']:.3f}")
        table.add_row("mean", f"{result['absent_recall']:.3f}", f"{result['present_recall']:.3f}",
                      f"{result['false_alarm']:.3f}")
        out = console()
        out.print(table)
        out.print(f"absent recall - false alarm: {result['absent_recall'] - result['false_alarm']:+.3f}")
        if output is not None:
            out.print(f"wrote {output}")

    @app.command("redact")
    def redact_command(
        source: Annotated[Path, typer.Argument(help="A run folder of `icrl eval`, or a folder holding run folders "
                                                    "(e.g. .icrl/evaluations).", show_default=False,
                                               **INPUT_FOLDER)],
        dest: Annotated[Path, typer.Argument(help="The new folder to write (must not exist).", show_default=False,
                                             **OUTPUT_FOLDER)],
    ) -> None:
        """Copy evaluation run folders without the datasets' text: every step log's query is replaced by its
        SHA-256 digest (`query_sha256`), everything else is copied as it is. `icrl eval --resume` and the evaluate
        stage continue a copied run as the original (the text comes back from the task's training stream, checked
        against the digest): a run in progress can be kept somewhere the dataset's text must not go."""
        from tasks.icrl_eval import redact_runs

        count = redact_runs(source, dest)
        console().print(f"wrote {dest}: {count} step log(s) without query text")

    @app.command("check-text")
    def check_text_command(
        paths: Annotated[list[Path], typer.Argument(help="Files or folders to search (folders recursively, `.git` "
                                                    "skipped).", show_default=False, **INPUT_PATH)],
        tasks_dir: Annotated[Path | None, typer.Option(help="Folder of the task folders whose JSONL texts are "
                                                           "looked for (data.tasks_dir).", show_default=False,
                                                       **INPUT_FOLDER)] = None,
        params: ParamsOpt = None,
        overrides: SetOpt = None,
    ) -> None:
        """Fail (exit 1) if any file holds a dataset's query text: every `text` of at least 16 characters in the
        task folders' JSONL files, as written or as escaped inside a JSON string. Run it on anything about to be
        committed (`experiments/icrl_stream_rl/run.sh park` runs it on what it parks); safetensors files are
        searched in their header only."""
        from icrl_core.icrl_eval import query_digest
        from tasks.text_check import find_dataset_text

        if tasks_dir is None:
            tasks_dir = resolve_config(params, overrides).data.tasks_dir
        count, hits = find_dataset_text(paths, tasks_dir)
        out = console()
        for path, text in hits:
            out.print(f"{path}: holds a dataset text (query_sha256 {query_digest(text)}; the text is not printed)")
        out.print(f"searched {', '.join(map(str, paths))} for {count} dataset texts ({tasks_dir}): "
                  f"{len(hits)} file(s) hold one")
        if hits:
            raise typer.Exit(1)

    @app.command("plot")
    def plot_command(
        run_dirs: Annotated[list[Path], typer.Argument(help="Run folders of `icrl eval` to compare.",
                                                       show_default=False, **INPUT_FOLDER)],
        output: Annotated[Path, typer.Option(help="PNG file to write.", **OUTPUT_FILE)] = Path("learning_curves.png"),
        title: Annotated[str | None, typer.Option(help="Figure title.", show_default=False)] = None,
        label: Annotated[list[str] | None, typer.Option(help="Legend label per run, in order (repeatable). "
                                                           "Default: each run's strategy.",
                                                           show_default=False)] = None,
    ) -> None:
        """Compare runs in one figure, paper style: test accuracy vs step (one line per run) above cumulative
        regret."""
        from icrl_core.errors import UserError
        from tasks.icrl_eval import plot_learning_curves

        for run_dir in run_dirs:
            if not (run_dir / "tests.jsonl").exists():
                raise UserError(f"{run_dir}: no tests.jsonl (not an icrl eval run folder)")
        if label and len(label) != len(run_dirs):
            raise UserError(f"{len(label)} --label value(s) for {len(run_dirs)} run(s)")
        path = plot_learning_curves(run_dirs, output, title=title, labels=label)
        console().print(f"wrote {path}")


def _print_summary(metrics: dict) -> None:
    from icrl_core.icrl_eval import COLLAPSED_REPEAT_AFTER_WRONG

    out = console()
    parts = [f"run folder: {metrics['run_dir']}"]
    if metrics.get("train_accuracy") is not None:
        parts.append(f"train accuracy {metrics['train_accuracy']:.3f}, regret {metrics['regret']}")
    if metrics.get("repeat_after_wrong") is not None:
        parts.append(f"repeats its last answer after {metrics['repeat_after_wrong']:.0%} of wrong answers"
                     + (" (collapsed: copies one answer whatever the reward)"
                        if metrics["repeat_after_wrong"] >= COLLAPSED_REPEAT_AFTER_WRONG else ""))
    parts.append("test accuracy: " + ", ".join(f"step {k}: {v:.3f}" for k, v in metrics["test_accuracy"].items()))
    parts.append(f"tokens processed {metrics['tokens_processed']:,}; {metrics['seconds']:.1f}s in steps and tests")
    out.print("\n".join(parts))

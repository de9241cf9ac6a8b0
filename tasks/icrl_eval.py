"""The in-context RL evaluation as a run: a run folder, the per-step log, metrics, the learning curve, MLflow.

    <icrl_eval.output_dir>/<run_name>/
        config.json         the resolved pipeline config of the run
        run.json            what the run fixed when it started (max_examples, decoding mode, ...) and its status
        steps.jsonl         one line per training step (query, prediction, gold, reward, context, tokens, seconds)
        tests.jsonl         one line per test evaluation (step, accuracy, predictions, tokens, seconds)
        metrics.json        running train accuracy, regret, test accuracy at each evaluation, tokens, wall time
        learning_curve.png  test accuracy vs step (and regret)

Logs are appended line by line and flushed, so a killed run loses at most the step in progress. `resume=True`
continues it: a truncated last line is dropped, the history is read back from steps.jsonl, and the strategies
replay it with their per-step seeds, so the continued log equals the uninterrupted one (except the measured
fields `seconds` and `tokens_computed`, which depend on what happened to be cached).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from icrl_core.config import EvalConfig, FrozenAdapter
from icrl_core.errors import UserError
from icrl_core.io import atomic_write_json, atomic_write_text
from icrl_core.task_data import task_label
from tasks.settings import PipelineConfig

STAGE = "icrl_eval"
# Fields that change speed or bookkeeping only; a resumed run may change them.
FREE_ON_RESUME = {"output_dir", "run_name", "debug_k", "threads", "log_every", "batch_tokens", "chunk_tokens",
                  "cache_entries", "reuse_cache", "expand"}


def default_run_name(cfg: EvalConfig) -> str:
    return cfg.run_name or f"{task_label(cfg.task)}-{cfg.strategy}-seed{cfg.seed}"


def run_dir_for(cfg: EvalConfig) -> Path:
    return Path(cfg.output_dir) / default_run_name(cfg)


# ---------------------------------------------------------------------------------------------------------------
# JSONL logs


def read_jsonl(path: Path) -> tuple[list[dict], bool]:
    """(records, dropped) from a JSONL log written line by line; a truncated or corrupt *last* line (a kill
    mid-write) is dropped; a bad line before the last one is an error naming file and line."""
    if not path.exists():
        return [], False
    lines = path.read_bytes().split(b"\n")
    complete, tail = lines[:-1], lines[-1]
    records = []
    for number, raw in enumerate(complete, start=1):
        if not raw.strip():
            continue
        try:
            records.append(json.loads(raw))
        except (json.JSONDecodeError, UnicodeDecodeError):
            if number == len(complete) and not tail.strip():
                return records, True
            raise UserError(f"{path}:{number}: corrupt log line (not JSON); the run cannot be resumed") from None
    return records, bool(tail.strip())


def rewrite_jsonl(path: Path, records: Sequence[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def redact_runs(source: Path, dest: Path) -> int:
    """Copy `source` (a run folder, or any folder holding run folders, e.g. `.icrl/evaluations`) to `dest` with every
    steps.jsonl's query text replaced by its SHA-256 digest; the other files are copied as they are (they hold
    labels, numbers and settings, no dataset text). A run resumes from the copy as from the original. `dest` must
    not exist; it appears whole or not at all. Returns the number of step logs redacted."""
    from icrl_core.icrl_eval import redact_step_event

    source, dest = Path(source), Path(dest)
    if not source.is_dir():
        raise UserError(f"{source}: not a folder")
    if dest.exists():
        raise UserError(f"{dest} already exists: choose a new folder (the copy is written whole or not at all)")
    if dest.resolve().is_relative_to(source.resolve()):
        raise UserError(f"{dest} is inside {source}: choose a folder outside it")
    staging = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, ignore=shutil.ignore_patterns("steps.jsonl"))
    redacted = 0
    for log in sorted(source.rglob("steps.jsonl")):
        steps, _ = read_jsonl(log)  # a truncated last line (a kill mid-write) is left out, as resuming does
        rewrite_jsonl(staging / log.relative_to(source), [redact_step_event(s) for s in steps])
        redacted += 1
    staging.rename(dest)
    return redacted


class JsonlLog:
    """Append-only JSONL file: one flushed line per record (fsync on request)."""

    def __init__(self, path: Path):
        self.path = path
        self._handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across appends; close() closes it

    def append(self, record: dict, sync: bool = False) -> None:
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()
        if sync:
            os.fsync(self._handle.fileno())

    def close(self) -> None:
        self._handle.close()


# ---------------------------------------------------------------------------------------------------------------
# Metrics and plots


def run_metrics(run_dir: Path) -> dict:
    from icrl_core.icrl_eval import summarize

    steps, _ = read_jsonl(run_dir / "steps.jsonl")
    tests, _ = read_jsonl(run_dir / "tests.jsonl")
    info = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
    return {**summarize(steps, tests), **{k: info.get(k) for k in ("task", "strategy", "max_examples")}}


def running_metrics(steps: Sequence[dict]) -> dict:
    rewards = [s["reward"] for s in steps if s.get("reward") is not None]
    metrics = {"context_size": len(steps[-1]["context"]) if steps else 0,
               "tokens_computed": sum(s["tokens_computed"] for s in steps)}
    if rewards:
        metrics.update(train_accuracy=sum(rewards) / len(rewards), regret=len(rewards) - sum(rewards))
    return metrics


def _run_info(run_dir: Path) -> dict:
    path = Path(run_dir) / "run.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """The strategy of each run (from run.json); the folder name too when strategies repeat."""
    strategies = [_run_info(d).get("strategy") or Path(d).name for d in run_dirs]
    if len(set(strategies)) == len(strategies):
        return strategies
    return [f"{s} ({Path(d).name})" for s, d in zip(strategies, run_dirs)]


def plot_learning_curves(run_dirs: Sequence[Path], output: Path, title: str | None = None,
                         labels: Sequence[str] | None = None) -> Path:
    """One figure in the paper's style: test accuracy vs step (one line per run) above cumulative regret."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_test, ax_regret) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True,
                                             gridspec_kw={"height_ratios": [3, 2]})
    colors = plt.get_cmap("tab10")
    labels = list(labels) if labels else _run_labels(run_dirs)
    for index, run_dir in enumerate(run_dirs):
        run_dir = Path(run_dir)
        steps, _ = read_jsonl(run_dir / "steps.jsonl")
        tests, _ = read_jsonl(run_dir / "tests.jsonl")
        label = labels[index]
        color = colors(index % 10)
        if tests:
            ax_test.plot([t["step"] for t in tests], [t["accuracy"] for t in tests], marker="o", color=color,
                         label=label)
        errors, xs, ys = 0, [], []
        for s in steps:
            if s.get("reward") is None:
                continue
            errors += 1 - s["reward"]
            xs.append(s["step"])
            ys.append(errors)
        if xs:
            ax_regret.plot(xs, ys, color=color, label=label)
    label_counts = {_run_info(Path(d)).get("labels") for d in run_dirs}
    if len(label_counts) == 1 and None not in label_counts:
        n_labels = label_counts.pop()
        ax_test.axhline(1 / n_labels, color="gray", linestyle=":", linewidth=1, label=f"chance (1/{n_labels})")
    ax_test.set_ylabel("Test accuracy")
    ax_test.set_ylim(-0.02, 1.02)
    ax_test.grid(alpha=0.3)
    ax_test.legend(fontsize="small", loc="best")
    ax_regret.set_ylabel("Regret (cumulative errors)")
    ax_regret.set_xlabel("Step")
    ax_regret.grid(alpha=0.3)
    if title:
        # long titles wrap instead of running off the figure's edge
        ax_test.set_title(textwrap.fill(title, 70))
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.stem}.tmp{output.suffix}")
    fig.savefig(tmp, dpi=130)
    plt.close(fig)
    os.replace(tmp, output)
    return output


def read_run_logs(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The per-step and per-evaluation logs of a run folder; a folder with neither is a user error."""
    steps, _ = read_jsonl(Path(run_dir) / "steps.jsonl")
    tests, _ = read_jsonl(Path(run_dir) / "tests.jsonl")
    if not steps and not tests:
        raise UserError(f"{run_dir}: no steps.jsonl/tests.jsonl here (is it an icrl eval run folder?)")
    return steps, tests


def count_tokens(run_dir: Path) -> dict:
    """Tokens a finished (or partial) run fed through the model, and what recomputing every prompt would feed."""
    steps, tests = read_run_logs(run_dir)
    predicted = [s for s in steps if s.get("prediction") is not None]
    computed_train = sum(s["tokens_computed"] for s in steps)
    computed_test = sum(t["tokens_computed"] for t in tests)
    prompt_train = sum(s["prompt_tokens"] for s in predicted)
    prompt_test = sum(t["prompt_tokens"] for t in tests)
    return {
        "run": str(run_dir), "steps": len(steps), "tests": len(tests),
        "train_tokens_computed": computed_train, "test_tokens_computed": computed_test,
        "tokens_computed": computed_train + computed_test,
        "train_prompt_tokens": prompt_train, "test_prompt_tokens": prompt_test,
        "prompt_tokens": prompt_train + prompt_test,
        "tokens_per_step": computed_train / len(steps) if steps else 0.0,
        "reuse_factor": (prompt_train + prompt_test) / max(1, computed_train + computed_test),
    }


def inspect_run(run_dir: Path, window: int) -> dict:
    """`behaviour` of a finished (or partial) run folder: per-window accuracy, label counts and answer
    confidence, and the test answers' label counts at each evaluation."""
    from icrl_core.icrl_eval import behaviour

    steps, tests = read_run_logs(run_dir)
    return {"run": str(run_dir), **behaviour(steps, tests, window)}


# ---------------------------------------------------------------------------------------------------------------
# Model, task and cap


def load_eval_policy(config: PipelineConfig):
    """The model to evaluate, frozen; a trained adapter (model.init_adapter) is loaded with its adapter type."""
    from icrl_core.model import policy_from_config

    if config.model.init_adapter is None:
        return policy_from_config(config.model, adapter=FrozenAdapter())
    return policy_from_config(config.model)


class EvalModel:
    """The model an evaluation reaches through its inference engine (`inference.backend`), with the tokenizer and
    context window the harness renders prompts with."""

    def __init__(self, engine, tokens, window: int, adapter: str | None, policy=None):
        self.engine, self.tokens, self.window, self.adapter, self.policy = engine, tokens, window, adapter, policy


def load_eval_model(config: PipelineConfig, engine=None) -> EvalModel:
    """The inference engine of config.inference for config.model (a trained adapter: model.init_adapter). The torch
    engine serves the policy loaded here; another backend loads the weights itself (only the tokenizer here).
    `engine`: an engine already serving this model (several evaluation streams share one)."""
    from icrl_core.inference.base import engine_from_config

    adapter = str(config.model.init_adapter) if config.model.init_adapter is not None else None
    if engine is not None:
        tokens, window = load_tokens_and_window(config.model.spec, config.model.cache_dir)
        return EvalModel(engine, tokens, window, adapter)
    if config.inference.backend == "torch":
        policy = load_eval_policy(config)
        return EvalModel(engine_from_config(config, policy), policy.tokens, policy.context_window, adapter, policy)
    tokens, window = load_tokens_and_window(config.model.spec, config.model.cache_dir)
    return EvalModel(engine_from_config(config), tokens, window, adapter)


def load_eval_task(config: PipelineConfig):
    from icrl_core.task_data import load_task_from_source

    cfg = config.icrl_eval
    seed = cfg.task_seed if cfg.task_seed is not None else config.seed
    return load_task_from_source(cfg.task, cfg.source, config.data.tasks_dir, seed=seed,
                                 disk_path=cfg.disk_path, prompt=config.data.prompt_of(cfg.task))


def load_tokens_and_window(spec: str, cache_dir: Path | None = None):
    """(Tokens, context window) of a model spec without loading its weights."""
    from transformers import AutoConfig, AutoTokenizer

    from icrl_core.chat import Tokens
    from icrl_core.model import resolve_spec, tiny_config

    kind, where = resolve_spec(spec, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(where))
    if kind == "tiny":
        window = tiny_config(len(tokenizer)).max_position_embeddings
    else:
        window = int(getattr(AutoConfig.from_pretrained(str(where)), "max_position_embeddings", 2048))
    return Tokens(tokenizer), window


def resolve_max_examples(cfg: EvalConfig, task, tokens, window: int) -> int:
    from icrl_core.icrl_eval import max_context_examples, show_for

    if cfg.strategy == "zero_shot":
        return 0
    if cfg.max_examples is not None:
        return cfg.max_examples
    return max_context_examples(task, tokens, show_for(cfg), cfg.context_window or window)


# ---------------------------------------------------------------------------------------------------------------
# The run


def _check_resumable(run_dir: Path, config: PipelineConfig) -> None:
    from pydantic import ValidationError

    saved = json.loads((run_dir / "config.json").read_text())
    now = config.model_dump(mode="json")
    try:  # a run written before a field changed its form (e.g. p_keep, once one number) compares by meaning
        saved["icrl_eval"] = EvalConfig.model_validate(saved.get("icrl_eval", {})).model_dump(mode="json")
    except ValidationError:
        pass  # keys this version does not know: compared as written, and reported
    diffs = []
    for section in ("icrl_eval", "model"):
        for key in sorted(set(saved.get(section, {})) | set(now[section])):
            if section == "icrl_eval" and key in FREE_ON_RESUME:
                continue
            if saved.get(section, {}).get(key) != now[section].get(key):
                diffs.append(f"{section}.{key}: run has {saved.get(section, {}).get(key)!r}, now "
                             f"{now[section].get(key)!r}")
    if saved.get("seed") != now["seed"]:
        diffs.append(f"seed: run has {saved.get('seed')!r}, now {now['seed']!r}")
    if diffs:
        raise UserError(f"{run_dir}: cannot resume with a different configuration:\n  " + "\n  ".join(diffs))


def prepare_run_dir(config: PipelineConfig, resume: bool) -> tuple[Path, list[dict], list[dict]]:
    """Create the run folder, or (resume) validate it and cut its logs back to a consistent prefix."""
    run_dir = run_dir_for(config.icrl_eval)
    if run_dir.exists() and any(run_dir.iterdir()):
        if not resume:
            raise UserError(f"{run_dir} already exists: pass --resume to continue it, or choose another "
                            "--run-name")
        if not (run_dir / "config.json").exists():
            raise UserError(f"{run_dir}: not an icrl eval run folder (no config.json)")
        _check_resumable(run_dir, config)
        steps, _ = read_jsonl(run_dir / "steps.jsonl")
        tests, _ = read_jsonl(run_dir / "tests.jsonl")
        steps = list(itertools.takewhile(lambda pair: pair[1]["step"] == pair[0], enumerate(steps)))
        steps = [record for _, record in steps]
        # A test is logged before its step; a test of an unfinished step is redone.
        tests = [t for t in tests if t["step"] < len(steps)]
        rewrite_jsonl(run_dir / "steps.jsonl", steps)
        rewrite_jsonl(run_dir / "tests.jsonl", tests)
        return run_dir, steps, tests
    if resume and not run_dir.exists():
        raise UserError(f"--resume: {run_dir} does not exist (nothing to resume)")
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_dir / "config.json", config.model_dump(mode="json"))
    return run_dir, [], []


def evaluate(config: PipelineConfig, resume: bool = False, progress: bool = True,
             echo: Callable[[str], None] | None = None, on_test: Callable[[dict], None] | None = None,
             position: int | None = None, engine=None) -> dict:
    """Run (or resume) one in-context RL evaluation; return its metrics. `position`: the progress bar's line
    when several runs share a terminal; `engine`: an inference engine already serving config.model (several runs
    share one, each from its own thread), else one is made for this run."""
    import torch

    from icrl_core.icrl_eval import (
        DebugEvent,
        EvaluationEvent,
        Predictor,
        StepEvent,
        history_from_events,
        is_supervised,
        run_protocol,
        summarize,
    )
    from tasks.tracking import stage_run

    cfg = config.icrl_eval
    echo = echo or (lambda text: None)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    task = load_eval_task(config)
    task.training_stream(cfg.train_k, cfg.training_seed)  # bad sizes fail before a run folder exists
    task.test_set(cfg.test_k, cfg.test_seed)
    is_supervised(cfg)  # strategy icl with icrl=true is refused here too
    fresh = not run_dir_for(cfg).exists()
    run_dir, steps, tests = prepare_run_dir(config, resume)
    started = time.perf_counter()
    try:
        model = load_eval_model(config, engine)
    except UserError:
        if fresh:  # a bad model or adapter leaves no run folder that would need --resume
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    info_path = run_dir / "run.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    if "max_examples" not in info:
        info.update(task=task.name, strategy=cfg.strategy, labels=len(task.labels), model=config.model.spec,
                    max_examples=resolve_max_examples(cfg, task, model.tokens, model.window),
                    created=time.strftime("%Y-%m-%dT%H:%M:%S"))
    max_examples = info["max_examples"]
    predictor = Predictor(model.policy, model.tokens, task.template, task.labels, None, cfg.temperature,
                          expand=cfg.expand, batch_tokens=cfg.batch_tokens, engine=model.engine,
                          adapter=model.adapter)
    info.update(status="running", expand=predictor.expand, resumed_at_step=len(steps) if steps else None)
    atomic_write_json(info_path, info)
    echo(f"run folder {run_dir}: {task.name}, strategy {cfg.strategy}, max {max_examples} in-context episodes, "
         f"{len(task.labels)} labels ({predictor.expand} decoding)"
         + (f"; resuming at step {len(steps)}" if steps else ""))

    step_log, test_log = JsonlLog(run_dir / "steps.jsonl"), JsonlLog(run_dir / "tests.jsonl")
    with stage_run(config, STAGE, run_name=run_dir.name,
                   tags={"icrl.run_dir": str(run_dir), "icrl.resumed_at_step": len(steps)}) as tracker:
        _replay_metrics(tracker, steps, tests, cfg.log_every)
        bar = _progress(cfg.train_k, len(steps), progress, run_dir.name, position)
        try:
            for event in run_protocol(predictor, task, cfg, max_examples, history_from_events(steps)):
                if isinstance(event, DebugEvent):
                    echo(f"--- prompt at step {event.step} ---\n{event.prompt}")
                elif isinstance(event, EvaluationEvent):
                    record = event.to_json()
                    test_log.append(record, sync=True)
                    tests.append(record)
                    tracker.log_metrics({"test_accuracy": event.accuracy,
                                         "test_tokens_computed": event.tokens_computed}, step=event.step)
                    atomic_write_json(run_dir / "metrics.json", {**summarize(steps, tests), **_about(info)})
                    if on_test:
                        on_test(record)
                    if bar is not None:
                        bar.set_postfix_str(f"test acc {event.accuracy:.3f}")
                elif isinstance(event, StepEvent):
                    record = event.to_json()
                    step_log.append(record)
                    steps.append(record)
                    if (event.step + 1) % cfg.log_every == 0:
                        tracker.log_metrics(running_metrics(steps), step=event.step)
                    if bar is not None:
                        bar.update(1)
        finally:
            step_log.close()
            test_log.close()
            if bar is not None:
                bar.close()
        metrics = {**summarize(steps, tests), **_about(info),
                   "wall_seconds_this_session": time.perf_counter() - started}
        atomic_write_json(run_dir / "metrics.json", metrics)
        plot_learning_curves([run_dir], run_dir / "learning_curve.png",
                             title=f"{task.name}: {cfg.strategy} (seed {cfg.seed})")
        info.update(status="finished", finished=time.strftime("%Y-%m-%dT%H:%M:%S"))
        atomic_write_json(info_path, info)
        tracker.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        for name in ("config.json", "run.json", "steps.jsonl", "tests.jsonl", "metrics.json", "learning_curve.png"):
            tracker.log_artifact(run_dir / name, artifact_path="icrl_eval")
    return {**metrics, "run_dir": str(run_dir)}


def probe_feedback(config: PipelineConfig, target: str, counts: Sequence[int], n_queries: int,
                   output: Path | None = None, progress: bool = True) -> dict:
    """The feedback-sensitivity probe (icrl_core.feedback_probe) on icrl_eval.task with model.spec (and
    model.init_adapter if set); the result is written atomically to `output` as JSON when given."""
    import torch

    from icrl_core.feedback_probe import probe_examples

    cfg = config.icrl_eval
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    probe_examples(load_eval_task(config), target, n_queries, cfg.seed)  # a bad target fails before the model loads
    started = time.perf_counter()
    result = measure_feedback(config, load_eval_policy(config), target, counts, n_queries, progress)
    result["seconds"] = time.perf_counter() - started
    if output is not None:
        atomic_write_json(output, result)
    _track_probe(config, result, output)
    return result


def measure_feedback(config: PipelineConfig, policy, target: str, counts: Sequence[int], n_queries: int,
                     progress: bool = True, name: str = "", position: int = 0) -> dict:
    """The feedback probe for a loaded policy on icrl_eval.task (shared by `icrl probe-feedback` and the
    evaluate stage), with the model it measured. It runs on the torch engine over `policy` whatever
    inference.backend says: the policy is loaded already, and a few hundred queries do not pay for starting
    another engine (vllm: ~2 min)."""
    from icrl_core.feedback_probe import feedback_sensitivity, probe_size
    from icrl_core.icrl_eval import Predictor
    from icrl_core.inference.torch_backend import TorchEngine

    task = load_eval_task(config)
    adapter = str(config.model.init_adapter) if config.model.init_adapter is not None else None
    engine = TorchEngine.from_config(config, policy)
    predictor = Predictor(policy, policy.tokens, task.template, task.labels, None, 1.0, engine=engine,
                          adapter=adapter)
    bar = _progress(probe_size(counts, n_queries), 0, progress,
                    f"feedback probe ({name})" if name else "feedback probe", position)
    try:
        result = feedback_sensitivity(predictor, task, target, counts, n_queries, config.icrl_eval.seed,
                                      on_query=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    result.update(model=config.model.spec, dtype=config.model.dtype,
                  adapter=str(config.model.init_adapter) if config.model.init_adapter else None)
    return result


def probe_closure(config: PipelineConfig, n_queries: int, episodes: int, output: Path | None = None,
                  progress: bool = True) -> dict:
    """The label-closure probe (icrl_core.closure_probe) on icrl_eval.task's training split with model.spec (and
    model.init_adapter if set), seeded by icrl_eval.seed; written atomically to `output` as JSON when given, and
    tracked as an MLflow run (stage `probe_closure`)."""
    import torch

    from icrl_core.closure_probe import closure_draws, label_closure
    from icrl_core.icrl_eval import Predictor
    from icrl_core.inference.torch_backend import TorchEngine

    cfg = config.icrl_eval
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    task = load_eval_task(config)
    for label in task.labels:  # bad sizes (or a task too small for them) fail before the model loads
        closure_draws(task, label, n_queries, episodes, cfg.seed)
    started = time.perf_counter()
    policy = load_eval_policy(config)
    adapter = str(config.model.init_adapter) if config.model.init_adapter is not None else None
    predictor = Predictor(policy, policy.tokens, task.template, task.labels, None, 1.0,
                          engine=TorchEngine.from_config(config, policy), adapter=adapter)
    bar = _progress(3 * n_queries * len(task.labels), 0, progress, "closure probe")
    try:
        result = label_closure(predictor, task, n_queries, episodes, cfg.seed, on_query=bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    result.update(model=config.model.spec, dtype=config.model.dtype, adapter=adapter,
                  seconds=time.perf_counter() - started)
    if output is not None:
        atomic_write_json(output, result)
    _track_closure(config, result, output)
    return result


def _track_closure(config: PipelineConfig, result: dict, output: Path | None) -> None:
    """The closure probe as an MLflow run: its settings as params, the three means and each label's as metrics,
    the result JSON as an artifact."""
    from tasks.tracking import stage_run

    with stage_run(config, "probe_closure", run_name=f"probe-closure-{result['task']}") as tracker:
        tracker.log_params({"probe.queries": result["queries"], "probe.episodes": result["episodes"]})
        keys = ("absent_recall", "present_recall", "false_alarm")
        metrics = {key: result[key] for key in keys}
        metrics["absent_recall_margin"] = result["absent_recall"] - result["false_alarm"]
        # per label, its name made a valid MLflow metric key (letters, digits, _ - . / and space)
        metrics |= {f"{key}/{_metric_name(label)}": row[key] for label, row in result["labels"].items() for key in keys}
        tracker.log_metrics(metrics)
        if tracker.enabled:
            _log_json_artifact(tracker, result, output, "probe_closure")


def _metric_name(label: str) -> str:
    """A label as part of an MLflow metric key (letters, digits, _ - . and space)."""
    return re.sub(r"[^\w\-. ]", "_", label)


def _log_json_artifact(tracker, result: dict, output: Path | None, name: str) -> None:
    """`output` if the result was written there, else the result in a temporary file NAME.json, under NAME/."""
    import tempfile

    if output is not None:
        tracker.log_artifact(output, artifact_path=name)
        return
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.json"
        atomic_write_json(path, result)
        tracker.log_artifact(path, artifact_path=name)


def _track_probe(config: PipelineConfig, result: dict, output: Path | None) -> None:
    """The probe as an MLflow run: the config and the probe's settings as params, p(target), p(gold) per
    condition and the feedback effect per n as metrics, the result JSON as an artifact."""
    from tasks.tracking import stage_run

    with stage_run(config, "probe_feedback", run_name=f"probe-feedback-{result['task']}-{result['target']}",
                   tags={"icrl.probe_target": result["target"]}) as tracker:
        tracker.log_params({"probe.target": result["target"], "probe.queries": result["queries"],
                            "probe.attempts": ",".join(str(c["attempts"]) for c in result["conditions"].values())})
        metrics = {f"{key}_{name}": row[key] for name, row in result["conditions"].items()
                   for key in ("p_target", "p_gold")}
        metrics |= {f"feedback_effect_n{n}": effect for n, effect in result["feedback_effect"].items()}
        metrics |= {f"feedback_effect_n{n}_ci95_{side}": bound for n, bounds in result["feedback_effect_ci95"].items()
                    for side, bound in zip(("low", "high"), bounds)}
        metrics |= {f"gold_after_wrong_n{n}": gain for n, gain in result["gold_after_wrong"].items()}
        tracker.log_metrics(metrics)
        if tracker.enabled:
            _log_json_artifact(tracker, result, output, "probe_feedback")


def _about(info: dict) -> dict:
    return {k: info.get(k) for k in ("task", "strategy", "max_examples", "model")}


def _replay_metrics(tracker, steps: Sequence[dict], tests: Sequence[dict], log_every: int) -> None:
    """A resumed run logs to a new MLflow run: give it the metrics of the steps done before the restart."""
    for index in range(log_every - 1, len(steps), log_every):
        tracker.log_metrics(running_metrics(steps[: index + 1]), step=index)
    for test in tests:
        tracker.log_metrics({"test_accuracy": test["accuracy"], "test_tokens_computed": test["tokens_computed"]},
                            step=test["step"])


def _progress(total: int, done: int, enabled: bool, name: str, position: int | None = None):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=name, unit="step", dynamic_ncols=True, position=position)


def run(config: PipelineConfig) -> dict:
    """Stage entry (`icrl stage icrl_eval` when registered): evaluate, then write metrics/icrl_eval.json."""
    from tasks.runtime import write_stage_metrics

    metrics = evaluate(config, resume=run_dir_for(config.icrl_eval).exists(), progress=True)
    write_stage_metrics(STAGE, {k: v for k, v in metrics.items() if k != "test_accuracy"}
                        | {"test_accuracy": {str(k): v for k, v in metrics["test_accuracy"].items()}})
    return metrics


# ---------------------------------------------------------------------------------------------------------------
# The demo (`make demo` = `icrl demo`)

DEMO_SETTINGS = {
    "task": "keyword_map", "strategy": "explorative",
    # A short run: keep more positives (p_keep 0.3; the paper uses 0.1 over 10k steps) and explore more (T=2):
    # at T=1 SmolLM2-135M settles on one code word within a few steps and never tries the others.
    "temperature": 2.0, "p_keep": 0.3, "train_k": 80, "test_every": 20, "test_k": 40, "seed": 100,
}


def run_demo(out) -> dict:
    """In-context RL on keyword_map with the embedded SmolLM2-135M, in float32 (bfloat16 would be faster on CPUs
    with AVX512-BF16, but its sampled predictions differ from one CPU to another)."""
    from tasks.cli_common import resolve_config

    settings = dict(DEMO_SETTINGS, run_name=time.strftime("demo-%Y%m%d-%H%M%S"))
    # On a busy 2-core machine one torch thread is much faster than two (threads spin while they wait).
    settings["threads"] = 1 if os.getloadavg()[0] >= 1.0 else 0
    config = resolve_config(None, [], extra={"icrl_eval": settings,
                                             "model": {"spec": "smollm2-135m", "dtype": "float32"}})
    out.print(f"In-context RL demo: SmolLM2-135M answers {settings['train_k']} keyword_map queries; each answer "
              "is rewarded and kept in its context (explorative strategy). Test accuracy on "
              f"{settings['test_k']} held-out queries (4 labels, chance 0.25):")
    started = time.perf_counter()

    def show_test(record: dict) -> None:
        out.print(f"  step {record['step']:>3}: test accuracy {record['accuracy']:.3f} "
                  f"(context {record['context_size']} episodes)")

    metrics = evaluate(config, progress=True, echo=lambda text: None, on_test=show_test)
    run_dir = Path(metrics["run_dir"])
    out.print(f"train accuracy {metrics['train_accuracy']:.3f} (regret {metrics['regret']}), "
              f"{metrics['tokens_processed']:,} tokens computed, {time.perf_counter() - started:.0f}s")
    out.print(f"step log:  {run_dir / 'steps.jsonl'}\ntest log:  {run_dir / 'tests.jsonl'}\n"
              f"metrics:   {run_dir / 'metrics.json'}\nplot:      {run_dir / 'learning_curve.png'}\n"
              "MLflow:    run `mlflow ui --backend-store-uri sqlite:///mlflow.db` here to browse it")
    return metrics

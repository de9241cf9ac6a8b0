"""Stage `evaluate`: the pipeline's verdict on the trained policy.

For each strategy in `evaluate.strategies`, the in-context RL harness (tasks/icrl_eval.py, `icrl_eval.*`
settings) runs twice on the same seeds: the base model, and the base model with the trained adapter
(`evaluate.adapter`). The forgetting check (icrl_core/general_ability.py) asks both models the first
`evaluate.forgetting_questions` general questions, and the multiple-choice probe (icrl_core/choice_probe.py)
scores `evaluate.forgetting_probe_items` items; with `evaluate.feedback_probe_target` set, the feedback probe
(`icrl probe-feedback`) asks both models whether they read reward feedback. Runs and each model's measurements are
jobs of one pool,
`evaluate.workers` at a time, each in its own process.
Runs are computed in work folders under .icrl/evaluations/ (DVC deletes the stage's outs before it runs), so a
stage killed mid-run continues each run from its log; finished runs and forgetting measurements are kept there by
a hash of what they depend on and reused (`evaluate.reuse_runs`).
Outputs: evaluate.output_dir/{runs/, learning_curve.png, report.json, metrics.json}, metrics/evaluate.json (the
headline), an MLflow run.
`promote` reads `evaluate.metric` and recomputes the gates (`gates`: the forgetting check and the held-out gain).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from tasks.runtime import content_key
from tasks.settings import PipelineConfig, with_overrides

STAGE = "evaluate"
log = logging.getLogger(__name__)
# metrics/evaluate.json: evaluate.metric and these; the full record is evaluate.output_dir/metrics.json
HEADLINE = ("base_final_test_accuracy", "trained_final_test_accuracy", "gain", "forgetting_drop", "eligible")


def _eval_config(config: PipelineConfig, strategy: str, which: str, adapter: Path | None) -> PipelineConfig:
    runs = Path(config.evaluate.output_dir) / "runs"
    overrides = {
        "icrl_eval.strategy": strategy, "icrl_eval.run_name": f"{which}-{strategy}",
        "icrl_eval.output_dir": str(runs), "model.init_adapter": str(adapter) if adapter else None,
        "tracking.enabled": False,  # the stage's own MLflow run gets the metrics and the run folders
    }
    if strategy in config.evaluate.temperatures:
        # a strategy may explore hotter; its tests stay at the temperature every other run is tested at
        test_temperature = config.icrl_eval.test_temperature
        overrides["icrl_eval.temperature"] = config.evaluate.temperatures[strategy]
        overrides["icrl_eval.test_temperature"] = (config.icrl_eval.temperature if test_temperature is None
                                                   else test_temperature)
    return with_overrides(config, overrides)


def _with_adapter(config: PipelineConfig, adapter: Path | None) -> PipelineConfig:
    """`config` for one evaluated model: the base model (None) or the base model with `adapter`."""
    return with_overrides(config, {"model.init_adapter": str(adapter) if adapter else None})


def _policy(config: PipelineConfig, adapter: Path | None):
    from tasks.icrl_eval import load_eval_policy

    return load_eval_policy(_with_adapter(config, adapter))


def forgetting(policy, n: int, max_new_tokens: int, name: str = "model", position: int = 0) -> dict:
    """The greedy question check (first `n` questions, replies of up to `max_new_tokens`) for one model."""
    from tqdm.auto import tqdm

    from icrl_core.general_ability import QUESTIONS, measure

    report = measure(policy, QUESTIONS[:n], max_new_tokens=max_new_tokens,
                     progress=lambda items: tqdm(items, desc=f"forgetting check ({name})", unit="question",
                                                 position=position, leave=False))
    return {"accuracy": report.accuracy, "answer_nll": report.answer_nll, "answers": report.answers}


def forgetting_probe(policy, n: int, name: str, position: int = 0) -> dict:
    """The multiple-choice probe (first `n` generated items, seed 0) for one model."""
    from tqdm.auto import tqdm

    from icrl_core.choice_probe import generate_items, measure_choices

    report = measure_choices(policy, policy.tokens, generate_items(seed=0)[:n],
                             progress=lambda items: tqdm(items, desc=f"forgetting probe ({name})", unit="item",
                                                         position=position, leave=False))
    return {"accuracy": report.accuracy, "by_family": report.by_family, "correct": report.correct}


ABILITY_MEASURES = ("greedy", "probe", "feedback")


def ability_keys(config: PipelineConfig, adapter: Path | None) -> dict[str, str]:
    """One key per forgetting measurement that is switched on, a hash of what it depends on: the model (a trained
    adapter by its bytes), its settings and its source code. The greedy check and the choice probe do not depend on
    the evaluation task or seed, so the stage runs of every seed share them; the feedback probe does."""
    cfg = config.evaluate
    model = _model_identity(_with_adapter(config, adapter))
    keys = {}
    if cfg.forgetting_questions:
        keys["greedy"] = content_key({"model": model, "greedy": [cfg.forgetting_questions,
                                                                 cfg.forgetting_max_new_tokens]}, _ABILITY_SOURCES)
    if cfg.forgetting_probe_items:
        keys["probe"] = content_key({"model": model, "probe": cfg.forgetting_probe_items}, _ABILITY_SOURCES)
    feedback = _feedback_probe_settings(config)
    if feedback is not None:
        keys["feedback"] = content_key({"model": model, "feedback": feedback},
                                       _ABILITY_SOURCES + _FEEDBACK_SOURCES)
    return keys


def _combined_ability_key(config: PipelineConfig, adapter: Path | None) -> str:
    """The key under which all of one model's measurements were kept together before `ability_keys` (read only, so
    that measurements made then are not made again)."""
    cfg = config.evaluate
    payload = {"model": _model_identity(_with_adapter(config, adapter)),
               "greedy": [cfg.forgetting_questions, cfg.forgetting_max_new_tokens],
               "probe": cfg.forgetting_probe_items}
    feedback = _feedback_probe_settings(config)
    if feedback is None:
        return content_key(payload, _ABILITY_SOURCES)
    return content_key(payload | {"feedback": feedback}, _ABILITY_SOURCES + _FEEDBACK_SOURCES)


def _feedback_probe_settings(config: PipelineConfig) -> dict | None:
    cfg = config.evaluate
    if cfg.feedback_probe_target is None:
        return None
    task = config.icrl_eval
    return {"task": [task.task, task.task_seed if task.task_seed is not None else config.seed, task.source,
                     str(task.disk_path), _task_identity(config)],
            "seed": task.seed, "target": cfg.feedback_probe_target, "attempts": cfg.feedback_probe_attempts,
            "queries": cfg.feedback_probe_queries}


def _ability_path(measure: str, key: str) -> Path:
    return RESULT_CACHE / "ability" / f"{measure}-{key}.json"


def _stored_measures(config: PipelineConfig, adapter: Path | None, keys: dict[str, str]) -> dict:
    """The measurements of one model (`keys`: its `ability_keys`) kept in the cache (measure -> result), those of an
    entry kept under the combined key split into per-measurement entries first."""
    import json

    from icrl_core.io import atomic_write_json

    combined = RESULT_CACHE / "ability" / f"{_combined_ability_key(config, adapter)}.json"
    if combined.exists():
        entry = json.loads(combined.read_text())
        for measure, key in keys.items():
            if entry.get(measure) is not None and not _ability_path(measure, key).exists():
                atomic_write_json(_ability_path(measure, key), entry[measure])
    return {measure: json.loads(_ability_path(measure, key).read_text())
            for measure, key in keys.items() if _ability_path(measure, key).exists()}


def stored_ability(config: PipelineConfig, adapter: Path | None) -> dict | None:
    """One model's switched-on measurements when all are kept (see `general_ability`) and `evaluate.reuse_runs`."""
    if not config.evaluate.reuse_runs:
        return None
    keys = ability_keys(config, adapter)
    stored = _stored_measures(config, adapter, keys)
    if set(stored) != set(keys):
        return None
    return {measure: stored.get(measure) for measure in ABILITY_MEASURES}


def general_ability(config: PipelineConfig, adapter: Path | None, position: int = 0) -> dict:
    """The forgetting measures and the feedback probe that are switched on, for one model loaded once (None for
    those switched off). Each is kept under its key in `ability_keys` as soon as it is measured (a stage killed
    after the greedy check does not run it again; another seed's stage run reuses it) and reused when
    `evaluate.reuse_runs`."""
    import json

    from icrl_core.io import atomic_write_json
    from tasks.icrl_eval import measure_feedback

    cfg = config.evaluate
    keys = ability_keys(config, adapter)
    stored = _stored_measures(config, adapter, keys) if cfg.reuse_runs else {}
    missing = [measure for measure in keys if measure not in stored]
    policy = _policy(config, adapter) if missing else None
    name = "trained" if adapter else "base"
    measures = {"greedy": lambda: forgetting(policy, cfg.forgetting_questions, cfg.forgetting_max_new_tokens, name,
                                             position),
                "probe": lambda: forgetting_probe(policy, cfg.forgetting_probe_items, name, position),
                "feedback": lambda: measure_feedback(_with_adapter(config, adapter), policy,
                                                     cfg.feedback_probe_target, cfg.feedback_probe_attempts,
                                                     cfg.feedback_probe_queries, name=name, position=position)}
    for measure in missing:
        target = _ability_path(measure, keys[measure])
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(target, measures[measure]())
        stored[measure] = json.loads(target.read_text())  # the same JSON types whether measured now or reused
    return {measure: stored.get(measure) for measure in ABILITY_MEASURES}


def interpolated_adapter(config: PipelineConfig, source: Path, scale: float, target: Path) -> Path:
    """Write base + scale * (trained - base) as an adapter folder (icrl_core.adapter_tools.interpolate_adapter)."""
    from icrl_core.adapter_tools import interpolate_adapter
    from icrl_core.model import policy_from_config

    return interpolate_adapter(source, scale, target, lambda: policy_from_config(config.model, init_adapter=source))


def forgetting_probe_metrics(base: dict, trained: dict) -> dict:
    from icrl_core.general_ability import paired_change

    paired = paired_change(base["correct"], trained["correct"])
    return {"forgetting_probe_base_accuracy": base["accuracy"],
            "forgetting_probe_trained_accuracy": trained["accuracy"],
            "forgetting_probe_change": paired.change, "forgetting_probe_items": paired.n_questions,
            "forgetting_probe_ci95_low": paired.ci95_low, "forgetting_probe_ci95_high": paired.ci95_high,
            "forgetting_probe_became_correct": paired.became_correct,
            "forgetting_probe_became_wrong": paired.became_wrong, "forgetting_probe_mcnemar_p": paired.mcnemar_p}


def feedback_probe_metrics(feedback: dict) -> dict:
    """Flat metrics of both models' feedback probes: p(target) per condition, the feedback effect per n
    (p(target | marked right) - p(target | marked wrong); a model that reads the feedback has it well above 0)
    and the gold label's gain after attempts marked wrong (p(gold | n wrong) - p(gold | no context))."""
    metrics = {}
    for which, result in feedback.items():
        metrics |= {f"feedback_p_target_{name}_{which}": row["p_target"]
                    for name, row in result["conditions"].items()}
        metrics |= {f"feedback_effect_n{n}_{which}": effect for n, effect in result["feedback_effect"].items()}
        metrics |= {f"gold_after_wrong_n{n}_{which}": gain for n, gain in result["gold_after_wrong"].items()}
    return metrics


def forgetting_paired_metrics(base_answers: list[dict], trained_answers: list[dict]) -> dict:
    """The forgetting check as a paired comparison (same questions): flips each way, 95% interval, McNemar p."""
    from icrl_core.general_ability import paired_change

    paired = paired_change([a["correct"] for a in base_answers], [a["correct"] for a in trained_answers])
    return {"forgetting_became_correct": paired.became_correct, "forgetting_became_wrong": paired.became_wrong,
            "forgetting_change_ci95_low": paired.ci95_low, "forgetting_change_ci95_high": paired.ci95_high,
            "forgetting_mcnemar_p": paired.mcnemar_p}


def _evaluate_job(config_json: dict, resume: bool, position: int = 0, threads: int = 0) -> dict:
    """One evaluation run (the config travels as JSON and is validated again); `threads` torch threads (0: as is)."""
    from tasks.icrl_eval import evaluate
    from tasks.settings import PipelineConfig as Config

    config = Config.model_validate(config_json)
    if threads and not config.icrl_eval.threads:
        config = with_overrides(config, {"icrl_eval.threads": threads})
    return evaluate(config, resume=resume, progress=True, position=position)


def _ability_job(config_json: dict, adapter: str | None, position: int = 0, threads: int = 0) -> dict:
    """One model's forgetting measurements (`general_ability`), with `threads` torch threads (0: as is)."""
    from tasks.settings import PipelineConfig as Config

    if threads:
        import torch

        torch.set_num_threads(threads)
    return general_ability(Config.model_validate(config_json), Path(adapter) if adapter else None, position)


def in_pool(jobs: list[tuple], workers: int):
    """Yield (index, result) of each job (function, keyword arguments) as it finishes: `workers` at a time in
    separate processes, each with cpu_count / workers torch threads; one worker (or one job) runs them here, one
    after another. A job's function gets its progress-bar `position` and `threads`."""
    workers = min(workers, len(jobs))
    if workers <= 1:
        for index, (function, kwargs) in enumerate(jobs):
            yield index, function(**kwargs)
        return
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor, as_completed

    threads = max(1, (os.cpu_count() or 1) // workers)
    # spawn: a fresh interpreter per worker (forking a process that holds torch threads is unsafe)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {pool.submit(function, **kwargs, position=index % workers, threads=threads): index
                   for index, (function, kwargs) in enumerate(jobs)}
        for future in as_completed(futures):
            yield futures[future], future.result()
    finally:
        # on an error (or an interrupt) the jobs not yet started are dropped; the running ones finish their step
        # logs, and a finished run left in its work folder is stored when the stage runs again
        pool.shutdown(wait=True, cancel_futures=True)


def streams_supported(config: PipelineConfig) -> bool:
    """Whether evaluation runs share one engine, each from its own thread (`inference.streams` > 1 and a
    concurrent backend)."""
    from icrl_core.inference.base import engine_class

    return config.inference.streams > 1 and bool(getattr(engine_class(config.inference.backend), "concurrent", False))


def in_streams(configs: list[PipelineConfig], resume: list[bool], streams: int):
    """Yield (index, metrics) of each evaluation run as it finishes: `streams` runs at a time in this process, each
    from its own thread, all through one inference engine (its base model and each trained adapter loaded once).
    Torch threads: one per stream (streams on different cores run in parallel), or all cores for the one batched
    pass at a time when the engine fuses the streams' passes (torch fuse_streams, vllm)."""
    import os
    from concurrent.futures import ThreadPoolExecutor, as_completed

    import torch

    from icrl_core.inference.base import engine_from_config
    from tasks.icrl_eval import evaluate

    first = configs[0]
    # one batched pass at a time (torch with fused passes; vllm batches the streams' requests): all cores for it
    batched = first.inference.fuse_streams or first.inference.backend != "torch"
    threads = (os.cpu_count() or 1) if batched else 1
    torch.set_num_threads(threads)
    entries = max(c.icrl_eval.cache_entries or (c.icrl_eval.max_contexts + 1 if c.icrl_eval.strategy == "approximate"
                                                else 2) for c in configs)
    engine = engine_from_config(with_overrides(first, {"model.init_adapter": None,
                                                       "icrl_eval.cache_entries": entries}))

    def one(index: int) -> dict:
        run = with_overrides(configs[index], {"icrl_eval.threads": threads})
        with engine.stream() if hasattr(engine, "stream") else _no_context():
            return evaluate(run, resume=resume[index], progress=True, position=index % streams, engine=engine)

    try:
        with ThreadPoolExecutor(streams) as pool:
            futures = {pool.submit(one, index): index for index in range(len(configs))}
            for future in as_completed(futures):
                yield futures[future], future.result()
    finally:
        engine.close()


def _no_context():
    import contextlib

    return contextlib.nullcontext()


def run_evaluations(configs: list[PipelineConfig], workers: int, resume: list[bool] | None = None) -> list[dict]:
    """Run the evaluation `configs` (results in their order), `workers` at a time (`in_pool`), or as streams of one
    engine (`in_streams`) when `streams_supported`. `resume[i]`: continue config i's existing run folder."""
    resume = resume or [False] * len(configs)
    if configs and streams_supported(configs[0]):
        results = [None] * len(configs)
        for index, result in in_streams(configs, resume, configs[0].inference.streams):
            results[index] = result
        return results
    jobs = [(_evaluate_job, {"config_json": c.model_dump(mode="json"), "resume": r}) for c, r in zip(configs, resume)]
    results: list = [None] * len(configs)
    for index, result in in_pool(jobs, workers):
        results[index] = result
    return results


# Finished runs are kept here by `result_key` and reused while everything they depend on is unchanged (base-model
# runs do not depend on training); runs in progress live in partial/, forgetting measurements in ability/. All of
# it is outside the stage's DVC outs, which DVC deletes before the stage runs.
RESULT_CACHE = Path(".icrl") / "evaluations"
_ENGINE_SOURCES = ("icrl_core/inference/base.py", "icrl_core/inference/torch_backend.py")
_ABILITY_SOURCES = ("icrl_core/general_ability.py", "icrl_core/choice_probe.py", "icrl_core/generation.py",
                    "icrl_core/chat.py", "icrl_core/kernels.py", "icrl_core/model.py") + _ENGINE_SOURCES
_FEEDBACK_SOURCES = ("icrl_core/feedback_probe.py", "icrl_core/icrl_eval.py", "icrl_core/prompting.py",
                     "icrl_core/task_data.py", "tasks/icrl_eval.py")
_HARNESS_SOURCES = ("icrl_core/icrl_eval.py", "icrl_core/kernels.py", "icrl_core/chat.py", "icrl_core/prompting.py",
                    "icrl_core/task_data.py", "icrl_core/model.py", "tasks/icrl_eval.py") + _ENGINE_SOURCES


def adapter_digest(adapter: Path) -> str:
    """The sha256 of an adapter folder's files (names and bytes): retraining into the same folder changes it."""
    from icrl_core.io import sha256_folder

    return sha256_folder(adapter)


def _model_identity(config: PipelineConfig) -> dict:
    """The model settings a result depends on: the dtype and device as resolved on this machine, and a trained
    adapter by its content rather than its path. A CPU run leaves the device out: its identity is the one it
    had before `model.device` existed, so earlier results stay valid."""
    from icrl_core.device import resolve_device
    from icrl_core.model import resolve_dtype

    identity = {**config.model.model_dump(mode="json"), "dtype": resolve_dtype(config.model.dtype)}
    device = resolve_device(identity.pop("device")).type
    if device != "cpu":
        identity["device"] = device
    if config.model.init_adapter is not None:
        identity["init_adapter"] = adapter_digest(config.model.init_adapter)
    return identity


def _task_identity(config: PipelineConfig) -> dict:
    """What icrl_eval.task's data and prompt are: the data folder, the task folder's files by their bytes (a task
    folder edited in place is another task), and the prompt prefixes data.task_prompts sets."""
    from icrl_core.io import sha256_folder
    from icrl_core.task_data import task_folder

    folder = task_folder(config.icrl_eval.task, config.data.tasks_dir)
    return {"tasks_dir": str(Path(config.data.tasks_dir).resolve()),
            "files": sha256_folder(folder) if folder is not None and folder.is_dir() else None,
            "prompt": config.data.prompt_of(config.icrl_eval.task)}


def result_key(config: PipelineConfig) -> str:
    """A hash of what a run's outcome depends on: the model (dtype resolved on this machine, a trained adapter by
    the bytes of its files), the icrl_eval settings except speed-only ones, the seed, the task's data and prompt,
    the inference engine, and the harness's source code."""
    from tasks.icrl_eval import FREE_ON_RESUME

    return content_key({
        "model": _model_identity(config),
        "icrl_eval": {k: v for k, v in config.icrl_eval.model_dump(mode="json").items() if k not in FREE_ON_RESUME},
        "seed": config.seed, "task": _task_identity(config),
        "engine": engine_identity(config),
    }, _HARNESS_SOURCES + _BACKEND_SOURCES.get(config.inference.backend, ()))


# A backend beyond torch (the harness's own) is part of a run's key by its code too.
_BACKEND_SOURCES = {"vllm": ("icrl_core/inference/vllm_backend.py",)}


def engine_identity(config: PipelineConfig) -> str:
    """The backend, marked when the evaluate stage fuses the streams' passes (not bit-identical to exact runs)."""
    fused = config.inference.fuse_streams and config.inference.streams > 1
    return config.inference.backend + ("+fused" if fused else "")


def cached_result(config: PipelineConfig) -> dict | None:
    """A finished run with the same `result_key`, copied into this config's run folder; None if there is none."""
    cached = RESULT_CACHE / result_key(config)
    if not _finished(cached):
        return None
    return {**deliver(config, cached), "cached": True}


def _finished(run_dir: Path) -> bool:
    """Whether the run folder holds a finished run (its run.json says so and its metrics are written)."""
    import json

    try:
        info = json.loads((run_dir / "run.json").read_text())
        json.loads((run_dir / "metrics.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return info.get("status") == "finished"


def deliver(config: PipelineConfig, source: Path) -> dict:
    """Copy the finished run folder `source` to this config's run folder; its metrics, with that folder."""
    import json
    import shutil

    from tasks.icrl_eval import run_dir_for

    metrics = json.loads((source / "metrics.json").read_text())
    run_dir = run_dir_for(config.icrl_eval)
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(source, run_dir)
    metrics["test_accuracy"] = {int(step): value for step, value in metrics.get("test_accuracy", {}).items()}
    return {**metrics, "run_dir": str(run_dir)}


def work_config(config: PipelineConfig) -> PipelineConfig:
    """The same run computed in a folder named by its `result_key`, outside the stage's DVC outs (DVC deletes
    those before the stage runs): a stage killed mid-run resumes the run from its log when it runs again."""
    return with_overrides(config, {"icrl_eval.output_dir": str(RESULT_CACHE / "partial" / result_key(config))})


def store_result(config: PipelineConfig, run_dir: Path) -> None:
    """Keep a finished run under its `result_key` (written atomically; the first copy stored wins)."""
    import shutil

    from icrl_core.io import atomic_dir

    target = RESULT_CACHE / result_key(config)
    if target.exists():
        return
    try:
        with atomic_dir(target, overwrite=False) as tmp:
            shutil.copytree(run_dir, tmp, dirs_exist_ok=True)
    except FileExistsError:  # stored concurrently by another process
        pass


def gates(metrics: dict, cfg) -> dict:
    """What promotion requires besides beating the champion: the held-out gain over the base model, the gain
    over the trained model's own zero-shot accuracy (when asked and measured), and the forgetting check."""
    out = {"passes_gain": metrics["gain"] > cfg.min_gain,
           "passes_forgetting": metrics.get("forgetting_drop", 0.0) <= cfg.max_forgetting}
    if "forgetting_probe_change" in metrics:  # the probe resolves 2 points: a move either way counts
        out["passes_forgetting_probe"] = abs(metrics["forgetting_probe_change"]) <= cfg.max_forgetting + 1e-9
    if cfg.min_gain_over_zero_shot is not None and "trained_zero_shot_final_test_accuracy" in metrics:
        out["passes_gain_over_zero_shot"] = metrics["gain_over_zero_shot"] >= cfg.min_gain_over_zero_shot - 1e-9
    if cfg.min_gain_over_start is not None and "gain_over_start" in metrics:
        out["passes_gain_over_start"] = metrics["gain_over_start"] > cfg.min_gain_over_start
    out["eligible"] = all(out.values())
    return out


def run_order(configs: list[PipelineConfig]) -> list[int]:
    """The order runs start in: the adapters' runs first (in the given order), the base model's last. The base
    runs do not depend on training, so they are usually reused from the store; when they are not, the runs of
    what was just trained, the new information, finish first (a stage stopped part-way has them)."""
    return sorted(range(len(configs)), key=lambda i: configs[i].model.init_adapter is None)


def evaluation_results(configs: list[PipelineConfig], workers: int, reuse: bool, config: PipelineConfig | None = None,
                       ability_adapters: tuple = ()) -> tuple[list[dict], int, list[dict]]:
    """The finished runs of `configs` (each copied into its own run folder), how many were resumed, and the
    forgetting measurements (`general_ability` of the stage `config`) of each model in `ability_adapters` (None:
    the base model). A run whose `result_key` is stored is reused (when `reuse`); the others run in their work
    folders (`work_config`), continuing from the log a killed stage left there, in `run_order`, `workers` at a
    time with the measurements after the last ones (`pool_waves`); each finished run is stored at once."""
    import shutil

    from tasks.icrl_eval import run_dir_for

    def keep(i: int, work_dir: Path) -> dict:
        store_result(configs[i], work_dir)
        delivered = deliver(configs[i], work_dir)
        shutil.rmtree(work_dir.parent, ignore_errors=True)
        return delivered

    results: list[dict | None] = [cached_result(c) if reuse else None for c in configs]
    jobs, owners, resumed = [], [], 0
    for i in run_order(configs):
        run_config = configs[i]
        if results[i] is not None:
            continue
        work_run = work_config(run_config)
        work_dir = run_dir_for(work_run.icrl_eval)
        if _finished(work_dir):  # killed after the run finished and before it was stored
            results[i] = keep(i, work_dir)
            continue
        again = (work_dir / "config.json").exists()
        if again:
            _follow_adapter(work_dir, work_run)
        else:
            for key, steps in superseded_partials(work_run):
                log.warning("%s (seed %d) starts from step 0: the partial run in %s (%d steps logged) has the same "
                            "settings and adapter path but another result key (the harness code or the adapter's "
                            "bytes changed since), so it cannot resume; it is left in place",
                            work_dir.name, run_config.icrl_eval.seed, RESULT_CACHE / "partial" / key, steps)
        resumed += again
        jobs.append((_evaluate_job, {"config_json": work_run.model_dump(mode="json"), "resume": again}))
        owners.append(("run", i))
    if jobs and streams_supported(configs[0]):  # the runs as streams of one engine here, then the measurements
        runs = [kwargs for _, kwargs in jobs]
        for index, result in in_streams([PipelineConfig.model_validate(k["config_json"]) for k in runs],
                                        [k["resume"] for k in runs], configs[0].inference.streams):
            results[owners[index][1]] = keep(owners[index][1], Path(result["run_dir"]))
        jobs, owners = [], []
    abilities: list[dict | None] = [stored_ability(config, a) for a in ability_adapters] if config else []
    for j, adapter in enumerate(ability_adapters):
        if abilities[j] is None:
            jobs.append((_ability_job, {"config_json": config.model_dump(mode="json"),
                                        "adapter": str(adapter) if adapter else None}))
            owners.append(("ability", j))
    for wave, wave_workers in pool_waves([kind for kind, _ in owners], workers):
        for index, result in in_pool([jobs[j] for j in wave], wave_workers):
            kind, i = owners[wave[index]]
            if kind == "run":
                results[i] = keep(i, Path(result["run_dir"]))
            else:
                abilities[i] = result
    return results, resumed, abilities


def pool_waves(kinds: Sequence[str], workers: int) -> list[tuple[list[int], int]]:
    """The stage's jobs (each "run" or "ability", in start order) as waves, each (job indices, processes), run one
    after another. A process keeps its cpu_count / workers torch threads for its whole run, so a run started
    beside another keeps one thread of two cores after the other ends (a 1000-step naive run: 4.8 s per step on
    one thread, 2.5-3.0 on both). So the runs go `workers` at a time, the measurements with the last ones; a wave
    with a single run gives it the whole machine and its measurements run in turn. Three runs on two cores: two
    side by side, then the third on both cores (about 40 minutes sooner than on the one thread a shared pool
    leaves it). A wave waits for its slowest run."""
    runs = [j for j, kind in enumerate(kinds) if kind == "run"]
    waves = [runs[start:start + workers] for start in range(0, len(runs), workers)] or [[]]
    waves[-1] = waves[-1] + [j for j, kind in enumerate(kinds) if kind != "run"]
    return [(wave, 1 if sum(kinds[j] == "run" for j in wave) == 1 else workers) for wave in waves if wave]


def superseded_partials(work_run: PipelineConfig) -> list[tuple[str, int]]:
    """Partial runs under another result key with this run's name and saved settings (everything but the output
    folder, adapter path included): a run parked before the harness code or the adapter changed, which this run
    cannot resume. Each as (its key, the steps its log holds), so a restart from step 0 is never silent."""
    import json

    from tasks.icrl_eval import run_dir_for

    mine = run_dir_for(work_run.icrl_eval)
    wanted = _comparable(work_run.model_dump(mode="json"))
    found = []
    for other in sorted((RESULT_CACHE / "partial").glob(f"*/{mine.name}/config.json")):
        if other.parent == mine:
            continue
        try:
            saved = json.loads(other.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if _comparable(saved) == wanted:
            steps = other.parent / "steps.jsonl"
            logged = len(steps.read_bytes().splitlines()) if steps.exists() else 0
            found.append((other.parent.parent.name, logged))
    return found


def _comparable(saved: dict) -> dict:
    """A run's saved config without what differs between work folders of the same run (the output folder)."""
    icrl_eval = {k: v for k, v in saved.get("icrl_eval", {}).items() if k != "output_dir"}
    return {"model": saved.get("model"), "icrl_eval": icrl_eval, "seed": saved.get("seed")}


def _follow_adapter(work_dir: Path, work_run: PipelineConfig) -> None:
    """A run folder named by its `result_key` holds a run of an adapter with these very bytes: if the adapter has
    moved since, the run's saved config follows it (the harness refuses to resume a run of another adapter path)."""
    import json

    from icrl_core.io import atomic_write_json

    saved = json.loads((work_dir / "config.json").read_text())
    now = str(work_run.model.init_adapter) if work_run.model.init_adapter is not None else None
    if saved.get("model", {}).get("init_adapter") != now:
        saved["model"]["init_adapter"] = now
        atomic_write_json(work_dir / "config.json", saved)


def run(config: PipelineConfig) -> dict:
    import shutil

    from icrl_core.adapter_format import require_adapter
    from icrl_core.io import atomic_write_json
    from tasks.icrl_eval import plot_learning_curves
    from tasks.runtime import write_stage_metrics
    from tasks.tracking import stage_run

    cfg = config.evaluate
    adapter = require_adapter(cfg.adapter, "evaluate.adapter", "run the ppo stage first")
    if cfg.feedback_probe_target is not None:  # a label the task lacks fails now, not after the runs
        from icrl_core.feedback_probe import probe_examples
        from tasks.icrl_eval import load_eval_task

        probe_examples(load_eval_task(config), cfg.feedback_probe_target, cfg.feedback_probe_queries,
                       config.icrl_eval.seed)
    out = Path(cfg.output_dir)
    shutil.rmtree(out / "runs", ignore_errors=True)  # refilled from the finished runs (evaluation_results)
    shutil.rmtree(out / "adapter", ignore_errors=True)
    started = time.perf_counter()
    metrics: dict = {"task": config.icrl_eval.task, "trained_adapter": str(adapter),
                     "adapter_scale": cfg.adapter_scale}
    if cfg.adapter_scale != 1.0:
        adapter = interpolated_adapter(config, adapter, cfg.adapter_scale, out / "adapter")
    metrics["adapter"] = str(adapter)  # the weights evaluated here, and the ones the promote stage registers
    metrics["adapter_sha256"] = adapter_digest(adapter)  # promotion checks it still holds these bytes
    headline = cfg.strategies[0]
    models = [("base", None), ("trained", adapter)]
    if cfg.start_adapter is not None:  # the adapter training started from: the last stage's own gain
        models.append(("start", require_adapter(cfg.start_adapter, "evaluate.start_adapter",
                                                "run the stage that writes it first")))
        metrics["start_adapter"] = str(cfg.start_adapter)
    jobs = [(strategy, which, adapter_dir) for strategy in cfg.strategies for which, adapter_dir in models]
    with stage_run(config, STAGE) as tracker:
        configs = [_eval_config(config, *job) for job in jobs]
        measured = ((None, adapter) if cfg.forgetting_questions or cfg.forgetting_probe_items
                    or cfg.feedback_probe_target is not None else ())
        results, resumed, abilities = evaluation_results(configs, cfg.workers, cfg.reuse_runs, config, measured)
        metrics["runs_reused"] = sum(bool(r.get("cached")) for r in results)
        metrics["runs_resumed"] = resumed
        run_dirs = []
        for (strategy, which, _), result in zip(jobs, results):
            run_dirs.append(Path(result["run_dir"]))
            prefix = f"{which}_{strategy}"
            metrics[f"{prefix}_final_test_accuracy"] = result["final_test_accuracy"]
            metrics[f"{prefix}_train_accuracy"] = result["train_accuracy"]
            metrics[f"{prefix}_regret"] = result["regret"]
            # near 1.0: the run copies one answer whatever the reward, so its accuracy is a label share
            metrics[f"{prefix}_repeat_after_wrong"] = result.get("repeat_after_wrong")
            metrics[f"{prefix}_seconds"] = round(result["seconds"], 1)  # the run's own compute time
            if strategy == headline:
                metrics[f"{which}_final_test_accuracy"] = result["final_test_accuracy"]
            for step, accuracy in result["test_accuracy"].items():
                tracker.log_metrics({f"{prefix}_test_accuracy": accuracy}, step=int(step))
        plot_learning_curves(run_dirs, out / "learning_curve.png",
                             title=f"{config.icrl_eval.task}: base vs trained",
                             labels=[d.name for d in run_dirs])
        metrics["gain"] = metrics["trained_final_test_accuracy"] - metrics["base_final_test_accuracy"]
        if "trained_zero_shot_final_test_accuracy" in metrics:
            metrics["gain_over_zero_shot"] = (metrics["trained_final_test_accuracy"]
                                              - metrics["trained_zero_shot_final_test_accuracy"])
        if "start_final_test_accuracy" in metrics:
            metrics["gain_over_start"] = metrics["trained_final_test_accuracy"] - metrics["start_final_test_accuracy"]
        report: dict = {"metrics": metrics}
        if measured:
            base_ability, trained_ability = abilities
        if cfg.forgetting_questions:
            base, trained = base_ability["greedy"], trained_ability["greedy"]
            metrics.update(forgetting_base_accuracy=base["accuracy"], forgetting_trained_accuracy=trained["accuracy"],
                           forgetting_drop=base["accuracy"] - trained["accuracy"],
                           forgetting_base_nll=base["answer_nll"], forgetting_trained_nll=trained["answer_nll"])
            metrics.update(forgetting_paired_metrics(base["answers"], trained["answers"]))
            report["forgetting"] = {"base": base["answers"], "trained": trained["answers"]}
        if cfg.forgetting_probe_items:
            base, trained = base_ability["probe"], trained_ability["probe"]
            metrics.update(forgetting_probe_metrics(base, trained))
            report["forgetting_probe"] = {"base": base, "trained": trained}
        if cfg.feedback_probe_target is not None:
            feedback = {"base": base_ability["feedback"], "trained": trained_ability["feedback"]}
            metrics.update(feedback_probe_metrics(feedback))
            report["feedback_probe"] = feedback
        metrics.update(gates(metrics, cfg))
        metrics["seconds"] = round(time.perf_counter() - started, 1)
        atomic_write_json(out / "report.json", report)
        atomic_write_json(out / "metrics.json", metrics)  # the full record; what the promote stage reads
        tracker.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        for item in ("learning_curve.png", "report.json", "runs"):
            tracker.log_artifact(out / item, None if item != "runs" else "runs")
    write_stage_metrics(STAGE, metrics, headline=(cfg.metric, *HEADLINE))
    return metrics

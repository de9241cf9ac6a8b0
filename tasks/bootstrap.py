"""Stage `bootstrap`: supervised training on the answer tokens of the tokenized episodes with a KL(policy ||
base) penalty (icrl_core/supervised.py).

Outputs (rank 0, atomic): bootstrap.output_dir/adapter/ (policy.save_adapter), metrics.json, history.json (every
step's metrics, for `dvc plots`), curves.png; metrics/bootstrap.json; MLflow params, step metrics, the adapter and
the curves. Resumes from the last checkpoint after a kill (the runtime finds it); a corrupt checkpoint is refused
(CheckpointError, exit code 2).
"""

from __future__ import annotations

from pathlib import Path

from tasks.settings import PipelineConfig

STAGE = "bootstrap"
HEADLINE = ("val_answer_accuracy", "val_kl")  # metrics/bootstrap.json; the rest: output_dir/metrics.json


# Sampled replay replies, kept outside the stage's DVC out (DVC deletes it before the stage runs, and sampling takes
# minutes): one file per `replay_key`, so a rerun after a crash, or with other training settings, reuses them.
REPLAY_CACHE = Path(".icrl") / "replay"
_REPLAY_SOURCES = ("icrl_core/replay.py", "icrl_core/chat.py", "icrl_core/model.py", "icrl_core/task_data.py")


def replay_key(config: PipelineConfig) -> str:
    """What the replay chats depend on: the base model (its spec and the dtype resolved on this machine; the
    replies are sampled with the adapters disabled), the seed, the data folder, the replay settings that shape
    the chats (not beta or per_step, which only weigh them) and the code that samples them."""
    from icrl_core.model import resolve_dtype
    from tasks.runtime import content_key

    replay = config.bootstrap.replay
    return content_key({"spec": config.model.spec, "dtype": resolve_dtype(config.model.dtype), "seed": config.seed,
                        "tasks_dir": str(Path(config.data.tasks_dir).resolve()),
                        **replay.model_dump(mode="json", exclude={"beta", "per_step"})}, _REPLAY_SOURCES)


def replay_chats(config: PipelineConfig, policy, rank: int) -> tuple[list, list] | None:
    """The replay chats (train, validation) when bootstrap.replay.beta > 0: read from the cache
    (.icrl/replay/<replay_key>.jsonl) when they were sampled before, else sampled from the base model (every rank
    samples the same ones: deterministic in the seed) and written there atomically by rank 0."""
    from icrl_core.replay import read_replay, replay_prompts, sample_replies, write_replay
    from icrl_core.task_data import load_task

    replay = config.bootstrap.replay
    if replay.beta <= 0:
        return None
    key = replay_key(config)
    path = REPLAY_CACHE / f"{key}.jsonl"
    chats = read_replay(path, key)
    if chats is None:
        from tqdm import tqdm

        texts = [ex.text for name in replay.tasks
                 for ex in load_task(name, config.data.tasks_dir, seed=config.seed).train]
        prompts = replay_prompts(texts, replay.prompts, config.seed)
        chats = sample_replies(policy, prompts, replay.max_new_tokens, replay.temperature, config.seed,
                               progress=lambda b: tqdm(b, desc="replay: sampling base replies", unit="batch"))
        if rank == 0:
            write_replay(path, chats, key)
    val = chats[::10]
    train = [c for i, c in enumerate(chats) if i % 10]
    return train, val


def train_worker(config: PipelineConfig, runtime) -> dict:
    from icrl_core.model import policy_from_config
    from icrl_core.supervised import finite, train_bootstrap
    from icrl_core.tokenized import read_tokenized

    cfg = config.bootstrap
    rows = read_tokenized(config.tokenize.output_dir)
    train = [r for r in rows if r.split == "train"]
    val = [r for r in rows if r.split == "val"]
    from tasks.runtime import ProgressRuntime
    from tasks.training import write_history

    policy = policy_from_config(config.model, seed=config.seed)
    with ProgressRuntime(runtime, cfg.max_steps, STAGE, ("loss", "kl", "val_answer_accuracy")) as progress:
        replay = replay_chats(config, policy, runtime.rank)
        metrics, history = train_bootstrap(policy, train, val, cfg, config.seed, progress, replay=replay)
    if runtime.rank == 0:
        out = Path(cfg.output_dir)
        policy.save_adapter(out / "adapter")
        panels = {"loss": ["loss", "ce", "val_loss", "val_ce"],
                  "KL(policy || base)": ["kl", "val_kl", "replay_kl", "val_replay_kl"],
                  "validation answer accuracy": ["val_answer_accuracy"]}
        write_history(out, history, panels, f"bootstrap ({config.model.spec})")
    return finite(metrics)


def run(config: PipelineConfig) -> dict:
    from tasks.training import run_training_stage

    return run_training_stage(config, STAGE, train_worker, config.bootstrap.output_dir,
                              {"adapter": "adapter", "curves.png": None}, HEADLINE)

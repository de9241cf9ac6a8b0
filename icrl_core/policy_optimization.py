"""The `ppo` stage's training: PPO on the built episodes (icrl_core/ppo.py), with `ppo.mode: stream` the
configured objective on in-context RL streams (icrl_core/stream_rl.py), with `ppo.mode: code` on groups of
completions of code tasks rewarded in the sandbox (icrl_core/code_rl.py), all on the shared training loop
(icrl_core/training_loop.py).

One iteration rolls out (episodes, streams or code completions), updates the policy (with `ppo.replay` on, each
optimizer step of the update also carries the bootstrap's general-chat replay term), then moves the KL coefficient
(`ppo.kl_control`). The validation set is answered once before the first iteration (step 0), every
`ppo.eval_steps` and after the last iteration; a checkpoint (weights, value head, optimizer, schedule, RNG, the KL
coefficient, history and evaluations) is written every `ppo.save_steps` iterations and after the last.
"""

from __future__ import annotations

import torch

from icrl_core.config import PPOConfig
from icrl_core.distributed import shard, world_size
from icrl_core.errors import UserError
from icrl_core.ppo import (
    episode_indices,
    evaluate,
    iteration_generator,
    load_trainable_tensors,
    make_optimizer,
    next_kl_coefficient,
    ppo_step,
    summarize,
    trainable_tensors,
)
from icrl_core.supervised import evaluate_replay, replay_enabled, replay_step
from icrl_core.training_loop import Schedule, Trainer, run_loop


def train_ppo(policy, train_episodes, val_episodes, cfg: PPOConfig, seed: int, runtime, max_tokens: int,
              scorer=None, stream_sources=None, code=None, rollout_source=None, replay=None, rollout_engine=None
              ) -> tuple[dict[str, float], list[dict], list[dict]]:
    """PPO iterations 1..max_steps (resuming after the last checkpoint). Returns (summary, history, evals).

    Data-parallel: each rank rolls out its shard of the iteration's episodes; gradients are averaged.
    `ppo.mode=stream` rolls out in-context RL streams instead (icrl_core/stream_rl.py); `stream_sources` is then
    (resolved data.sources, the data config) and the episodes are not used. `ppo.mode=code` rolls out code
    tasks (icrl_core/code_rl.py); `code` is then the pipeline's `code` section (tasks, sandbox, reward) and
    `scorer` the reward model of the reward_model component. With `ppo.async_rollouts.enabled` the streams come
    from `rollout_source` (actors: tasks/async_rollouts.RolloutPool) on the schedule of
    icrl_core/async_rollouts.py, and the checkpoints also hold the weights of the rollouts in flight.
    With `replay` = (train, validation) general-chat replay chats (icrl_core/replay.py) and `cfg.replay.beta` > 0,
    every optimizer step of iteration s adds `supervised.replay_step` on `cfg.replay.per_step` chats drawn as a
    pure function of (seed, s) (the same ones for the sub-steps of an iteration, as PPO reuses its rollouts), and
    every evaluation the validation replay KL. `rollout_engine` (stream_rl.RolloutEngine, `ppo.stream.engine:
    inference`) decodes the synchronous stream rollouts and validation streams through an inference engine."""
    streams, code_mode = cfg.mode == "stream", cfg.mode == "code"
    per_step, what = {"stream": (cfg.stream.groups, "ppo.stream.groups"),
                      "code": (cfg.code.tasks_per_step, "ppo.code.tasks_per_step")}.get(
        cfg.mode, (cfg.rollout_episodes, "ppo.rollout_episodes"))
    if per_step % world_size():
        # every worker must run the same number of minibatches: gradient averaging is a collective
        raise UserError(f"{what}={per_step} must be a multiple of the number of data-parallel workers "
                        f"({world_size()})")
    if cfg.reference == "start":  # before the loop restores a checkpoint: the reference is where the run began
        policy.freeze_reference()
    optimizer, scheduler = make_optimizer(policy, cfg)
    replay_on = replay_enabled(replay, cfg.replay)

    def regularizer_of(step: int):
        """The replay term of iteration `step`'s optimizer steps (None: replay off)."""
        if not replay_on:
            return None
        return lambda: replay_step(policy, replay[0], cfg.replay, seed, step, cfg.minibatch_size, world_size())

    beta = cfg.kl_beta  # the KL coefficient of the next iteration (moves under ppo.kl_control: adaptive)
    runner = None  # asynchronous rollouts
    if streams:
        from icrl_core import stream_rl

        sources, data = stream_sources
        n_rollouts = cfg.stream.groups * cfg.stream.group_size

        def run_step(step: int, generator: torch.Generator) -> dict[str, float]:
            return stream_rl.stream_step(policy, optimizer, scheduler, sources, data, cfg, beta, seed, step,
                                         generator, max_tokens, regularizer_of(step), rollout_engine)

        if cfg.async_rollouts.enabled:
            runner, run_step = async_stream_steps(policy, optimizer, scheduler, sources, data, cfg, seed, max_tokens,
                                                  rollout_source, lambda: beta, regularizer_of)

        def run_eval() -> dict[str, float]:
            return stream_rl.evaluate_streams(policy, sources, data, cfg, seed, max_tokens, rollout_engine)

        has_val = cfg.stream.eval_groups > 0
    elif code_mode:
        from icrl_core import code_rl

        task_set = code_rl.CodeTaskSet.from_config(code)
        eval_tasks = code_rl.eval_sample(task_set.test, cfg.code.eval_tasks, seed)
        n_rollouts = cfg.code.tasks_per_step * cfg.code.group_size

        def run_step(step: int, generator: torch.Generator) -> dict[str, float]:
            return code_rl.code_step(policy, optimizer, scheduler, task_set, code, cfg, beta, seed, step, generator,
                                     max_tokens, scorer, regularizer_of(step))

        def run_eval() -> dict[str, float]:
            return code_rl.evaluate_greedy(policy, eval_tasks, task_set.shot, code, cfg.code.max_new_tokens,
                                           max_tokens, cfg.batch_size)

        has_val = bool(eval_tasks)
    else:
        n_rollouts = cfg.rollout_episodes
        val = list(val_episodes)[:cfg.eval_episodes]

        def run_step(step: int, generator: torch.Generator) -> dict[str, float]:
            indices = shard(episode_indices(len(train_episodes), cfg.rollout_episodes, step, seed))
            return ppo_step(policy, optimizer, scheduler, [train_episodes[i] for i in indices], cfg, beta,
                            generator, max_tokens, scorer, regularizer_of(step))

        def run_eval() -> dict[str, float]:
            return evaluate(policy, val, cfg, max_tokens, scorer)

        has_val = bool(val)

    if replay_on and len(replay[1]) > 0:  # each evaluation also measures the replay chats held back
        evaluate_mode, mode_has_val = run_eval, has_val

        def run_eval() -> dict[str, float]:
            return {**(evaluate_mode() if mode_has_val else {}),
                    **evaluate_replay(policy, replay[1], cfg.minibatch_size)}

        has_val = True

    def step(number: int) -> dict[str, float]:
        nonlocal beta
        metrics = run_step(number, iteration_generator(seed, number))
        beta = next_kl_coefficient(cfg.kl_control, beta, metrics["kl"], n_rollouts)
        return metrics

    def load_state(extra) -> None:
        nonlocal beta
        beta = float(extra["beta"])

    def tensors() -> dict[str, torch.Tensor]:
        return {**trainable_tensors(policy), **(runner.checkpoint_tensors() if runner is not None else {})}

    def load_tensors(saved: dict[str, torch.Tensor]) -> None:
        load_trainable_tensors(policy, runner.restore(saved) if runner is not None else saved)

    trainer = Trainer(step, optimizer, scheduler, policy.trainable_parameters(), tensors, load_tensors,
                      run_eval if has_val else None, state=lambda number: {"beta": beta}, load_state=load_state)
    result = run_loop(trainer, Schedule(cfg.max_steps, cfg.eval_steps, cfg.save_steps, evaluate_first=True),
                      runtime)
    return summarize(result.history, result.evals), result.history, result.evals


def async_stream_steps(policy, optimizer, scheduler, sources, data, cfg: PPOConfig, seed: int, max_tokens: int,
                       source, beta_now, regularizer_of=lambda step: None):
    """(runner, run_step) of stream mode with asynchronous rollouts: step s takes the rollout the actors
    generated with version max(0, s - 1 - K), learns from it off-policy (pi_old = the behaviour policy), then
    pushes the new version (icrl_core/async_rollouts.py). The first step starts the pipeline from the weights it
    finds (fresh, or restored with the checkpoint's older versions)."""
    import time

    from icrl_core import stream_rl
    from icrl_core.async_rollouts import AsyncStreams, rollout_lag

    if source is None:
        raise ValueError("ppo.async_rollouts.enabled needs a rollout source (tasks/async_rollouts.RolloutPool)")
    options = cfg.async_rollouts

    def tasks_of(step: int):
        return stream_rl.stream_tasks(sources, data, cfg, seed, step, shard(range(cfg.stream.groups)), "train")

    runner = AsyncStreams(source, tasks_of, options.max_async_level, cfg.max_steps)

    def run_step(step: int, generator: torch.Generator) -> dict[str, float]:
        if not runner.started:
            runner.start(step - 1, policy.trainable_state_dict())
        started = time.perf_counter()
        rollout = runner.take(step)
        lag = rollout_lag(step, rollout.version)
        metrics = stream_rl.learn_from_streams(
            policy, optimizer, scheduler, rollout.streams, cfg, beta_now(), generator, started,
            time.perf_counter() - started,
            {"async_version": float(rollout.version), "async_lag": float(lag),
             "actor_rollout_seconds": rollout.seconds}, regularizer_of(step))
        runner.updated(step, policy.trainable_state_dict())
        return metrics

    return runner, run_step

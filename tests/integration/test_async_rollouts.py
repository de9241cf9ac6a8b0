"""Asynchronous stream rollouts (ppo.async_rollouts) on real local Ray actors and the tiny model: weights reach the
actors, the lag bound holds (level 0 is the synchronous run), training resumes exactly, the stage runs end to
end, and bad settings exit 2 (the actors import the code shipped in the runtime_env:
tests/integration/test_ray_runtime_env.py). The schedule by hand and the
config errors: tests/unit/test_async_rollouts.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from icrl_core.async_rollouts import behaviour_version
from icrl_core.config import DataConfig, LoraAdapter, SyntheticSource
from tasks.settings import load_config
from tests.conftest import Killed, MemoryRuntime, call_cli

DATA = DataConfig(sources=[SyntheticSource(name="keyword_map")], labels_per_episode=3, labels_per_episode_min=2)
ASYNC_KEYS = ("async_version", "async_lag", "actor_rollout_seconds", "is_ratio_mean", "is_ratio_min",
              "is_ratio_max", "is_ratio_capped")

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    """A local Ray (2 CPUs) started from a short temporary folder (Ray's sockets live under <cwd>/.icrl/ray)."""
    import os
    import shutil
    import tempfile
    from pathlib import Path

    import ray

    from tasks.ray_train import ensure_ray

    folder = Path(tempfile.mkdtemp(prefix="icrl-async-", dir="/tmp"))
    old = os.getcwd()
    os.chdir(folder)
    ensure_ray(load_config(None, [], environ={}).ray)
    yield folder
    ray.shutdown()
    os.chdir(old)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def policy():
    from icrl_core.model import load_policy

    return load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4))


def fresh(policy) -> None:
    from icrl_core.ppo import load_trainable_tensors, trainable_tensors

    if not hasattr(policy, "_initial"):
        policy._initial = {k: v.clone() for k, v in trainable_tensors(policy).items()}
    load_trainable_tensors(policy, policy._initial)


# One stream setting for every run here, so one pool of actors serves them all (actors start slowly on a busy
# machine): 2 groups of 2 streams of 3 steps per iteration.
STREAM = ["ppo.stream={steps: 3, group_size: 2, groups: 2, eval_groups: 1}", "ppo.epochs=1", "ppo.minibatch_size=2",
          "ppo.batch_size=4", "ppo.learning_rate=1e-2", "ppo.kl_beta=0.02", "ppo.save_steps=1"]
# Two actors of half a CPU each: the stage test's own actor fits beside them in the local Ray's 2 CPUs.
ACTORS = "ppo.async_rollouts={enabled: true, actors: 2, actor_cpus: 0.5}"


def pipeline_config(*items: str):
    return load_config(None, ["model.spec=tiny", "model.adapter={kind: lora, rank: 4}", "ppo.mode=stream",
                              "ppo.objective={kind: grpo}", *STREAM, *items], environ={})


@pytest.fixture(scope="module")
def pool(ray_session, policy):
    from tasks.async_rollouts import RolloutPool

    with RolloutPool(pipeline_config(ACTORS), policy.adapter, 2048) as pool:
        yield pool


def test_an_actor_rolls_out_with_the_last_weights_pushed_to_it(pool, policy):
    """Version 0, then perturbed weights as version 1: each rollout reports its version, its streams are the
    trainer's own rollout with those weights, and its behaviour log-probs are the trainer's log-probs of them."""
    from icrl_core.dataset_build import resolve_sources
    from icrl_core.stream_rl import roll_out, stream_tasks
    from icrl_core.streams import collate_streams, stream_outputs

    fresh(policy)
    cfg = pipeline_config().ppo
    tasks = stream_tasks(resolve_sources(DATA, 0), DATA, cfg, 0, 1, range(2), "train")
    logps = []
    for version in (0, 1):
        if version == 1:
            with torch.no_grad():
                for name, param in policy.model.named_parameters():
                    if "lora_B" in name:
                        param.normal_(std=0.2, generator=torch.Generator().manual_seed(1))
        pool.push(version, policy.trainable_state_dict())
        pool.start(1, tasks)
        rollout = pool.result(1)
        assert rollout.version == version and rollout.seconds > 0
        assert [s.group for s in rollout.streams] == [0, 0, 1, 1]  # both actors' streams, in group order
        batch = collate_streams(rollout.streams, policy.tokenizer.pad_token_id)
        with torch.no_grad():
            trainer_logp, _, _ = stream_outputs(policy, batch, cfg.temperature, with_values=False)
        assert torch.allclose(batch.behaviour_logp * batch.action_mask, trainer_logp, atol=1e-4)
        local = roll_out(policy, resolve_sources(DATA, 0), DATA, cfg, 0, 1, range(2), "train", 2048)
        assert [s.input_ids for s in local] == [s.input_ids for s in rollout.streams]
        logps.append(batch.behaviour_logp)
    assert not torch.allclose(logps[0], logps[1], atol=1e-3)  # the new weights were used
    fresh(policy)


def train(policy, config, runtime, pool=None):
    """train_ppo as the stage runs it, the rollouts from `pool` when async rollouts are on."""
    from icrl_core.dataset_build import resolve_sources
    from icrl_core.policy_optimization import train_ppo

    return train_ppo(policy, [], [], config.ppo, 0, runtime, 2048, None, (resolve_sources(DATA, 0), DATA),
                     rollout_source=pool if config.ppo.async_rollouts.enabled else None)


def timeless(rows, drop=()):
    return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()
             if "seconds" not in k and k not in drop} for row in rows]


def test_the_lag_bound_holds_and_level_0_is_the_synchronous_run(pool, policy):
    """From the versions the actors recorded: every consumed rollout is at most max_async_level versions old
    (exactly min(s - 1, K)); with K = 0 every rollout comes from the weights of the previous step and the run
    equals the synchronous one (same streams, metrics and weights)."""
    from icrl_core.ppo import trainable_tensors

    fresh(policy)
    _, sync, _ = train(policy, pipeline_config("ppo.max_steps=3", "ppo.eval_steps=3"), MemoryRuntime())
    sync_weights = {k: v.clone() for k, v in trainable_tensors(policy).items()}
    assert not set(ASYNC_KEYS) & set(sync[0])  # the synchronous history is as before
    runs = {}
    for level in (0, 2):
        fresh(policy)
        config = pipeline_config("ppo.max_steps=3", "ppo.eval_steps=3", ACTORS,
                                 f"ppo.async_rollouts.max_async_level={level}")
        _, history, _ = train(policy, config, MemoryRuntime(), pool)
        runs[level] = history
        for row in history:
            step = row["step"]
            assert row["async_version"] == behaviour_version(step, level)
            assert 0 <= row["async_lag"] == step - 1 - row["async_version"] == min(step - 1, level) <= level
            assert math.isfinite(row["is_ratio_mean"]) and row["is_ratio_min"] <= row["is_ratio_max"]
        if level == 0:
            # the same streams and metrics; the KL terms to 1e-7: the behaviour log-probs come from the actor's
            # process, whose kernels may round the last bit differently from the trainer's (seen on AVX512 CPUs:
            # kl 1.5e-8 vs 3.0e-8, approx_kl 0.0148047876 vs 0.0148047926)
            for row, sync_row in zip(timeless(history, ASYNC_KEYS), timeless(sync), strict=True):
                assert row.keys() == sync_row.keys()
                assert all(math.isclose(v, sync_row[k], rel_tol=1e-5, abs_tol=1e-7) if isinstance(v, float)
                           else v == sync_row[k] for k, v in row.items()), (row, sync_row)
            diffs = {k: float((sync_weights[k] - v).abs().max()) for k, v in trainable_tensors(policy).items()}
            assert max(diffs.values()) < 1e-5, diffs
    assert [row["async_lag"] for row in runs[2]] == [0, 1, 2]
    assert runs[2][2]["is_ratio_mean"] != pytest.approx(1.0, abs=1e-6)  # stale rollouts: pi / mu moved off 1
    fresh(policy)


def test_async_training_resumes_exactly(pool, policy):
    """max_async_level 1, a checkpoint after every step: a run killed after its second checkpoint and resumed
    (the older version of the rollout in flight from the checkpoint) ends with the uninterrupted run's history and
    weights."""
    from icrl_core.ppo import trainable_tensors

    config = pipeline_config("ppo.max_steps=3", "ppo.eval_steps=3", ACTORS, "ppo.async_rollouts.max_async_level=1")
    fresh(policy)
    _, history, _ = train(policy, config, MemoryRuntime(), pool)
    weights = {k: v.clone() for k, v in trainable_tensors(policy).items()}
    fresh(policy)
    saved: list = []
    with pytest.raises(Killed):
        train(policy, config, MemoryRuntime(saved, kill_after=2), pool)
    assert any(key.startswith("async_rollouts.v1.") for key in saved[-1].tensors)  # the in-flight version
    fresh(policy)
    _, resumed, _ = train(policy, config, MemoryRuntime(saved), pool)
    assert timeless(resumed) == timeless(history)
    diffs = {k: float((weights[k] - v).abs().max()) for k, v in trainable_tensors(policy).items()}
    assert not any(diffs.values()), diffs
    fresh(policy)


def test_the_stage_runs_end_to_end_with_async_rollouts(ray_session, pool, tmp_path, monkeypatch):
    """The ppo stage with its own actor (1 CPU, beside the module's two halves), weights through files, aipo."""
    from tasks.ppo import run

    monkeypatch.chdir(tmp_path)
    items = ["model.spec=tiny", "tracking.enabled=false", "ppo.mode=stream", "ppo.max_steps=3", "ppo.save_steps=1",
             "ppo.stream={steps: 3, group_size: 2, groups: 2, eval_groups: 1}", "ppo.objective={kind: aipo}",
             "ppo.batch_size=4", "ppo.minibatch_size=2", "ppo.epochs=1", "ppo.eval_steps=3",
             "ppo.learning_rate=1e-2", "data.sources=[{kind: synthetic, name: keyword_map}]",
             "data.labels_per_episode=3", "ppo.async_rollouts={enabled: true, actors: 1, max_async_level: 1, "
             f"transport: file, weights_dir: {tmp_path / 'weights'}}}"]
    metrics = run(load_config(None, items, environ={}))
    out = tmp_path / "artifacts" / "ppo"
    history = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2, 3] and metrics["iterations"] == 3
    assert [h["async_lag"] for h in history] == [0, 1, 1]
    assert all(h["is_ratio_max"] <= 8.0 or h["is_ratio_capped"] > 0 for h in history)  # aipo's delta
    assert (out / "adapter" / "adapter_model.safetensors").exists() and (out / "reward_curve.png").exists()
    assert list((tmp_path / "weights").iterdir()) == []  # no weight file is left behind


def test_bad_async_settings_exit_2_with_one_message(tmp_path):
    result = call_cli("stage", "ppo", "--set", "ppo.mode=stream", "--set",
                      "ppo.async_rollouts={enabled: true, transport: file}", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "transport=file needs weights_dir" in result.stderr


def test_actors_that_do_not_fit_the_cpus_are_a_user_error(ray_session, policy):
    from icrl_core.errors import UserError
    from tasks.async_rollouts import RolloutPool

    with pytest.raises(UserError, match="do not fit the .* CPUs Ray has free"):
        RolloutPool(pipeline_config("ppo.async_rollouts={enabled: true, actors: 3}"), policy.adapter, 2048)


"""The PPO stage in stream mode (icrl_core/stream_rl.py, tiny model): stream training resumes exactly, and the
stage needs no built dataset and writes its outputs. Its parts: tests/unit/test_stream_rl.py."""

from __future__ import annotations

import json
import math

import pytest

from icrl_core.config import LoraAdapter, PPOConfig
from icrl_core.dataset_build import resolve_sources
from icrl_core.ppo import trainable_tensors, zero_value_head
from tasks.settings import load_config
from tests.conftest import Killed, MemoryRuntime, perturb_lora_b
from tests.unit.test_stream_rl import DATA, fresh


@pytest.fixture(scope="module")
def policy():
    """One tiny LoRA policy with a value head; `fresh` puts back its initial trainable weights."""
    from icrl_core.model import load_policy

    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4), value_head=True)
    zero_value_head(policy)
    return policy


def test_stream_training_resumes_exactly(policy):
    """3 iterations uninterrupted (a checkpoint after each, the last one included); then a run killed after its
    second checkpoint and resumed from it: the same history, evaluations and weights."""
    from icrl_core.policy_optimization import train_ppo

    cfg = PPOConfig(mode="stream", objective={"kind": "grpo"}, max_steps=3, save_steps=1, eval_steps=3,
                    stream={"steps": 3, "group_size": 2, "groups": 2, "eval_groups": 1}, epochs=1,
                    minibatch_size=2, batch_size=4, learning_rate=1e-2)
    sources = (resolve_sources(DATA, 0), DATA)

    def train(config, runtime):
        return train_ppo(policy, [], [], config, 0, runtime, 2048, None, sources)

    fresh(policy)
    runtime = MemoryRuntime()
    summary, history, evals = train(cfg, runtime)
    assert [state.step for state in runtime.checkpoints] == [1, 2, 3]
    weights = {k: v.clone() for k, v in trainable_tensors(policy).items()}
    assert [h["step"] for h in history] == [1, 2, 3] and [e["step"] for e in evals] == [0, 3]
    assert {"mean_reward", "reward_second_half", "switch_after_wrong", "kl"} <= set(history[0])
    assert "val_reward_second_half" in evals[0] and "val_accuracy_after" in summary
    fresh(policy)
    saved: list = []
    with pytest.raises(Killed):
        train(cfg, MemoryRuntime(saved, kill_after=2))
    fresh(policy)
    _, resumed, resumed_evals = train(cfg, MemoryRuntime(saved))

    def timeless(rows):
        return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()
                 if "seconds" not in k} for row in rows]

    assert timeless(resumed) == timeless(history) and resumed_evals[-1] == evals[-1]
    diffs = {k: float((weights[k] - v).abs().max()) for k, v in trainable_tensors(policy).items()}
    assert not any(diffs.values()), diffs


def test_stream_training_with_replay_holds_the_replies_and_resumes_exactly(policy):
    """ppo.replay: each optimizer step also carries the replay term (logged per iteration, and on held-back chats
    at each evaluation); the policy ends nearer the base model on the replies than the same run without it; a
    killed run resumes to the same weights (the chats are a pure function of (seed, iteration))."""
    from icrl_core.model import load_policy
    from icrl_core.policy_optimization import train_ppo
    from icrl_core.replay import sample_replies
    from icrl_core.supervised import evaluate_replay
    from tests.unit.test_replay import TEXTS

    chats = sample_replies(load_policy("tiny", seed=0), TEXTS[:12], max_new_tokens=8, temperature=1.0, seed=0)
    replay = (chats[3:], chats[:3])
    cfg = PPOConfig(mode="stream", objective={"kind": "rloo"}, max_steps=4, save_steps=1, eval_steps=2,
                    stream={"steps": 3, "group_size": 2, "groups": 2, "eval_groups": 1}, epochs=2,
                    minibatch_size=2, batch_size=4, learning_rate=3e-2, replay={"beta": 5.0, "per_step": 4})
    sources = (resolve_sources(DATA, 0), DATA)

    def train(config, runtime, with_replay=True):
        return train_ppo(policy, [], [], config, 0, runtime, 2048, None, sources,
                         replay=replay if with_replay else None)

    fresh(policy)
    _, history, evals = train(cfg, MemoryRuntime())
    weights = {k: v.clone() for k, v in trainable_tensors(policy).items()}
    assert all(h["replay_kl"] >= 0 for h in history)
    assert [e["step"] for e in evals] == [0, 2, 4] and all("val_replay_kl" in e for e in evals)
    assert evals[0]["val_replay_kl"] == pytest.approx(0.0, abs=1e-7)  # LoRA B = 0: the base model itself
    assert "val_reward_second_half" in evals[0]  # the streams' own validation still runs
    with_replay = evals[-1]["val_replay_kl"]
    fresh(policy)
    train(cfg, MemoryRuntime(), with_replay=False)
    without = evaluate_replay(policy, chats[:3], batch_size=2)["val_replay_kl"]
    assert 0 < with_replay < 0.8 * without  # 0.017 vs 0.025 here
    fresh(policy)
    saved: list = []
    with pytest.raises(Killed):
        train(cfg, MemoryRuntime(saved, kill_after=2))
    fresh(policy)
    train(cfg, MemoryRuntime(saved))
    assert all(bool((weights[k] == v).all()) for k, v in trainable_tensors(policy).items())


def test_reference_start_holds_the_kl_to_the_start_adapter_also_after_a_resume():
    """ppo.reference=start: the KL is measured against the adapter the run started from (zero at the first
    iteration's rollouts, positive once the policy moved); reference=base measures it against the adapters
    disabled. A resumed run freezes the start adapter, not the checkpoint it restores: the same history."""
    from icrl_core.model import load_policy
    from icrl_core.policy_optimization import train_ppo

    def started(reference: str, runtime, max_steps: int = 2):
        policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4))
        perturb_lora_b(policy, 0.05)  # the start adapter differs from the base model
        cfg = PPOConfig(mode="stream", objective={"kind": "rloo"}, max_steps=max_steps, save_steps=1, eval_steps=9,
                        stream={"steps": 3, "group_size": 2, "groups": 1, "eval_groups": 1}, epochs=1,
                        minibatch_size=2, batch_size=2, learning_rate=3e-2, kl_beta=0.1, reference=reference)
        return train_ppo(policy, [], [], cfg, 0, runtime, 2048, None, (resolve_sources(DATA, 0), DATA))[1]

    history = started("start", MemoryRuntime())
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6) and history[1]["kl"] > 1e-4
    assert started("base", MemoryRuntime(), max_steps=1)[0]["kl"] > 1e-3
    saved: list = []
    with pytest.raises(Killed):
        started("start", MemoryRuntime(saved, kill_after=1))
    resumed = started("start", MemoryRuntime(saved))
    assert resumed[1]["kl"] == pytest.approx(history[1]["kl"], rel=1e-5)


TINY_STREAMS = [
    "model.spec=tiny", "tracking.enabled=false", "ppo.mode=stream", "ppo.max_steps=2", "ppo.save_steps=1",
    "ppo.stream={steps: 3, group_size: 2, groups: 1, eval_groups: 1}", "ppo.objective={kind: rloo}",
    "ppo.batch_size=2", "ppo.minibatch_size=2", "ppo.epochs=1", "ppo.eval_steps=2", "ppo.learning_rate=1e-2",
    "data.sources=[{kind: synthetic, name: keyword_map}]", "data.labels_per_episode=3",
]


def test_stream_stage_needs_no_built_dataset_and_writes_its_outputs(in_tmp):
    from tasks.ppo import run

    metrics = run(load_config(None, TINY_STREAMS, environ={}))
    out = in_tmp / "artifacts" / "ppo"
    history = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history] == [1, 2] and metrics["iterations"] == 2
    assert [e["step"] for e in json.loads((out / "evals.json").read_text())] == [0, 2]
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert (out / "adapter" / "adapter_model.safetensors").exists()


def test_the_stage_rolls_out_through_the_torch_engine_like_through_the_policy(in_tmp, monkeypatch):
    """ppo.stream.engine=inference (inference.backend torch): the stage's rollouts and validation streams are
    decoded by the inference engine (the same draws and rule), so the run matches the policy-decoded one: the same
    rewards and answers, the losses equal up to float rounding; and a vllm-only setting is refused with async."""
    from icrl_core.errors import ConfigError
    from tasks.ppo import run

    runs = {}
    for engine in ("policy", "inference"):
        folder = in_tmp / engine
        folder.mkdir()
        monkeypatch.chdir(folder)
        run(load_config(None, [*TINY_STREAMS, f"ppo.stream.engine={engine}"], environ={}))
        runs[engine] = (json.loads((folder / "artifacts/ppo/history.json").read_text()),
                        json.loads((folder / "artifacts/ppo/evals.json").read_text()))
    (history, evals), (served, served_evals) = runs["policy"], runs["inference"]
    for a, b in zip(history + evals, served + served_evals):
        assert {k: a[k] for k in ("step", "mean_reward", "switch_after_wrong", "val_reward") if k in a} == \
            {k: b[k] for k in ("step", "mean_reward", "switch_after_wrong", "val_reward") if k in b}
        for key in ("loss", "answer_prob", "val_accuracy"):
            if a.get(key) is not None:  # (a NaN is stored as null)
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key
    with pytest.raises(ConfigError, match="use one or the other"):
        load_config(None, [*TINY_STREAMS, "ppo.stream.engine=inference", "ppo.async_rollouts.enabled=true"],
                    environ={})

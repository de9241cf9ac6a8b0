"""The PPO stage in stream mode (icrl_core/stream_rl.py): step sums, group advantages, statistics by hand, and
every objective runs an iteration on in-context RL streams of the tiny model and moves the adapter. Resume and
the stage: tests/integration/test_stream_rl.py."""

from __future__ import annotations

import math

import pytest
import torch

from icrl_core.config import DataConfig, DPOConfig, LoraAdapter, PPOConfig, SyntheticSource
from icrl_core.dataset_build import resolve_sources
from icrl_core.objectives import OBJECTIVE_KINDS
from icrl_core.ppo import iteration_generator, make_optimizer, trainable_tensors, zero_value_head
from icrl_core.stream_rl import group_step_advantages, step_sums, stream_step
from tests.conftest import perturb_lora_b

T = torch.tensor
DATA = DataConfig(sources=[SyntheticSource(name="keyword_map")], labels_per_episode=3, labels_per_episode_min=2)


def test_step_sums_add_each_steps_decisions():
    values = T([[1.0, 2.0, 4.0], [3.0, 5.0, 7.0]])
    step = T([[0, 0, 1], [1, 1, 0]])
    mask = T([[1, 1, 1], [1, 0, 0]]).bool()
    assert torch.allclose(step_sums(values, step, mask, 2), T([[3.0, 4.0], [0.0, 3.0]]))


def test_group_advantages_follow_the_objective():
    returns = T([[1.0], [0.0], [1.0], [1.0]])
    mask = torch.ones(4, 1, dtype=torch.bool)
    groups = T([0, 0, 1, 1])
    lengths = torch.ones(4, 1)

    def cfg(kind: str) -> PPOConfig:
        return PPOConfig(mode="stream", objective={"kind": kind})

    # group 0: (1, 0) -> rloo (1, -1), centred (0.5, -0.5), normalised 0.5 / std(= 0.7071); group 1: all 0
    assert torch.allclose(group_step_advantages(cfg("rloo"), returns, mask, groups, lengths), T([[1.], [-1.], [0.], [0.]]))
    for kind in ("dr_grpo", "aipo", "opo"):
        out = group_step_advantages(cfg(kind), returns, mask, groups, lengths)
        assert torch.allclose(out, T([[0.5], [-0.5], [0.0], [0.0]])), kind
    for kind in ("grpo", "gspo"):
        out = group_step_advantages(cfg(kind), returns, mask, groups, lengths)
        assert torch.allclose(out, T([[0.5], [-0.5], [0.0], [0.0]]) / (math.sqrt(0.5) + 1e-4)), kind


@pytest.fixture(scope="module")
def policy():
    """One tiny LoRA policy with a value head; `fresh` puts back its initial trainable weights."""
    from icrl_core.model import load_policy

    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4), value_head=True)
    zero_value_head(policy)
    return policy


def fresh(policy) -> None:
    from icrl_core.ppo import load_trainable_tensors

    if not hasattr(policy, "_initial"):
        policy._initial = {k: v.clone() for k, v in trainable_tensors(policy).items()}
    load_trainable_tensors(policy, policy._initial)


@pytest.mark.parametrize("kind", OBJECTIVE_KINDS)
def test_every_objective_updates_the_policy_from_streams(policy, kind):
    cfg = PPOConfig(mode="stream", objective={"kind": kind}, stream={"steps": 4, "group_size": 3, "groups": 2},
                    epochs=1, minibatch_size=3, batch_size=6, learning_rate=1e-2, kl_beta=0.05, temperature=1.0)
    fresh(policy)
    before = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    optimizer, scheduler = make_optimizer(policy, cfg)
    metrics = stream_step(policy, optimizer, scheduler, resolve_sources(DATA, 0), DATA, cfg, cfg.kl_beta, 0, 1,
                          iteration_generator(0, 1), 2048)
    assert 0.0 <= metrics["mean_reward"] <= 1.0 and metrics["action_tokens"] >= 6 * 4
    for key in ("loss", "policy_loss", "entropy", "kl", "approx_kl", "reward_first_half", "answer_prob"):
        assert math.isfinite(metrics[key]), key
    assert math.isfinite(metrics["explained_variance"]) == (kind == "ppo")
    after = policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())  # padded candidates must not poison gradients


@pytest.mark.parametrize("kind", ["ppo", "rloo"])
def test_explorative_context_streams_train_with_their_own_rows(policy, kind):
    """ppo.stream.context explorative: each step is its own row; pi_old from the one pass equals the generation's
    log-probs, and the update (with the value head for ppo) moves the adapter."""
    cfg = PPOConfig(mode="stream", objective={"kind": kind}, epochs=2, minibatch_size=3, batch_size=6,
                    stream={"steps": 4, "group_size": 3, "groups": 2, "context": {"kind": "explorative",
                                                                                  "p_keep": 0.7}},
                    learning_rate=1e-2, kl_beta=0.05, temperature=1.0)
    fresh(policy)
    before = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    optimizer, scheduler = make_optimizer(policy, cfg)
    metrics = stream_step(policy, optimizer, scheduler, resolve_sources(DATA, 0), DATA, cfg, cfg.kl_beta, 0, 1,
                          iteration_generator(0, 1), 2048)
    assert 0.0 <= metrics["mean_reward"] <= 1.0 and math.isfinite(metrics["loss"])
    assert math.isfinite(metrics["explained_variance"]) == (kind == "ppo")
    after = policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())


def test_burned_in_streams_train_on_their_last_steps_only(policy):
    """ppo.stream.burn_in (shared by the group): each task has burn_in + steps queries, the update sees `steps`
    steps per stream (with the burned-in answers in their contexts) and moves the adapter."""
    from icrl_core.stream_rl import stream_tasks

    cfg = PPOConfig(mode="stream", objective={"kind": "rloo"}, epochs=1, minibatch_size=3, batch_size=6,
                    stream={"steps": 3, "burn_in": 5, "shared_burn_in": True, "group_size": 3, "groups": 2,
                            "context": {"kind": "explorative", "p_keep": 0.7}},
                    learning_rate=1e-2, kl_beta=0.05, temperature=1.0)
    sources = resolve_sources(DATA, 0)
    assert all(len(task.queries) == 8 for _, task in stream_tasks(sources, DATA, cfg, 0, 1, range(2), "train"))
    fresh(policy)
    before = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    optimizer, scheduler = make_optimizer(policy, cfg)
    metrics = stream_step(policy, optimizer, scheduler, sources, DATA, cfg, cfg.kl_beta, 0, 1,
                          iteration_generator(0, 1), 2048)
    assert metrics["action_tokens"] >= 6 * 3 and math.isfinite(metrics["loss"])
    after = policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_context_distillation_shapes_the_reward_with_the_teacher(policy):
    """ppo.distill: the teacher pass runs, the advantages come from the distillation reward, the task accuracy
    stays the task's, and the update moves the adapter."""
    cfg = PPOConfig(mode="stream", objective={"kind": "rloo"}, stream={"steps": 4, "group_size": 3, "groups": 2},
                    distill={"adv_tau": 0.5, "teacher_tau": 1.0, "student_tau": 0.1}, epochs=1, minibatch_size=3,
                    batch_size=6, learning_rate=1e-2, kl_beta=0.0, temperature=1.0)
    fresh(policy)
    before = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    optimizer, scheduler = make_optimizer(policy, cfg)
    metrics = stream_step(policy, optimizer, scheduler, resolve_sources(DATA, 0), DATA, cfg, 0.0, 0, 1,
                          iteration_generator(0, 1), 2048)
    assert metrics["teacher_logp"] < 0 and metrics["student_logp"] < 0
    assert metrics["shaped_reward"] == pytest.approx(0.5 * metrics["task_accuracy"] + metrics["teacher_logp"]
                                                     - 0.1 * metrics["student_logp"], abs=1e-5)
    assert metrics["task_accuracy"] == pytest.approx(metrics["mean_reward"])
    after = policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="ppo.distill needs ppo.mode=stream"):
        PPOConfig(distill={"teacher_tau": 1.0})


def test_skipped_passes_give_the_same_advantages(policy):
    """One epoch without KL: pi_old is the generation's behaviour log-prob and no reference pass runs; the
    advantages and log-probs equal those of the full preparation."""
    from icrl_core.stream_rl import prepare_streams, roll_out
    from icrl_core.streams import collate_streams

    fresh(policy)
    perturb_lora_b(policy, std=0.05)
    fast = PPOConfig(mode="stream", objective={"kind": "grpo"}, stream={"steps": 3, "group_size": 3, "groups": 2},
                     epochs=1, kl_beta=0.0)
    streams = roll_out(policy, resolve_sources(DATA, 0), DATA, fast, 0, 1, range(2), "train", 2048)
    batch = collate_streams(streams, policy.tokenizer.pad_token_id)
    quick = prepare_streams(policy, batch, fast, beta=0.0)
    full = prepare_streams(policy, batch, fast.model_copy(update={"epochs": 2}), beta=0.05)
    assert torch.allclose(quick.old_logp, full.old_logp, atol=1e-4)
    assert torch.allclose(quick.advantages, full.advantages)
    assert torch.equal(quick.kl, torch.zeros_like(quick.kl)) and full.kl.abs().sum() > 0
    fresh(policy)


def test_the_test_reward_pays_each_streams_context_value_at_its_last_step(policy):
    """ppo.stream.test_reward: every stream's test value is measured after the rollout (training and validation),
    added (x weight) to its last step's reward, and the update moves the adapter; weight 0 measures without
    rewarding; the dpo stage refuses the option."""
    from pydantic import ValidationError

    from icrl_core.stream_rl import evaluate_streams, roll_out

    cfg = PPOConfig(mode="stream", objective={"kind": "rloo"}, epochs=1, minibatch_size=3, batch_size=6,
                    stream={"steps": 3, "group_size": 3, "groups": 2, "test_reward": {"queries": 4, "weight": 2.0}},
                    learning_rate=1e-2, kl_beta=0.0, temperature=1.0)
    sources = resolve_sources(DATA, 0)
    fresh(policy)
    streams = roll_out(policy, sources, DATA, cfg, 0, 1, range(2), "train", 2048)
    assert all(len(s.task.tests) == 4 and 0 < s.test_value < 1 for s in streams)
    value = sum(s.test_value for s in streams) / len(streams)
    before = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    optimizer, scheduler = make_optimizer(policy, cfg)
    metrics = stream_step(policy, optimizer, scheduler, sources, DATA, cfg, 0.0, 0, 1, iteration_generator(0, 1),
                          2048)
    assert metrics["test_value"] == pytest.approx(value)  # the same draws: the same streams and values
    assert metrics["task_accuracy"] == pytest.approx(metrics["mean_reward"])  # the task's reward, unshaped
    # the return at the first step: r_1 + r_2 + r_3 + 2 v (gamma 1), averaged over the streams
    assert metrics["return_mean"] > metrics["mean_reward"]
    after = policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    val = evaluate_streams(policy, sources, DATA, cfg.model_copy(update={"stream": cfg.stream.model_copy(
        update={"eval_groups": 1})}), 0, 2048)
    assert 0 < val["val_test_value"] < 1
    with pytest.raises(ValidationError, match="test reward is a ppo-stage option"):
        DPOConfig(stream={"test_reward": {"queries": 2}})


@pytest.mark.parametrize("context", [{"kind": "naive"}, {"kind": "explorative", "p_keep": 1.0}])
def test_a_discovery_is_a_right_answer_no_rewarded_episode_of_its_context_holds(policy, context):
    """StreamStep.novel (naive, and explorative keeping every rewarded step: the context holds every rewarded
    episode before the step, burned-in ones included), and ppo.stream.discovery_bonus pays it: the same draws
    give a larger mean return with the bonus by exactly bonus x the discoveries' returns."""
    from icrl_core.stream_rl import roll_out

    cfg = PPOConfig(mode="stream", objective={"kind": "rloo"}, epochs=1, minibatch_size=3, batch_size=6,
                    stream={"steps": 6, "burn_in": 2, "group_size": 3, "groups": 2, "context": context},
                    learning_rate=1e-2, kl_beta=0.0, temperature=1.0, gamma=0.0)
    sources = resolve_sources(DATA, 0)
    fresh(policy)
    streams = roll_out(policy, sources, DATA, cfg, 0, 1, range(2), "train", 2048)
    found = 0
    for stream in streams:
        for step in stream.steps:
            before = {e.prediction for e in stream.history[:step.record.step] if e.reward}
            assert step.novel == (bool(step.record.reward) and step.record.prediction not in before)
            assert step.gold_absent == (step.record.gold not in before)
            found += step.novel
    assert found > 0
    metrics = {}
    for bonus in (0.0, 2.0):
        fresh(policy)
        shaped = cfg.model_copy(update={"stream": cfg.stream.model_copy(update={"discovery_bonus": bonus})})
        optimizer, scheduler = make_optimizer(policy, shaped)
        metrics[bonus] = stream_step(policy, optimizer, scheduler, sources, DATA, shaped, 0.0, 0, 1,
                                     iteration_generator(0, 1), 2048)
    steps = sum(len(s.steps) for s in streams)
    assert metrics[0.0]["novel_rate"] == metrics[2.0]["novel_rate"] == pytest.approx(found / steps)
    # gamma 0: each step's return is its reward (+ 2 for a discovery)
    assert metrics[2.0]["return_mean"] == pytest.approx(metrics[0.0]["return_mean"] + 2.0 * found / steps)
    assert metrics[2.0]["task_accuracy"] == metrics[0.0]["task_accuracy"]
    fresh(policy)
    with pytest.raises(ValueError, match="discovery bonus is a ppo-stage option"):
        DPOConfig(stream={"discovery_bonus": 1.0})


def test_stream_statistics_by_hand():
    from icrl_core.icrl_eval import EpisodeRecord
    from icrl_core.stream_rl import stream_statistics
    from icrl_core.streams import Decision, Stream, StreamStep

    def stream(answers: list[tuple[str, str]]) -> Stream:
        steps = [StreamStep(EpisodeRecord(t, "q", gold, said, int(gold == said), int(gold == said)), 0, (1,),
                            [Decision(0, (1, 2), 0, math.log(0.5))], gold_absent=t < 3)
                 for t, (gold, said) in enumerate(answers)]
        return Stream(None, 0, [], steps)

    # stream a: wrong a->a (no switch), wrong a->b (switch), right; stream b: wrong b->b, wrong b->b (no switch)
    a = stream([("b", "a"), ("b", "a"), ("b", "b"), ("a", "a")])
    b = stream([("a", "b"), ("a", "b"), ("a", "b"), ("b", "b")])
    stats = stream_statistics([a, b])
    assert stats["mean_reward"] == 3 / 8
    assert stats["reward_first_half"] == 0.0 and stats["reward_second_half"] == 3 / 4
    # after a wrong answer: a0->a1 same, a1->a2 switch; b0->b1, b1->b2, b2->b3 same -> 1 / 5
    assert stats["switch_after_wrong"] == pytest.approx(1 / 5)
    assert stats["switch_after_right"] == 1.0  # after a right answer: a2 -> a3 switches (b's right step is its last)
    assert stats["answer_prob"] == pytest.approx(0.5)
    assert stats["novel_rate"] == 1 / 8  # a's third step: right and flagged (a's fourth and b's fourth: t = 3)
    assert stats["gold_absent_rate"] == 6 / 8


def test_draw_offset_shifts_training_draws_not_validation():
    from icrl_core.stream_rl import draw_key, stream_tasks

    sources = resolve_sources(DATA, 0)
    plain = PPOConfig(mode="stream", stream={"steps": 4, "groups": 2})
    shifted = PPOConfig(mode="stream", stream={"steps": 4, "groups": 2, "draw_offset": 20})
    assert [draw_key(shifted, i) for i in (0, 1, 5)] == [0, 21, 25]

    def queries(cfg, iteration, split):
        return [[q.text for q in task.queries] for _, task in stream_tasks(sources, DATA, cfg, 0, iteration,
                                                                          range(2), split)]

    assert queries(shifted, 3, "train") == queries(plain, 23, "train") != queries(plain, 3, "train")
    assert queries(shifted, 0, "val") == queries(plain, 0, "val")


def test_the_ppo_stage_builds_the_rollout_engine_the_config_names(tmp_path):
    """tasks.ppo.rollout_engine: torch serves the live policy, built per rollout with a prefix cache per stream
    of a group; another backend is started once on the base model (the rollout's adapter comes per request) and
    gets a folder for the adapter versions."""
    from icrl_core.inference.torch_backend import TorchEngine
    from icrl_core.model import load_policy
    from tasks.ppo import rollout_engine
    from tasks.settings import load_config

    config = load_config(None, ["model.spec=tiny", "ppo.mode=stream", "ppo.stream.engine=inference",
                                "ppo.stream.group_size=3", "ppo.objective={kind: grpo}"], environ={})
    torch_rollouts = rollout_engine(config, str(tmp_path))
    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4))
    with torch_rollouts.serving(policy) as (engine, adapter):
        assert isinstance(engine, TorchEngine) and adapter is None and torch_rollouts.adapter_dir is None
        assert engine.policies == {None: policy} and engine.cache_entries == 4
    vllm_rollouts = rollout_engine(load_config(None, ["inference.backend=vllm", "model.init_adapter=somewhere"],
                                               environ={}), str(tmp_path))
    assert vllm_rollouts.adapter_dir == tmp_path and vllm_rollouts.engine is None  # started at the first rollout



def test_uniform_groups_are_redrawn_until_they_carry_an_advantage(policy):
    """ppo.stream.redraws (DAPO's dynamic sampling): a group whose streams all earned the same rewards is rolled
    out again on a new task, keyed so a resumed run redraws the same; a group with an advantage is kept as it was;
    the ppo objective (no group advantage) and async rollouts refuse the option."""
    from pydantic import ValidationError

    from icrl_core.stream_rl import redraw_uniform_groups, roll_out, uniform_group

    cfg = PPOConfig(mode="stream", objective={"kind": "rloo"}, temperature=1.0,
                    stream={"steps": 2, "group_size": 2, "groups": 4, "redraws": 3})
    sources = resolve_sources(DATA, 0)
    fresh(policy)
    first = roll_out(policy, sources, DATA, cfg, 0, 1, range(4), "train", 2048)
    uniform_first = [g for g in range(4) if uniform_group([s for s in first if s.group == g])]
    assert uniform_first, "2 streams x 2 steps on 2-3 labels: some group should be uniform at seed 0"
    streams, redrawn = redraw_uniform_groups(policy, sources, DATA, cfg, 0, 1, first, 2048)
    again, redrawn_again = redraw_uniform_groups(policy, sources, DATA, cfg, 0, 1, first, 2048)
    assert redrawn == redrawn_again and [s.rewards for s in streams] == [s.rewards for s in again]
    assert len(uniform_first) <= redrawn <= 3 * len(uniform_first)
    for group in range(4):
        before = [s for s in first if s.group == group]
        after = [s for s in streams if s.group == group]
        assert len(after) == 2
        if group in uniform_first:
            assert all(a is not b for a, b in zip(after, before, strict=True))  # rolled out again
            assert not uniform_group(after) or redrawn >= 3  # uniform only after all its redraws
        else:
            assert after == before  # kept as rolled out

    optimizer, scheduler = make_optimizer(policy, cfg)
    metrics = stream_step(policy, optimizer, scheduler, sources, DATA, cfg, 0.0, 0, 1, iteration_generator(0, 1),
                          2048)
    assert metrics["redrawn_groups"] == redrawn and math.isfinite(metrics["loss"])
    assert metrics["uniform_groups"] == sum(uniform_group([s for s in streams if s.group == g]) for g in range(4))

    with pytest.raises(ValidationError, match="redraws"):
        PPOConfig(mode="stream", objective={"kind": "ppo"}, stream={"redraws": 1})
    with pytest.raises(ValidationError, match="redraws"):
        PPOConfig(mode="stream", objective={"kind": "rloo"}, stream={"redraws": 1}, async_rollouts={"enabled": True})
    with pytest.raises(ValidationError, match="dpo.stream.redraws"):
        DPOConfig(stream={"redraws": 1})

"""Code tasks as RL (icrl_core/code_rl.py) with the real sandbox and model: the reward composed by hand from a
real sandbox run, a code-mode iteration of the PPO stage (GRPO, RLOO, PPO) on the tiny model that moves
the adapter and logs every reward component, exact resume, the DPO stage's (passing, failing) pairs of one task,
and `icrl code-eval`. The sandbox is the real one everywhere."""

from __future__ import annotations

import json
import math

import pytest
import torch

from icrl_core.code_config import CodeConfig, CodeRewardConfig, CodeRewardWeights
from icrl_core.code_reward import COMPONENTS, length_penalty, score
from icrl_core.code_rl import (
    CodeTaskSet,
    code_episode,
    passing_failing_pairs,
    score_completions,
)
from icrl_core.config import LoraAdapter, PPOConfig
from icrl_core.ppo import iteration_generator, make_optimizer, trainable_tensors, zero_value_head
from tasks.settings import load_config
from tests.conftest import Killed, MemoryRuntime

T = torch.tensor
CODE = CodeConfig()
TASKS = CodeTaskSet.from_config(CODE)
ADD = next(t for t in TASKS.train if t.template == "add_constant")  # def add_K(x: int) -> int: return x + K
K = int(ADD.name.split("_")[1])
TINY_CODE = {"tasks_per_step": 2, "group_size": 2, "max_new_tokens": 16, "eval_tasks": 0}


# --------------------------------------------------------------------------------------------------------------
# The reward, composed by hand


def test_reward_composition_by_hand():
    """Every component weighted differently and reward_scale 2: the total equals the formula applied by hand to
    the components a real sandbox run gave (a partial, a complete and a failing program)."""
    weights = CodeRewardWeights(pass_fraction=0.7, all_pass=1.3, time_efficiency=0.4, lint=0.3, docstring=0.2,
                                complexity=0.25, reward_model=0.6, length_penalty=0.5)
    config = CodeConfig(reward=CodeRewardConfig(weights=weights, reward_scale=2.0, length_ratio=1.0))
    positive = sum(1 for args, _ in ADD.tests if args[0] > 0)
    assert 0 < positive < len(ADD.tests)
    # right for x > 0 only; clean (0 ruff findings), a docstring, complexity 2 (<= target 5), longer than the
    # reference (length_ratio 1: a length penalty)
    partial = (f'{ADD.signature}\n    """Add {K} to positive numbers."""\n    if x > 0:\n        return x + {K}\n'
               "    return 0\n")
    got = score(partial, ADD, config, reward_model_score=0.5)
    c = got.components
    assert got.tests_passed == positive and c["pass_fraction"] == pytest.approx(positive / len(ADD.tests))
    assert c["all_pass"] == 0.0 and c["time_efficiency"] == 0.0  # the bonus needs every test passed
    assert c["lint"] == 1.0 and c["docstring"] == 1.0 and c["complexity"] == 1.0 and c["reward_model"] == 0.5
    penalty = len(partial.strip()) / len(ADD.reference.strip()) - 1.0
    assert c["length_penalty"] == pytest.approx(penalty) and 0 < penalty < 1
    by_hand = 2.0 * (0.7 * positive / len(ADD.tests) + 0.3 + 0.2 + 0.25 + 0.6 * 0.5 - 0.5 * penalty)
    assert got.total == pytest.approx(by_hand)
    assert got.reason == f"{positive}/{len(ADD.tests)} tests passed"

    reference = score(ADD.reference, ADD, config)  # no reward-model score given: that component is 0
    c = reference.components
    assert c["pass_fraction"] == 1.0 and c["all_pass"] == 1.0 and 0 < c["time_efficiency"] <= 1.0
    assert c["length_penalty"] == length_penalty(ADD.reference, ADD.reference, 1.0) == 0.0
    assert reference.total == pytest.approx(2.0 * (0.7 + 1.3 + 0.4 * c["time_efficiency"] + 0.3 + 0.2 + 0.25))

    wrong = f'{ADD.signature}\n    """Add."""\n    return x - {K}\n'  # tidy, documented, passes nothing
    failed = score(wrong, ADD, config, reward_model_score=0.9)
    assert failed.total == 0.0 and failed.components["lint"] == 1.0 and "no test passed" in failed.reason
    assert set(failed.components) == {*COMPONENTS, "length_penalty"}


# --------------------------------------------------------------------------------------------------------------
# Code mode of the PPO stage on the tiny model


@pytest.fixture(scope="module")
def policy():
    """One tiny LoRA policy with a value head; `fresh` puts back its initial trainable weights."""
    from icrl_core.model import load_policy

    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4), value_head=True)
    zero_value_head(policy)
    policy._initial = {k: v.clone() for k, v in trainable_tensors(policy).items()}
    return policy


def fresh(policy) -> None:
    from icrl_core.ppo import load_trainable_tensors

    load_trainable_tensors(policy, policy._initial)


@pytest.mark.parametrize("kind", ["grpo", "rloo", "ppo"])
def test_a_code_iteration_moves_the_adapter_and_logs_every_component(policy, kind):
    from icrl_core.code_rl import code_step

    cfg = PPOConfig(mode="code", objective={"kind": kind}, code=TINY_CODE, epochs=1, minibatch_size=2,
                    batch_size=4, learning_rate=1e-2, kl_beta=0.05)
    fresh(policy)
    before = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    optimizer, scheduler = make_optimizer(policy, cfg)
    metrics = code_step(policy, optimizer, scheduler, TASKS, CODE, cfg, cfg.kl_beta, 0, 1, iteration_generator(0, 1),
                        2048)
    for name in (*COMPONENTS, "length_penalty", "total"):
        assert 0.0 <= metrics[f"reward/{name}"] <= 2.5, name
    for key in ("mean_reward", "task_accuracy", "groups_with_signal", "zero_reward", "kl", "loss", "entropy",
                "completion_tokens", "score_seconds"):
        assert math.isfinite(metrics[key]), key
    assert metrics["action_tokens"] == 2 * 2 * 16  # 4 completions, none ends before 16 tokens
    after = policy.trainable_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after.values())


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_the_group_update_makes_passing_completions_likelier(policy, tokens, kind):
    """The tiny model passes no test by itself, so its own groups carry no signal: a group of two passing and two
    failing completions of one task (scored in the sandbox) goes through the code-mode update instead; the
    passing ones' log-probability rises, the failing ones' falls."""
    from icrl_core.code_rl import prepare_completions
    from icrl_core.ppo import policy_outputs, rollout_batch
    from icrl_core.stream_rl import stream_update

    # the failing ones share no code with the passing ones (shared tokens would get both signs of advantage)
    texts = ["```python\n" + ADD.reference + "```", "Sorry, I cannot write that.",
             "```python\n" + ADD.reference.replace("return", "return  ") + "```", "return None"]
    rollouts = [completion_rollout(tokens, ADD, text) for text in texts]
    rewards = T([b.total for b in score_completions(rollouts, [ADD] * 4, CODE)])
    for rollout, reward in zip(rollouts, rewards.tolist()):
        rollout.scores = [reward]
    assert rewards[0] > 0 and rewards[2] > 0 and rewards[1] == rewards[3] == 0
    cfg = PPOConfig(mode="code", objective={"kind": kind}, epochs=2, minibatch_size=4, batch_size=4,
                    learning_rate=1e-2, kl_beta=0.0, entropy_beta=0.0)
    fresh(policy)
    batch = rollout_batch(rollouts, tokens.tokenizer.pad_token_id)

    def sequence_logp() -> torch.Tensor:
        with torch.no_grad():
            logp, _, _ = policy_outputs(policy, batch, 1.0, with_values=False)
        return (logp * batch.action_mask).sum(1)

    before = sequence_logp()
    prepared = prepare_completions(policy, batch, rewards, torch.zeros(4, dtype=torch.long), cfg, 0.0)
    assert (prepared.step_advantages[[0, 2], 0] > 0).all() and (prepared.step_advantages[[1, 3], 0] < 0).all()
    optimizer, scheduler = make_optimizer(policy, cfg)
    stream_update(policy, optimizer, batch, prepared, cfg, 0.0, iteration_generator(0, 1), scheduler,
                  outputs=policy_outputs)
    change = sequence_logp() - before
    assert (change[[0, 2]] > 0).all() and (change[[1, 3]] < 0).all(), change
    fresh(policy)


def test_code_training_resumes_exactly(policy):
    """2 iterations uninterrupted, then a run killed after its first checkpoint and resumed: the same history
    (the tiny model passes no test, so no time-efficiency bonus varies), evaluations and weights."""
    from icrl_core.policy_optimization import train_ppo

    cfg = PPOConfig(mode="code", objective={"kind": "rloo"}, code={**TINY_CODE, "eval_tasks": 1}, max_steps=2,
                    save_steps=1, eval_steps=2, epochs=1, minibatch_size=4, batch_size=4, learning_rate=1e-2)

    def train(runtime):
        return train_ppo(policy, [], [], cfg, 0, runtime, 2048, None, None, CODE)

    fresh(policy)
    summary, history, evals = train(MemoryRuntime())
    weights = {k: v.clone() for k, v in trainable_tensors(policy).items()}
    assert [h["step"] for h in history] == [1, 2] and [e["step"] for e in evals] == [0, 2]
    assert {"val_accuracy", "val_reward", "val_pass_fraction"} <= set(evals[0])
    assert "reward/pass_fraction_last_20pct" in summary and "val_accuracy_after" in summary
    fresh(policy)
    saved: list = []
    with pytest.raises(Killed):
        train(MemoryRuntime(saved, kill_after=1))
    fresh(policy)
    _, resumed, resumed_evals = train(MemoryRuntime(saved))

    def timeless(rows):
        return [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()
                 if "seconds" not in k} for row in rows]

    assert timeless(resumed) == timeless(history) and resumed_evals[-1] == evals[-1]
    assert all(torch.equal(weights[k], v) for k, v in trainable_tensors(policy).items())


TINY_CODE_STAGE = [
    "model.spec=tiny", "tracking.enabled=false", "ppo.mode=code", "ppo.objective={kind: grpo}", "ppo.max_steps=1",
    "ppo.save_steps=1", "ppo.eval_steps=1", "ppo.batch_size=4", "ppo.minibatch_size=4", "ppo.epochs=1",
    "ppo.code={tasks_per_step: 2, group_size: 2, max_new_tokens: 16, eval_tasks: 1}", "ppo.learning_rate=1e-2",
]


def test_code_stage_writes_every_component_and_weighs_a_reward_model_in(in_tmp):
    """The reward-model mode: code.reward.weights.reward_model > 0 with ppo.reward_model_path; its sigmoid score
    is logged as a component. No built dataset is needed."""
    from icrl_core.config import ModelConfig
    from icrl_core.errors import UserError
    from icrl_core.reward_model import new_reward_model, save_reward_model
    from tasks.ppo import run

    with pytest.raises(UserError, match="needs a reward model: set ppo.reward_model_path"):
        run(load_config(None, TINY_CODE_STAGE + ["code.reward.weights.reward_model=0.5"], environ={}))
    save_reward_model(in_tmp / "rm", new_reward_model(ModelConfig(spec="tiny"), None, seed=1))
    metrics = run(load_config(None, TINY_CODE_STAGE + ["code.reward.weights.reward_model=0.5",
                                                       "ppo.reward_model_path=rm"], environ={}))
    out = in_tmp / "artifacts" / "ppo"
    history = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in history] == [1]
    for name in (*COMPONENTS, "length_penalty", "total"):
        assert f"reward/{name}" in history[0], name
    assert 0.0 < history[0]["reward/reward_model"] < 1.0  # sigmoid(r(x, y)) of the tiny reward model
    assert (out / "code_rewards.png").stat().st_size > 1000 and (out / "adapter").is_dir()
    assert metrics["iterations"] == 1 and "val_accuracy_after" in metrics


# --------------------------------------------------------------------------------------------------------------
# DPO on (passing, failing) pairs


def completion_rollout(tokens, task, text: str):
    """A rollout whose completion is `text` (tokenized, closed by end-of-turn), after code mode's prompt."""
    from icrl_core.rollout import EpisodeDialogue, Rollout

    episode = code_episode(task, TASKS.shot)
    dialogue = EpisodeDialogue(episode, tokens, 2048, 256)
    ids = [*tokens.encode(text), tokens.end_of_turn_id]
    dialogue.add_answer(ids, [0.0] * len(ids), 0)
    return Rollout(episode, list(dialogue.conv.ids), dialogue.answers, 0)


def test_dpo_code_pairs_are_passing_and_failing_completions_of_one_task(tokens):
    other = next(t for t in TASKS.train if t.template == "is_multiple")
    texts = {ADD.task_id: ["```python\n" + ADD.reference + "```", f"```python\n{ADD.prompt}    return x\n```",
                           "```python\n" + ADD.reference + "```", "no code at all"],
             other.task_id: [f"```python\n{other.prompt}    return True\n```", "```python\ndef f(:\n```"]}
    rollouts = [completion_rollout(tokens, ADD, text) for text in texts[ADD.task_id]]
    rollouts += [completion_rollout(tokens, other, text) for text in texts[other.task_id] * 2]
    tasks = [ADD] * 4 + [other] * 4
    breakdowns = score_completions(rollouts, tasks, CODE)  # the real sandbox
    assert [b.components["all_pass"] for b in breakdowns[:4]] == [1.0, 0.0, 1.0, 0.0]
    assert not any(b.components["all_pass"] for b in breakdowns[4:])
    pairs = passing_failing_pairs(rollouts, breakdowns, 4)
    assert len(pairs) == 2 * 2  # 2 passing x 2 failing of ADD; the other group passes nothing
    prompt = tokens.decode(rollouts[0].input_ids[:rollouts[0].answers[0].start])
    for pair in pairs:
        chosen, rejected = tokens.decode(pair.preferred), tokens.decode(pair.rejected)
        assert chosen.startswith(prompt) and rejected.startswith(prompt)  # the same task's prompt
        assert ADD.reference.strip() in chosen[len(prompt):]
        assert ADD.reference.strip() not in rejected[len(prompt):]
        assert pair.preferred[-1] == pair.rejected[-1] == tokens.end_of_turn_id


def test_dpo_mines_code_pairs_on_the_shared_loop():
    """dpo.mine_code alone: each step samples completions, scores them in the sandbox and logs their reward
    components; the tiny model passes nothing, so there are no pairs and the weights stay (no gradient)."""
    from icrl_core.config import DPOConfig
    from icrl_core.dpo import train_dpo
    from icrl_core.model import load_policy

    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4))
    cfg = DPOConfig(episode_pairs=False, mine_code=True, code={**TINY_CODE, "eval_tasks": 1}, max_steps=1,
                    eval_steps=1, save_steps=1, batch_size=4)
    metrics, history = train_dpo(policy, [], [], cfg, 0, MemoryRuntime(), max_tokens=2048, code=CODE)
    assert history[0]["code_pairs"] == 0 and history[0]["reward/lint"] >= 0 and "task_accuracy" in history[0]
    assert metrics["val_accuracy_before"] == metrics["val_accuracy_after"] == 0.0


# --------------------------------------------------------------------------------------------------------------
# icrl code-eval


def test_code_eval_writes_its_json_and_refuses_bad_values(in_tmp):
    from tests.unit.test_cli_errors import call

    argv = ["code-eval", "--model", "tiny", "--samples", "2", "--tasks-per-level", "1", "--max-new-tokens", "16",
            "--output", "eval.json"]
    code, err = call(argv)
    assert code == 0, err
    result = json.loads((in_tmp / "eval.json").read_text())
    assert result["k"] == [1, 2] and result["tasks"] == 3 and result["adapter"] is None
    assert set(result["levels"]) == {"level_1", "level_2", "level_3"}
    assert result["overall"]["pass_at_1"] == 0.0 and result["isolation"]
    row = result["per_task"][0]
    assert row["n"] == 2 and len(row["completions"]) == 2 and row["completions"][0]["reason"]
    (in_tmp / "empty").mkdir()
    for bad, message in [(["--samples", "2", "--k", "4"], "needs at least that many samples"),
                         (["--temperature", "0", "--samples", "3"], "temperature 0 (greedy)"),
                         (["--adapter", "empty"], "no saved adapter there"),
                         (["--samples", "0"], "Invalid value for '--samples'")]:
        code, err = call(["code-eval", "--model", "tiny", *bad])
        assert code == 2 and message in err and "Traceback" not in err, (bad, err)

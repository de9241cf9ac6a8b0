"""Direct preference optimization (the `dpo` stage): DPO or IPO (icrl_core/objectives.py) on pairs of a right and
a wrong answer in one context, with the policy's adapters disabled as the reference. An alternative to reward
model + PPO that needs no reward model and no rollouts (unless pairs are mined from streams).

Pairs (`Pair`: prompt + chosen answer, prompt + rejected answer, as token ids):
- the tokenized episodes' (preferred, rejected) answers of every query (the reward model's pairs,
  `supervised.episode_pairs`), `batch_size * grad_accum` per step in a seeded order;
- with `dpo.mine_streams`, pairs mined from in-context RL streams the current policy rolls out at each step
  (`streams.mine_preference_pairs`: every step answered wrong gives (gold label, its answer) in that context),
  seeded by (seed, step) so a resumed run mines the same ones;
- with `dpo.mine_hindsight`, hindsight feedback couples of those streams (icrl_core/hindsight.py: each stream
  renamed so that some attempts' feedback flips; a later query whose right answer flips with it gives a pair in
  each world), DPO on the constrained decision where the two labels part;
- with `dpo.mine_code`, (passing, failing) pairs of code-task completions the current policy samples at each
  step (`code_rl.mine_code_pairs`: `dpo.code.group_size` completions per task run against its tests in the
  sandbox; every combination of one that passes every test and one that does not), seeded by (seed, step).

Per pair, with log pi(y) the summed log-probs of the answer tokens after the two sequences' common prefix:

    h      = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))
    DPO    L = -log sigmoid(beta h)          IPO    L = (h - 1 / (2 beta))^2
    implicit reward margin = beta h          preference accuracy = share of pairs with h > 0

Shapes: P pairs, B = 2P sequences (chosen then rejected), T padded length, N answer-token positions, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from icrl_core import distributed
from icrl_core.batching import chunks, pad_sequences
from icrl_core.errors import UserError
from icrl_core.objectives import dpo_loss, ipo_loss
from icrl_core.supervised import (
    Pair,
    _check_world,
    _combine,
    apply_update,
    batch_indices,
    evaluate_replay,
    make_scheduler,
    replay_enabled,
    replay_step,
)
from icrl_core.training_loop import Schedule, Trainer, run_loop


def answer_start(pair: Pair) -> int:
    """Length of the common prefix of a pair's two sequences: where their answers start to differ (shared
    answer tokens in the same context cancel in h)."""
    start = 0
    for a, b in zip(pair.preferred, pair.rejected):
        if a != b:
            break
        start += 1
    return min(start, len(pair.preferred) - 1, len(pair.rejected) - 1)


def answer_logps(policy, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> torch.Tensor:
    """log pi(y) = sum_t log pi(x_t | x_<t) over the tokens t >= start of each sequence. -> (B,)"""
    ids, attention = pad_sequences(sequences, policy.tokenizer.pad_token_id)
    predict_at = torch.zeros_like(attention, dtype=torch.bool)  # (B, T): positions whose next token is an answer's
    for row, (sequence, start) in enumerate(zip(sequences, starts)):
        predict_at[row, start - 1: len(sequence) - 1] = True
    logits, _, _ = policy.forward(ids, attention, logits_at=predict_at)  # (N, V)
    targets = ids[:, 1:][predict_at[:, :-1]]  # (N,)
    token_logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    rows = torch.arange(len(sequences)).unsqueeze(1).expand_as(predict_at)[predict_at]  # (N,) row of each token
    return torch.zeros(len(sequences)).index_add(0, rows, token_logp)


def preference_margins(policy, pairs: Sequence[Pair]) -> torch.Tensor:
    """h per pair (module docstring), with gradients through the policy; the reference (adapters disabled) is
    computed without. One padded batch of 2P sequences each. -> (P,)"""
    sequences = [p.preferred for p in pairs] + [p.rejected for p in pairs]
    starts = [answer_start(p) for p in pairs] * 2
    logp = answer_logps(policy, sequences, starts)
    with torch.no_grad(), policy.reference():
        ref_logp = answer_logps(policy, sequences, starts)
    n = len(pairs)
    return (logp[:n] - ref_logp[:n]) - (logp[n:] - ref_logp[n:])


def preference_loss(kind: str, h: torch.Tensor, beta: float) -> torch.Tensor:
    """The configured loss (mean over pairs) from the margins h (P,); dpo_loss/ipo_loss take the four log-prob
    sums, and h = (h - 0) - (0 - 0) gives them the same value."""
    zeros = torch.zeros_like(h)
    loss = dpo_loss if kind == "dpo" else ipo_loss
    return loss(h, zeros, zeros, zeros, beta)


def dpo_micro_step(policy, pairs: Sequence[Pair], cfg, n_pairs: int, scale: float = 1.0,
                   backward: bool = True) -> dict[str, float]:
    """Backpropagate scale * (len(pairs) / n_pairs) * loss over these pairs (so micro-batches and ranks add up to
    the mean over the step's n_pairs); returns loss, implicit reward margin (beta h) and accuracy (h > 0) as sums
    / n_pairs (times scale)."""
    h = preference_margins(policy, pairs)
    loss = preference_loss(cfg.loss, h, cfg.beta) * len(pairs) / max(n_pairs, 1) * scale
    if backward:
        loss.backward()
    h = h.detach()
    return {"loss": float(loss.detach()), "margin": float(cfg.beta * h.sum()) / max(n_pairs, 1) * scale,
            "accuracy": float((h > 0).float().sum()) / max(n_pairs, 1) * scale}


@torch.no_grad()
def evaluate_preferences(policy, pairs: Sequence[Pair], cfg) -> dict[str, float]:
    """Validation preference accuracy P(h > 0), loss and implicit reward margin over `pairs`."""
    policy.eval()
    sums = {"loss": 0.0, "margin": 0.0, "accuracy": 0.0, "pairs": 0.0}
    for part in chunks(distributed.shard(list(pairs)), cfg.batch_size):
        out = dpo_micro_step(policy, part, cfg, 1, backward=False)  # sums (n_pairs = 1)
        for key in ("loss", "margin", "accuracy"):
            sums[key] += out[key]
        sums["pairs"] += len(part)
    total = _combine(sums)
    n = max(total["pairs"], 1.0)
    return {"val_preference_accuracy": total["accuracy"] / n, "val_loss": total["loss"] / n,
            "val_margin": total["margin"] / n, "val_pairs": total["pairs"]}


def rolled_streams(policy, sources, data, cfg, seed: int, iteration: int, groups, split: str, max_tokens: int):
    """Streams of `groups` rolled out by the current policy (icrl_core/stream_rl.roll_out, keyed by (seed,
    iteration): a resumed run rolls out the same ones; iteration 0 = the validation draws)."""
    from icrl_core.config import PPOConfig
    from icrl_core.stream_rl import roll_out

    rollout = PPOConfig(mode="stream", stream=cfg.stream, temperature=cfg.temperature)
    policy.eval()
    return roll_out(policy, sources, data, rollout, seed, iteration, groups, split, max_tokens)


def mined_pairs(policy, streams) -> list[Pair]:
    """(gold label, its wrong answer) pairs of the streams' steps answered wrong (streams.mine_preference_pairs)."""
    from icrl_core.streams import mine_preference_pairs

    return [Pair(list(p.prompt_ids + p.chosen_ids), list(p.prompt_ids + p.rejected_ids))
            for p in mine_preference_pairs(streams, policy.tokens)]


def stream_couples(policy, streams, seed: int, iteration: int):
    """The hindsight couples of the streams (icrl_core/hindsight.py); each stream's swap drawn by (seed, iteration,
    group, index in its group), so every rank and a resumed run draw the same."""
    import random

    from icrl_core.hindsight import hindsight_couples

    index: dict[int, int] = {}
    rngs = []
    for stream in streams:
        k = index[stream.group] = index.get(stream.group, -1) + 1
        rngs.append(random.Random(f"hindsight-{seed}-{iteration}-{stream.group}-{k}"))
    return hindsight_couples(streams, policy.tokens, rngs)


def couple_micro_steps(policy, couples, cfg, n_pairs: int, scale: float, backward: bool = True
                       ) -> dict[str, float]:
    """couple_loss over chunks of `cfg.batch_size` streams (two worlds each): backpropagate scale * (chunk pairs /
    n_pairs) * loss; return loss, margin and accuracy as sums / n_pairs (times scale), like dpo_micro_step, and
    the hindsight counts (policy accuracy, couple accuracy, pairs) as plain sums."""
    from icrl_core.hindsight import couple_loss

    out = {"loss": 0.0, "margin": 0.0, "accuracy": 0.0, "hindsight_pairs": 0.0, "hindsight_policy_accuracy": 0.0,
           "hindsight_couple_accuracy": 0.0}
    for part in chunks(couples.worlds, 2 * cfg.batch_size):
        loss, sums = couple_loss(policy, part, cfg.beta, cfg.hindsight_loss)
        weight = sums["pairs"] / max(n_pairs, 1) * scale
        if backward:
            (loss * weight).backward()
        out["loss"] += float(loss.detach()) * weight
        out["margin"] += sums["margin"] / max(n_pairs, 1) * scale
        out["accuracy"] += sums["accuracy"] / max(n_pairs, 1) * scale
        out["hindsight_pairs"] += sums["pairs"]
        out["hindsight_policy_accuracy"] += sums["policy_accuracy"]
        out["hindsight_couple_accuracy"] += sums["couple_accuracy"]
    return out


@torch.no_grad()
def evaluate_couples(policy, sources, data, cfg, seed: int, max_tokens: int) -> dict[str, float]:
    """Hindsight couples of `cfg.stream.eval_groups` validation groups (the same tasks and draws at every
    evaluation, rolled out by the current policy; every rank computes all of them): the share of pairs where the
    policy prefers the chosen label (0.5 for a policy that ignores the feedback) and of couples with both pairs
    so (0 for it), their mean margin per pair (beta h, or beta m for the contrast loss), and the validation
    streams' reward and switch rate after a wrong answer."""
    from icrl_core.stream_rl import stream_statistics

    streams = rolled_streams(policy, sources, data, cfg, seed, 0, range(cfg.stream.eval_groups), "val", max_tokens)
    couples = stream_couples(policy, streams, seed, 0)
    out = couple_micro_steps(policy, couples, cfg, 1, 1.0, backward=False) if couples.worlds else {}
    pairs = out.get("hindsight_pairs", 0.0)
    stats = stream_statistics(streams)
    metrics = {"val_stream_reward": stats["mean_reward"], "val_switch_after_wrong": stats["switch_after_wrong"],
               "val_hindsight_pairs": pairs}
    if pairs:
        metrics.update({"val_hindsight_accuracy": out["hindsight_policy_accuracy"] / pairs,
                        "val_couple_accuracy": 2 * out["hindsight_couple_accuracy"] / pairs,
                        # per pair: beta h (dpo; 0 while policy = reference) or beta m (contrast; 0 if blind)
                        "val_hindsight_margin": out["margin"] / pairs})
    return metrics


def train_dpo(policy, train_pairs: Sequence[Pair], val_pairs: Sequence[Pair], cfg, seed: int, runtime,
              stream_sources=None, max_tokens: int = 2048, code=None,
              replay: tuple[Sequence, Sequence] | None = None) -> tuple[dict, list[dict]]:
    """DPO/IPO (config `dpo`) on the shared loop: AdamW on the policy's trainable weights, each step the
    (mean) loss over `batch_size * grad_accum` episode pairs (when `cfg.episode_pairs`) plus the pairs mined from
    this step's streams (when `cfg.mine_streams`; `stream_sources` = (resolved data.sources, data config)), their
    hindsight couples (when `cfg.mine_hindsight`) and the pairs of this step's code-task completions (when `cfg.mine_code`; `code` = the pipeline's `code` section),
    gradient clipping, the warm-up schedule; evaluation on `val_pairs` (and greedy pass@1 on `cfg.code.eval_tasks`
    held-out code tasks) every eval_steps, checkpoints every save_steps and after the last step. With `replay` =
    (train, validation) general-chat replay chats (icrl_core/replay.py) and `cfg.replay.beta` > 0, each step adds
    the bootstrap's replay term (`supervised.replay_step`: KL to the reference policy on the base model's own
    replies; the pair losses have no term that holds free-form replies) and each evaluation its validation KL.
    Returns (last step's metrics, every step's metrics)."""
    params = policy.trainable_parameters()
    if not params:
        raise UserError("model.adapter.kind=none leaves nothing to train; use lora or last_blocks")
    if not cfg.episode_pairs and not cfg.mine_streams and not cfg.mine_hindsight and not cfg.mine_code:
        raise UserError("dpo has no pairs: set dpo.episode_pairs, dpo.mine_streams, dpo.mine_hindsight or "
                        "dpo.mine_code")
    if cfg.episode_pairs and not train_pairs:
        raise UserError("dpo.episode_pairs: the tokenized train split has no (preferred, rejected) pairs")
    if (cfg.mine_streams or cfg.mine_hindsight) and cfg.stream.groups % distributed.world_size():
        raise UserError(f"dpo.stream.groups={cfg.stream.groups} must be a multiple of the number of "
                        f"data-parallel workers ({distributed.world_size()})")
    if cfg.mine_code and cfg.code.tasks_per_step % distributed.world_size():
        raise UserError(f"dpo.code.tasks_per_step={cfg.code.tasks_per_step} must be a multiple of the number of "
                        f"data-parallel workers ({distributed.world_size()})")
    task_set = eval_tasks = None
    if cfg.mine_code:
        from icrl_core import code_rl

        task_set = code_rl.CodeTaskSet.from_config(code)
        eval_tasks = code_rl.eval_sample(task_set.test, cfg.code.eval_tasks, seed)
    if cfg.reference == "start":  # before the loop restores a checkpoint: the reference is where the run began
        policy.freeze_reference()
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = make_scheduler(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.lr_schedule)
    val_pairs = list(val_pairs)[: cfg.max_eval_pairs]
    global_batch = cfg.batch_size * cfg.grad_accum
    world = _check_world(global_batch) if cfg.episode_pairs else distributed.world_size()
    replay_on = replay_enabled(replay, cfg.replay)
    replay_val = replay_on and len(replay[1]) > 0  # chats held back for the evaluations

    def step(number: int) -> dict[str, float]:
        began = time.perf_counter()
        pairs: list[Pair] = []
        if cfg.episode_pairs:
            pairs = distributed.shard([train_pairs[i] for i in batch_indices(len(train_pairs), seed, number - 1,
                                                                             global_batch)])
        mined, couples = [], None
        if cfg.mine_streams or cfg.mine_hindsight:
            sources, data = stream_sources
            streams = rolled_streams(policy, sources, data, cfg, seed, number,
                                     distributed.shard(range(cfg.stream.groups)), "train", max_tokens)
            if cfg.mine_streams:
                mined = mined_pairs(policy, streams)
                pairs = pairs + mined
            if cfg.mine_hindsight:
                couples = stream_couples(policy, streams, seed, number)
        code_pairs, code_stats = [], {}
        if cfg.mine_code:
            code_pairs, code_stats = code_rl.mine_code_pairs(policy, task_set, cfg.code, code, cfg.temperature, seed,
                                                             number, max_tokens, cfg.batch_size)
            pairs = pairs + code_pairs
        policy.train()
        optimizer.zero_grad(set_to_none=True)
        # every rank's pairs count: the mean is over the step's pairs of all ranks (hindsight pairs included)
        local = float(len(pairs) + (couples.pairs if couples else 0))
        n_pairs = round(_combine({"pairs": local})["pairs"])
        sums: dict[str, float] = {"tokens": 0.0, "loss": 0.0, "margin": 0.0, "accuracy": 0.0}
        for part in chunks(pairs, cfg.batch_size):
            out = dpo_micro_step(policy, part, cfg, n_pairs, scale=world)
            for key, value in out.items():  # scaled by W: their mean over ranks is the global value
                sums[key] += value
            sums["tokens"] += sum(len(p.preferred) + len(p.rejected) for p in part)
        hindsight = {}
        if couples is not None:
            out = couple_micro_steps(policy, couples, cfg, n_pairs, scale=world) if couples.worlds else {}
            for key in ("loss", "margin", "accuracy"):
                sums[key] += out.get(key, 0.0)
            sums["tokens"] += sum(len(w.input_ids) for w in couples.worlds)
            hindsight = _combine({"pairs": out.get("hindsight_pairs", 0.0),
                                  "policy": out.get("hindsight_policy_accuracy", 0.0),
                                  "couples": out.get("hindsight_couple_accuracy", 0.0),
                                  "skipped": float(couples.skipped)})
        if replay_on:
            out = replay_step(policy, replay[0], cfg.replay, seed, number, cfg.batch_size, world)
            sums["replay_kl"] = out["replay_kl"]
            sums["tokens"] += out["tokens"]
        metrics = apply_update(params, optimizer, scheduler, cfg.max_grad_norm, sums, world, began)
        metrics["pairs"] = float(n_pairs)
        if cfg.mine_streams:
            metrics["mined_pairs"] = _combine({"mined": float(len(mined))})["mined"]
        if couples is not None:  # the policy's own preference at the couples, before this step's update
            pairs_h = max(hindsight["pairs"], 1.0)
            metrics.update({"hindsight_pairs": hindsight["pairs"], "hindsight_skipped": hindsight["skipped"],
                            "hindsight_accuracy": hindsight["policy"] / pairs_h,
                            "couple_accuracy": 2 * hindsight["couples"] / pairs_h})
        if cfg.mine_code:  # the sampled completions' pass rate and reward components (reward/<name>)
            metrics.update(distributed.mean_metrics(code_stats))
            metrics["code_pairs"] = _combine({"code": float(len(code_pairs))})["code"]
        return metrics

    hindsight_eval = cfg.mine_hindsight and cfg.stream.eval_groups > 0

    def evaluate() -> dict[str, float]:
        metrics = evaluate_preferences(policy, val_pairs, cfg) if val_pairs else {}
        if hindsight_eval:
            metrics.update(evaluate_couples(policy, *stream_sources, cfg, seed, max_tokens))
        if replay_val:
            metrics.update(evaluate_replay(policy, replay[1], cfg.batch_size))
        if eval_tasks:
            metrics.update(code_rl.evaluate_greedy(policy, eval_tasks, task_set.shot, code, cfg.code.max_new_tokens,
                                                   max_tokens, cfg.batch_size))
        return metrics

    trainer = Trainer(step, optimizer, scheduler, params, policy.trainable_state_dict,
                      lambda tensors: policy.load_trainable_state_dict(tensors, "checkpoint"),
                      evaluate if val_pairs or eval_tasks or hindsight_eval or replay_val else None)
    schedule = Schedule(cfg.max_steps, cfg.eval_steps, cfg.save_steps, evaluate_first=True)
    result = run_loop(trainer, schedule, runtime)
    metrics = dict(result.last)
    if result.evals and "val_preference_accuracy" in result.evals[0]:  # the starting weights' (step 0)
        metrics["val_preference_accuracy_before"] = result.evals[0]["val_preference_accuracy"]
    for key in ("val_hindsight_accuracy", "val_couple_accuracy", "val_hindsight_margin", "val_stream_reward",
                "val_switch_after_wrong", "val_replay_kl"):  # couples, streams and replay before any update
        if result.evals and key in result.evals[0]:
            metrics[f"{key}_before"] = result.evals[0][key]
    if result.evals and "val_accuracy" in result.evals[0]:  # code tasks: greedy pass@1 before and after
        metrics["val_accuracy_before"] = result.evals[0]["val_accuracy"]
        metrics["val_accuracy_after"] = result.evals[-1]["val_accuracy"]
    return metrics, result.history

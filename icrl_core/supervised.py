"""Stages 3-4: supervised losses, batching, and the bootstrap and reward-model training loops.

Losses (one function each, formula in the docstring):
- `masked_token_cross_entropy`: CE_t = -log pi(y_t | x_<t) on answer tokens only.
- `kl_policy_base` (icrl_core/objectives.py): KL_t = sum_v pi(v | x_<t) (log pi(v | x_<t) - log pi_base(v | x_<t)).
- `bradley_terry_loss`:          L = -log sigmoid(r(x, y+) - r(x, y-)).
- `bootstrap_objective`:         L = (sum_t CE_t + kl_beta * sum_t KL_t) / N_answer_tokens.
- `replay_objective`:            L_replay = replay_beta * sum_t KL_t / N_reply_tokens over general-chat replies
                                 (icrl_core/replay.py), added to each bootstrap, dpo or ppo step when replay is on.

Both loops run on the shared training loop (icrl_core/training_loop.py), which talks only to a runtime
(`tasks/runtime.py`: `report`, `save_checkpoint`, `load_latest_checkpoint`). They are deterministic given the seed: the data order of step s is a pure function of
(seed, s), so a resumed run reads exactly the batches an uninterrupted one would; checkpoints carry the
trainable weights, optimizer, scheduler and RNG states.

Data parallel: each optimizer step takes a *global* batch of batch_size * grad_accum sequences; rank r
processes items r, r + W, ... of it. Every rank knows the global number of answer tokens (pairs), so each one
scales its summed loss by W / N_global; after `average_gradients` (a mean over ranks) the gradient equals the
one-process gradient of the token-mean loss, whatever the split. Metrics are combined the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from icrl_core import distributed
from icrl_core.batching import chunks, pad_sequences
from icrl_core.device import to_device
from icrl_core.errors import UserError
from icrl_core.objectives import kl_policy_base
from icrl_core.replay import pad_replay, replay_kl
from icrl_core.tokenized import TokenizedEpisode
from icrl_core.training_loop import Schedule, Trainer, run_loop

# ---------------------------------------------------------------------------------------------------------------
# Losses


def masked_token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """CE_t = -log softmax(z_t)[y_t] for each selected position t.

    logits: (N, V) at the N positions that predict an answer token; targets: (N,) those tokens. -> (N,)"""
    return F.cross_entropy(logits.float(), targets, reduction="none")


def bootstrap_objective(ce: torch.Tensor, kl: torch.Tensor | None, kl_beta: float, n_tokens: int) -> torch.Tensor:
    """L = (sum_t CE_t + kl_beta * sum_t KL_t) / n_tokens.

    ce, kl: (N,) per answer token of this micro-batch; n_tokens: answer tokens of the whole (global) batch, so
    micro-batches and ranks add up to the token mean."""
    total = ce.sum() if kl is None else ce.sum() + kl_beta * kl.sum()
    return total / max(n_tokens, 1)


def replay_objective(kl: torch.Tensor, replay_beta: float, n_tokens: int) -> torch.Tensor:
    """L_replay = replay_beta * sum_t KL_t / n_tokens.

    kl: (N,) KL(pi || pi_base) per reply token of this micro-batch; n_tokens: reply tokens of the whole (global)
    replay batch of the step."""
    return replay_beta * kl.sum() / max(n_tokens, 1)


def bradley_terry_loss(r_preferred: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """L_i = -log sigmoid(r_i+ - r_i-) = softplus(r_i- - r_i+) (numerically stable form).

    r_preferred, r_rejected: (B,) scalar rewards of the same prompts. -> (B,)"""
    return F.softplus(r_rejected.float() - r_preferred.float())


# ---------------------------------------------------------------------------------------------------------------
# Batching


@dataclass
class EpisodeBatch:
    """Right-padded episodes. Shapes (B, T)."""

    input_ids: torch.Tensor  # long
    attention_mask: torch.Tensor  # long, 1 on real tokens
    loss_mask: torch.Tensor  # bool, trained answer tokens
    query_ids: torch.Tensor  # long, index of the query whose answer a token belongs to, -1 elsewhere
    n_queries: int

    @property
    def predict_at(self) -> torch.Tensor:
        """(B, T) bool: positions t whose next token t+1 is a trained answer token (where logits are needed)."""
        out = torch.zeros_like(self.loss_mask)
        out[:, :-1] = self.loss_mask[:, 1:]
        return out

    @property
    def targets(self) -> torch.Tensor:
        """(N,) the answer tokens predicted at `predict_at`, in the same (row-major) order."""
        return self.input_ids[:, 1:][self.loss_mask[:, 1:]]

    @property
    def target_query_ids(self) -> torch.Tensor:
        """(N,) query index of each target token (-1: an exemplar answer)."""
        return self.query_ids[:, 1:][self.loss_mask[:, 1:]]


def pad_episodes(rows: Sequence[TokenizedEpisode], pad_id: int) -> EpisodeBatch:
    width = max(row.length for row in rows)
    shape = (len(rows), width)
    ids = torch.full(shape, pad_id, dtype=torch.long)
    attention = torch.zeros(shape, dtype=torch.long)
    loss = torch.zeros(shape, dtype=torch.bool)
    query_ids = torch.full(shape, -1, dtype=torch.long)
    n_queries = 0
    for i, row in enumerate(rows):
        ids[i, :row.length] = torch.tensor(row.input_ids, dtype=torch.long)
        attention[i, :row.length] = 1
        loss[i, :row.length] = torch.tensor(row.loss_mask, dtype=torch.bool)
        for start, end in zip(row.query_start, row.query_end):
            query_ids[i, start:end] = n_queries
            n_queries += 1
    return EpisodeBatch(ids, attention, loss, query_ids, n_queries)


def answer_tokens(row: TokenizedEpisode) -> int:
    """Trained tokens of an episode that have a predecessor (the first token is never predicted)."""
    return int(sum(row.loss_mask[1:]))


# ---------------------------------------------------------------------------------------------------------------
# Data order, optimizer, schedule


def epoch_permutation(n_items: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_items)


def batch_indices(n_items: int, seed: int, step: int, global_batch: int) -> list[int]:
    """Item indices of optimizer step `step`: positions [step*G, (step+1)*G) of the stream made of one seeded
    permutation per epoch. A pure function of (seed, step): resuming at step s reads the same data."""
    if n_items == 0:
        raise UserError("the training split is empty: build more episodes or lower data.val_fraction")
    out = []
    position = step * global_batch
    while len(out) < global_batch:
        epoch, offset = divmod(position, n_items)
        take = min(global_batch - len(out), n_items - offset)
        out.extend(int(i) for i in epoch_permutation(n_items, seed, epoch)[offset:offset + take])
        position += take
    return out


def data_position(n_items: int, step: int, global_batch: int) -> dict[str, int]:
    """Where step `step` starts in the data stream (stored in checkpoints for inspection)."""
    epoch, offset = divmod(step * global_batch, max(n_items, 1))
    return {"epoch": epoch, "offset": offset}


def make_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int,
                   schedule: str) -> torch.optim.lr_scheduler.LambdaLR:
    """lr(s) = lr0 * min(1, (s+1)/warmup) during warm-up, then constant or linear decay to 0 at max_steps."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "linear":
            return max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _check_world(global_batch: int) -> int:
    """Every rank needs at least one item of each global batch (a rank without one would skip the gradient
    all-reduce that the others wait in)."""
    world = distributed.world_size()
    if global_batch < world:
        raise UserError(f"batch_size * grad_accum = {global_batch} is smaller than the {world} data-parallel "
                        "workers; raise batch_size or lower ray.num_workers")
    return world


def _combine(local_sums: dict[str, float]) -> dict[str, float]:
    """Sum of each value over ranks (mean_metrics is a mean)."""
    world = distributed.world_size()
    return {k: v * world for k, v in distributed.mean_metrics(local_sums).items()}


# ---------------------------------------------------------------------------------------------------------------
# Bootstrap: masked CE + KL to the base policy


def apply_update(params: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer, scheduler, max_grad_norm: float,
                 sums: dict[str, float], world: int, began: float) -> dict[str, float]:
    """One optimizer step from accumulated gradients: average them over ranks, clip their global norm to
    `max_grad_norm`, step optimizer and schedule. Returns the step's metrics: `sums` (scaled by the world size, so
    their mean over ranks is the global value) averaged over ranks, the forward tokens of all ranks, the seconds since
    `began` (the step's start) and tokens/s over them, the lr the step used and the gradient norm before clipping."""
    distributed.average_gradients(params)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    metrics = distributed.mean_metrics(sums)
    seconds = max(time.perf_counter() - began, 1e-9)
    metrics["tokens"] *= world  # the step's forward tokens over all ranks
    metrics.update({"tokens_per_s": metrics["tokens"] / seconds, "step_seconds": seconds})
    metrics.update({"lr": lr, "grad_norm": grad_norm})
    return metrics


def bootstrap_micro_step(policy, batch: EpisodeBatch, kl_beta: float, n_tokens: int, scale: float = 1.0,
                         backward: bool = True) -> dict[str, float]:
    """Forward the policy (and, when kl_beta > 0, the reference policy) on one micro-batch; backpropagate
    `scale * bootstrap_objective`. Returns sums over this micro-batch divided by n_tokens (times scale)."""
    batch = to_device(batch, policy.device)
    predict_at = batch.predict_at
    logits, _, _ = policy.forward(batch.input_ids, batch.attention_mask, logits_at=predict_at)  # (N, V)
    ce = masked_token_cross_entropy(logits, batch.targets)
    kl = None
    if kl_beta > 0:
        with torch.no_grad(), policy.reference():
            base_logits, _, _ = policy.forward(batch.input_ids, batch.attention_mask, logits_at=predict_at)
        kl = kl_policy_base(logits, base_logits)
    loss = bootstrap_objective(ce, kl, kl_beta, n_tokens) * scale
    if backward:
        loss.backward()
    out = {"loss": float(loss.detach()), "ce": float(ce.detach().sum()) / max(n_tokens, 1) * scale}
    if kl is not None:
        out["kl"] = float(kl.detach().sum()) / max(n_tokens, 1) * scale
    return out


def replay_micro_step(policy, batch, replay_beta: float, n_tokens: int, scale: float = 1.0) -> dict[str, float]:
    """Backpropagate `scale * replay_objective` on one replay micro-batch (icrl_core.replay.ReplayBatch).
    Returns the KL's sum over this micro-batch divided by n_tokens (times scale)."""
    kl = replay_kl(policy, batch)
    (replay_objective(kl, replay_beta, n_tokens) * scale).backward()
    return {"replay_kl": float(kl.detach().sum()) / max(n_tokens, 1) * scale}


def replay_step(policy, chats: Sequence, replay_cfg, seed: int, number: int, batch_size: int,
                world: int) -> dict[str, float]:
    """Backpropagate step `number`'s replay term: `replay_cfg.per_step` of the replay chats `chats`, drawn from
    their own seeded order (seed + 1, so turning replay on changes no other draw of the step), in micro-batches of
    `batch_size`, each `replay_micro_step` weighted by `replay_cfg.beta`. Returns the sums {replay_kl, tokens}
    (replay_kl scaled by `world` like the other micro-steps' sums)."""
    pad = policy.tokenizer.pad_token_id
    drawn = [chats[i] for i in batch_indices(len(chats), seed + 1, number - 1, replay_cfg.per_step)]
    n_reply = sum(c.reply_tokens for c in drawn)
    sums = {"replay_kl": 0.0, "tokens": 0.0}
    for part in chunks(distributed.shard(drawn), batch_size):
        sums["replay_kl"] += replay_micro_step(policy, pad_replay(part, pad), replay_cfg.beta, n_reply,
                                               scale=world)["replay_kl"]
        sums["tokens"] += sum(len(c.input_ids) for c in part)
    return sums


def replay_enabled(replay: tuple[Sequence, Sequence] | None, replay_cfg) -> bool:
    """Whether a stage given `replay` = (train, validation) chats adds the replay term: beta > 0 and chats."""
    return replay is not None and replay_cfg.beta > 0 and len(replay[0]) > 0


@torch.no_grad()
def evaluate_replay(policy, sequences, batch_size: int) -> dict:
    """Validation: token-mean KL(pi || pi_base) over the reply positions of held-back replay chats."""
    policy.eval()
    pad = policy.tokenizer.pad_token_id
    sums = {"kl": 0.0, "tokens": 0.0}
    for part in chunks(distributed.shard(list(sequences)), batch_size):
        batch = pad_replay(part, pad)
        sums["kl"] += float(replay_kl(policy, batch).sum())
        sums["tokens"] += batch.n_tokens
    total = _combine(sums)
    return {"val_replay_kl": total["kl"] / max(total["tokens"], 1.0)}


def query_accuracy(correct: torch.Tensor, query_ids: torch.Tensor, n_queries: int) -> torch.Tensor:
    """acc_q = min over the answer tokens t of query q of correct_t (1 iff every token is the argmax).

    correct: (N,) 0/1 per target token; query_ids: (N,) query index per token (-1: not a query answer).
    -> (n_queries,) long."""
    keep = query_ids >= 0
    per_query = torch.ones(n_queries, dtype=torch.long, device=correct.device)
    return per_query.scatter_reduce_(0, query_ids[keep], correct[keep].long(), reduce="amin")


@torch.no_grad()
def evaluate_bootstrap(policy, rows: Sequence[TokenizedEpisode], batch_size: int, kl_beta: float) -> dict:
    """Validation: token-mean CE and KL on answer tokens, loss = ce + kl_beta * kl, and answer accuracy = share
    of queries whose every answer token (end-of-turn included) is the greedy argmax."""
    policy.eval()
    pad = policy.tokenizer.pad_token_id
    mine = distributed.shard(list(rows))
    sums = {"ce": 0.0, "kl": 0.0, "tokens": 0.0, "correct": 0.0, "queries": 0.0}
    for part in chunks(mine, batch_size):
        batch = to_device(pad_episodes(part, pad), policy.device)
        predict_at = batch.predict_at
        logits, _, _ = policy.forward(batch.input_ids, batch.attention_mask, logits_at=predict_at)
        targets = batch.targets
        sums["ce"] += float(masked_token_cross_entropy(logits, targets).sum())
        with policy.reference():
            base_logits, _, _ = policy.forward(batch.input_ids, batch.attention_mask, logits_at=predict_at)
        sums["kl"] += float(kl_policy_base(logits, base_logits).sum())
        sums["tokens"] += targets.numel()
        correct = (logits.argmax(-1) == targets).long()
        sums["correct"] += float(query_accuracy(correct, batch.target_query_ids, batch.n_queries).sum())
        sums["queries"] += batch.n_queries
    total = _combine(sums)
    tokens, queries = max(total["tokens"], 1.0), max(total["queries"], 1.0)
    ce, kl = total["ce"] / tokens, total["kl"] / tokens
    return {"val_loss": ce + kl_beta * kl, "val_ce": ce, "val_kl": kl,
            "val_answer_accuracy": total["correct"] / queries, "val_queries": total["queries"]}


def train_bootstrap(policy, train_rows: Sequence[TokenizedEpisode], val_rows: Sequence[TokenizedEpisode], cfg,
                    seed: int, runtime, replay: tuple[Sequence, Sequence] | None = None) -> tuple[dict, list[dict]]:
    """Supervised bootstrap (config `bootstrap`): AdamW on the policy's trainable parameters (LoRA or last
    blocks), loss `bootstrap_objective`, linear warm-up (+ optional linear decay), gradient clipping.
    With `replay` = (train, validation) replay chats (icrl_core.replay) and `cfg.replay.beta` > 0, each step
    adds `replay_objective` on `cfg.replay.per_step` of them (drawn like the episodes, a pure function of
    (seed, step)). Runs on the shared loop (icrl_core/training_loop.py): evaluates every `eval_steps` and at the
    end, checkpoints every `save_steps` and at the end.
    Returns (metrics of the last step, train + validation; the metrics of every step)."""
    replay_cfg = cfg.replay
    replay_on = replay_enabled(replay, replay_cfg)
    params = policy.trainable_parameters()
    if not params:
        raise UserError("model.adapter.kind=none leaves nothing to train; use lora or last_blocks")
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = make_scheduler(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.lr_schedule)
    val_rows = list(val_rows)[: cfg.max_eval_episodes]
    pad = policy.tokenizer.pad_token_id
    global_batch = cfg.batch_size * cfg.grad_accum
    world = _check_world(global_batch)

    def step(number: int) -> dict[str, float]:
        began = time.perf_counter()
        policy.train()
        rows = [train_rows[i] for i in batch_indices(len(train_rows), seed, number - 1, global_batch)]
        n_tokens = sum(answer_tokens(r) for r in rows)
        optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"tokens": 0.0}
        for part in chunks(distributed.shard(rows), cfg.batch_size):
            out = bootstrap_micro_step(policy, pad_episodes(part, pad), cfg.kl_beta, n_tokens, scale=world)
            for key, value in out.items():  # scaled by W: their mean over ranks is the global value
                sums[key] = sums.get(key, 0.0) + value
            sums["tokens"] += sum(r.length for r in part)
        if replay_on:
            out = replay_step(policy, replay[0], replay_cfg, seed, number, cfg.batch_size, world)
            sums["replay_kl"] = out["replay_kl"]
            sums["tokens"] += out["tokens"]
        return apply_update(params, optimizer, scheduler, cfg.max_grad_norm, sums, world, began)

    def evaluate() -> dict[str, float]:
        metrics = {}
        if val_rows:
            metrics.update(evaluate_bootstrap(policy, val_rows, cfg.batch_size, cfg.kl_beta))
        if replay_on and len(replay[1]) > 0:
            metrics.update(evaluate_replay(policy, replay[1], cfg.batch_size))
        return metrics

    has_val = bool(val_rows) or (replay_on and len(replay[1]) > 0)
    trainer = Trainer(step, optimizer, scheduler, params, policy.trainable_state_dict,
                      lambda tensors: policy.load_trainable_state_dict(tensors, "checkpoint"),
                      evaluate if has_val else None,
                      state=lambda number: {"data": data_position(len(train_rows), number, global_batch)})
    result = run_loop(trainer, Schedule(cfg.max_steps, cfg.eval_steps, cfg.save_steps), runtime)
    return result.last, result.history


# ---------------------------------------------------------------------------------------------------------------
# Reward model: Bradley-Terry on (prompt + preferred) vs (prompt + rejected)


@dataclass(frozen=True)
class Pair:
    """Token ids of prompt + preferred answer and prompt + rejected answer (both end with end-of-turn)."""

    preferred: list[int]
    rejected: list[int]


def episode_pairs(rows: Sequence[TokenizedEpisode]) -> list[Pair]:
    return [Pair(p, r) for row in rows for p, r in row.pairs()]


def reward_micro_step(reward_model, pairs: Sequence[Pair], n_pairs: int, scale: float = 1.0,
                      backward: bool = True) -> dict[str, float]:
    """Score preferred and rejected sequences in one padded batch; backpropagate
    scale * sum_i BT_i / n_pairs. Returns loss, accuracy (r+ > r-) and margin (r+ - r-) sums / n_pairs, and the
    plain sums of the 2B rewards and of their squares (reward_sum, reward_sq_sum: the reward scale, unscaled)."""
    sequences = [p.preferred for p in pairs] + [p.rejected for p in pairs]
    ids, attention = pad_sequences(sequences, reward_model.pad_id)
    rewards = reward_model.forward(ids, attention)  # (2B,)
    r_pref, r_rej = rewards[: len(pairs)], rewards[len(pairs):]
    losses = bradley_terry_loss(r_pref, r_rej)
    loss = losses.sum() / max(n_pairs, 1) * scale
    if backward:
        loss.backward()
    margin = (r_pref - r_rej).detach()
    detached = rewards.detach().double()
    return {"loss": float(loss.detach()), "accuracy": float((margin > 0).float().sum()) / max(n_pairs, 1) * scale,
            "margin": float(margin.sum()) / max(n_pairs, 1) * scale,
            "reward_sum": float(detached.sum()), "reward_sq_sum": float((detached ** 2).sum())}


@torch.no_grad()
def evaluate_reward_model(reward_model, pairs: Sequence[Pair], batch_size: int) -> dict:
    """Validation pairwise accuracy P(r+ > r-), Bradley-Terry loss, mean reward margin, and the mean and
    (sample) standard deviation of the 2N rewards: the reward scale PPO sees, from the same forward passes."""
    reward_model.eval()
    mine = distributed.shard(list(pairs))
    keys = ("loss", "accuracy", "margin", "reward_sum", "reward_sq_sum")
    sums = {key: 0.0 for key in keys} | {"pairs": 0.0}
    for part in chunks(mine, batch_size):
        out = reward_micro_step(reward_model, part, 1, backward=False)  # sums (n_pairs=1)
        for key in keys:
            sums[key] += out[key]
        sums["pairs"] += len(part)
    total = _combine(sums)
    n = max(total["pairs"], 1.0)
    scores = 2 * total["pairs"]
    mean = total["reward_sum"] / max(scores, 1.0)
    variance = (total["reward_sq_sum"] - scores * mean ** 2) / (scores - 1) if scores > 1 else 0.0
    return {"val_pairwise_accuracy": total["accuracy"] / n, "val_loss": total["loss"] / n,
            "val_margin": total["margin"] / n, "val_pairs": total["pairs"],
            "val_reward_mean": mean, "val_reward_std": math.sqrt(max(variance, 0.0))}


def train_reward_model(reward_model, train_pairs: Sequence[Pair], val_pairs: Sequence[Pair], cfg, seed: int,
                       runtime) -> tuple[dict, list[dict]]:
    """Reward model training (config `reward_model`): AdamW with two groups (adapter at learning_rate, head at
    head_learning_rate), Bradley-Terry loss on `batch_size * grad_accum` pairs per step. Same loop, checkpoint,
    evaluation and data-parallel rules as the bootstrap. Returns (last step's metrics, every step's metrics)."""
    groups = [{"params": reward_model.backbone_parameters(), "lr": cfg.learning_rate},
              {"params": list(reward_model.head.parameters()), "lr": cfg.head_learning_rate}]
    groups = [g for g in groups if g["params"]]
    params = [p for g in groups for p in g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = make_scheduler(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.lr_schedule)
    val_pairs = list(val_pairs)[: cfg.max_eval_pairs]
    global_batch = cfg.batch_size * cfg.grad_accum
    world = _check_world(global_batch)

    def step(number: int) -> dict[str, float]:
        began = time.perf_counter()
        reward_model.train()
        pairs = [train_pairs[i] for i in batch_indices(len(train_pairs), seed, number - 1, global_batch)]
        optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"tokens": 0.0}
        for part in chunks(distributed.shard(pairs), cfg.batch_size):
            out = reward_micro_step(reward_model, part, len(pairs), scale=world)
            for key in ("loss", "accuracy", "margin"):  # scaled by W: their mean over ranks is the global value
                sums[key] = sums.get(key, 0.0) + out[key]
            sums["tokens"] += sum(len(p.preferred) + len(p.rejected) for p in part)
        return apply_update(params, optimizer, scheduler, cfg.max_grad_norm, sums, world, began)

    def evaluate() -> dict[str, float]:
        return evaluate_reward_model(reward_model, val_pairs, cfg.batch_size)

    trainer = Trainer(step, optimizer, scheduler, params, reward_model.trainable_tensors,
                      reward_model.load_trainable_tensors, evaluate if val_pairs else None,
                      state=lambda number: {"data": data_position(len(train_pairs), number, global_batch)})
    result = run_loop(trainer, Schedule(cfg.max_steps, cfg.eval_steps, cfg.save_steps), runtime)
    return result.last, result.history


def finite(metrics: dict) -> dict:
    """Drop NaN/inf values (JSON metrics files must be valid for DVC)."""
    return {k: v for k, v in metrics.items() if not (isinstance(v, float) and not math.isfinite(v))}

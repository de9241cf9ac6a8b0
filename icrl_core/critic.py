"""In-context value learning (issue 28): a critic that reads earlier attempts at a prompt and the feedback on them,
then predicts how the current attempt will end; Q-weighted sampling with it, reverse-KL distillation of that
sampler into the policy, and the selectors that use the critic (best-of-n) or not (consistency). One pure function
per operation (CleanRL style), the formula in its docstring. Schema: icrl_core/critic_config.py (`critic`).

Shapes: K joint bins = R reward bins x L remaining-length bins (bin k = r * L + l, one added token each), N
labelled positions, B rows, T padded length, V vocabulary, C candidate tokens of a state (padded to the same C,
`mask` marks the real ones).

The critic. A packed context is

    prompt, y_1, f_1, y_2, f_2, ..., y_(n-1), f_(n-1), y_n[: t]

with y_i a trajectory (the tokens of one sampled answer) and f_i its feedback line ("Reward: r_i / Length: |y_i|").
Reading token j of trajectory i, the critic predicts the joint bin k*(i, j) = bin(r_i, |y_i| - 1 - j) through the LM
head's rows of the K added tokens (the tokens are outputs only; they never appear in a context):

    P(k | context)   = softmax(z[joint token ids])_k                         (joint_bin_logits)
    L                = mean over supervised positions of -log P(k* | context) (critic_loss)
    supervised       = the tokens of trajectories i >= N: each has N - 1 earlier attempts to read (pack_context)
    P(success)       = sum_(k: value(r(k)) >= threshold) P(k)                 (success_probability)
    E[r]             = sum_k P(k) value(r(k))                                 (expected_reward)

Q-weighted sampling over the reference policy's min-p candidates C(s) = {a : pi_ref(a|s) >= min_p max_a' pi_ref(a'|s)}
(at most max_candidates, the most probable):

    Q(s, a)          = E[r] (or P(success)) the critic predicts after reading s + a       (candidate_q_values)
    pi_new(a|s)      = pi_ref(a|s) exp(Q(s, a) / tau) / sum_(a' in C(s)) pi_ref(a'|s) exp(Q(s, a') / tau)
    distillation     KL(pi_theta || pi_new) = sum_(a in C(s)) pi_theta(a|s) (log pi_theta(a|s) - log pi_new(a|s)),
                     pi_theta renormalised over C(s) (pi_new is 0 outside it)               (reverse_kl_loss)

Selection among n sampled trajectories of a prompt: best-of-n takes the one the critic scores highest (E[r] at its
last token), random-of-n is the mean reward (the expectation of a uniform pick), consistency takes an answer of
the most frequent kind (majority vote).

Training, on the shared loop (icrl_core/training_loop.py): `train_critic` (the critic on packed contexts of
sampled trajectories) and `train_distilled_policy` (the policy by reverse-KL distillation of pi_new, or by
rejection fine-tuning: L = token-mean -log pi_theta(y_t | x, y_<t) over successful trajectories, `rft_loss`).
"""

from __future__ import annotations

import bisect
import html
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from icrl_core import distributed
from icrl_core.batching import chunks, pad_sequences
from icrl_core.critic_config import CriticBins, CriticConfig, CriticDistillConfig, QSampling
from icrl_core.errors import UserError

TOKEN_NAME = "<|critic_r{reward}_l{length}|>"
NO_LABEL = -1

# --------------------------------------------------------------------------------------------------------------
# Joint (reward bin x remaining-length bin) tokens


@dataclass(frozen=True)
class JointBins:
    """The critic's K = R * L output classes (config `critic.bins`)."""

    reward_values: tuple[float, ...]
    length_edges: tuple[int, ...]
    success_threshold: float

    @classmethod
    def from_config(cls, cfg: CriticBins) -> JointBins:
        return cls(tuple(cfg.reward_values), tuple(cfg.length_edges), cfg.success_threshold)

    @property
    def n_reward(self) -> int:
        return len(self.reward_values)

    @property
    def n_length(self) -> int:
        return len(self.length_edges) + 1

    @property
    def size(self) -> int:
        return self.n_reward * self.n_length

    def reward_bin(self, reward: float) -> int:
        """r = index of the reward value nearest `reward` (a tie goes to the higher value)."""
        values = self.reward_values
        return bisect.bisect_right([(a + b) / 2 for a, b in itertools.pairwise(values)], reward)

    def length_bin(self, remaining: int) -> int:
        """l with e_(l-1) <= remaining < e_l (e_(-1) = 0, e_L = inf)."""
        if remaining < 0:
            raise ValueError(f"remaining length {remaining} < 0")
        return bisect.bisect_right(self.length_edges, remaining)

    def index(self, reward: float, remaining: int) -> int:
        """k = r * L + l."""
        return self.reward_bin(reward) * self.n_length + self.length_bin(remaining)

    def split(self, k: int) -> tuple[int, int]:
        """(r, l) of joint bin k."""
        if not 0 <= k < self.size:
            raise ValueError(f"joint bin {k} outside [0, {self.size})")
        return divmod(k, self.n_length)

    def length_range(self, length_bin: int) -> tuple[int, int | None]:
        """[low, high) of a remaining-length bin (high None: unbounded)."""
        edges = (0,) + self.length_edges
        return edges[length_bin], (self.length_edges[length_bin] if length_bin < len(self.length_edges) else None)

    def token_names(self) -> list[str]:
        """The added token of each joint bin, in bin order."""
        return [TOKEN_NAME.format(reward=r, length=j) for r in range(self.n_reward) for j in range(self.n_length)]

    def reward_of_bins(self) -> torch.Tensor:
        """(R,) the reward each reward bin stands for."""
        return torch.tensor(self.reward_values, dtype=torch.float32)

    def success_bins(self) -> torch.Tensor:
        """(R,) bool: reward bins that count as success (value >= threshold)."""
        return self.reward_of_bins() >= self.success_threshold


@dataclass(frozen=True)
class CriticTokens:
    """The token id of each joint bin in a tokenizer (`ids[k]`)."""

    bins: JointBins
    ids: tuple[int, ...]

    def encode(self, reward: float, remaining: int) -> int:
        """(reward, remaining length) -> the token id of its joint bin."""
        return self.ids[self.bins.index(reward, remaining)]

    def decode(self, token_id: int) -> tuple[float, tuple[int, int | None]]:
        """token id -> (the reward value of its bin, [low, high) of its remaining-length bin)."""
        try:
            k = self.ids.index(token_id)
        except ValueError:
            raise ValueError(f"token {token_id} is not a critic token") from None
        r, length_bin = self.bins.split(k)
        return self.bins.reward_values[r], self.bins.length_range(length_bin)


def add_critic_tokens(model, tokenizer, bins: JointBins) -> CriticTokens:
    """Add the K joint-bin tokens to the tokenizer and resize the model's (tied) embedding by K rows, each starting
    at the mean embedding (so the untrained critic predicts the uniform distribution over bins)."""
    from icrl_core.model import add_special_tokens

    return CriticTokens(bins, tuple(add_special_tokens(model, tokenizer, bins.token_names())))


def critic_tokens(tokenizer, bins: JointBins) -> CriticTokens:
    """The joint-bin tokens of a tokenizer that already has them (a critic loaded with `new_critic`)."""
    names = bins.token_names()
    vocab = tokenizer.get_vocab()
    missing = [name for name in names if name not in vocab]
    if missing:
        raise UserError(f"the tokenizer has no critic tokens {missing[:2]}...: load the critic with new_critic")
    return CriticTokens(bins, tuple(int(vocab[name]) for name in names))


def new_critic(model_config, bins: JointBins, seed: int = 0, init_adapter=None):
    """A critic to train: `model_config.spec` with the K joint-bin tokens added and a LoRA adapter that trains the
    adapted matrices and those tokens' rows. -> (Policy, CriticTokens)"""
    from icrl_core.config import LoraAdapter
    from icrl_core.model import load_policy

    if not isinstance(model_config.adapter, LoraAdapter):
        raise UserError("the critic trains its added tokens through LoRA: model.adapter.kind="
                        f"{model_config.adapter.kind} is not supported; use lora")
    policy = load_policy(model_config.spec, model_config.dtype, model_config.adapter, cache_dir=model_config.cache_dir,
                         seed=seed, init_adapter=init_adapter, device=model_config.device,
                         added_tokens=bins.token_names(), right_padding_mask=model_config.right_padding_mask)
    return policy, critic_tokens(policy.tokenizer, bins)


CRITIC_FORMAT = 1
CRITIC_WEIGHTS = "critic.safetensors"
CRITIC_META = "critic.json"


def save_critic(folder, critic, tokens: CriticTokens, meta: dict | None = None):
    """The critic's trained weights (LoRA matrices and the added tokens' row deltas, by parameter name) and its
    description (spec, adapter shape, bins, token names) into `folder`, in one atomic rename."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from icrl_core.io import atomic_dir

    folder = Path(folder)
    bins = tokens.bins
    with atomic_dir(folder) as tmp:
        save_file(critic.trainable_state_dict(), str(tmp / CRITIC_WEIGHTS))
        description = {"format": CRITIC_FORMAT, "spec": critic.spec, "adapter": critic.adapter.model_dump(mode="json"),
                       "bins": {"reward_values": list(bins.reward_values), "length_edges": list(bins.length_edges),
                                "success_threshold": bins.success_threshold},
                       "token_names": bins.token_names(), "token_ids": list(tokens.ids), **(meta or {})}
        (tmp / CRITIC_META).write_text(json.dumps(description, indent=2, sort_keys=True, default=str) + "\n")
    return folder


def load_critic(folder, model_config):
    """A saved critic for scoring (eval mode, frozen): `model_config.spec` and dtype, the adapter shape and bins
    from the folder's critic.json. -> (Policy, CriticTokens)"""
    import json
    from pathlib import Path

    from pydantic import TypeAdapter

    from icrl_core.adapter_format import load_safetensors
    from icrl_core.config import Adapter
    from icrl_core.errors import CheckpointError
    from icrl_core.io import read_user_text

    folder = Path(folder)
    try:
        meta = json.loads(read_user_text(folder / CRITIC_META, "critic description", "run `icrl stage critic`"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{folder / CRITIC_META}: corrupt ({exc.msg})") from None
    if meta.get("format") != CRITIC_FORMAT:
        raise CheckpointError(f"{folder / CRITIC_META}: critic format {meta.get('format')}, expected {CRITIC_FORMAT}")
    if meta.get("spec") != model_config.spec:
        raise UserError(f"{folder}: the critic was trained on model.spec='{meta.get('spec')}', not "
                        f"'{model_config.spec}'")
    bins = JointBins.from_config(CriticBins(**meta["bins"]))
    adapter = TypeAdapter(Adapter).validate_python(meta["adapter"])
    critic, tokens = new_critic(model_config.model_copy(update={"adapter": adapter}), bins)
    if list(tokens.ids) != meta.get("token_ids"):
        raise CheckpointError(f"{folder}: critic token ids {meta.get('token_ids')[:2]}... differ from this "
                              f"tokenizer's {list(tokens.ids)[:2]}...")
    critic.load_trainable_state_dict(load_safetensors(folder / CRITIC_WEIGHTS), str(folder / CRITIC_WEIGHTS))
    for param in critic.model.parameters():
        param.requires_grad_(False)
    return critic.eval(), tokens


# --------------------------------------------------------------------------------------------------------------
# Packing: prompt + earlier trajectories with feedback + the target trajectory


@dataclass(frozen=True)
class Trajectory:
    """One sampled answer to a prompt (its tokens, end-of-turn included when it finished) and its reward."""

    token_ids: tuple[int, ...]
    reward: float

    @property
    def length(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class PromptGroup:
    """A prompt (chat-rendered token ids, ending with the assistant header) and trajectories sampled for it."""

    prompt_ids: tuple[int, ...]
    trajectories: tuple[Trajectory, ...]
    prompt_id: str = ""
    gold: str = ""  # the gold answer (exact match gives the reward)


@dataclass
class PackedContext:
    """One critic context. Per position: the joint bin to predict (NO_LABEL where none), whether the loss counts
    it, and the 1-based number of the trajectory the token belongs to (0: prompt or feedback)."""

    input_ids: list[int]
    labels: list[int]
    supervised: list[bool]
    trajectory: list[int]
    target_start: int  # position of the first token of the last (target) trajectory

    def __len__(self) -> int:
        return len(self.input_ids)


def feedback_text(template: str, trajectory: Trajectory) -> str:
    """The feedback line after an earlier trajectory, on a line of its own: '\\nReward: 1 / Length: 7\\n'."""
    return "\n" + template.format(reward=trajectory.reward, length=trajectory.length) + "\n"


def trajectory_labels(trajectory: Trajectory, bins: JointBins) -> list[int]:
    """k*_j = bin(r, |y| - 1 - j) for each token j of the trajectory: after reading token j, |y| - 1 - j tokens
    remain."""
    n = trajectory.length
    return [bins.index(trajectory.reward, n - 1 - j) for j in range(n)]


def pack_context(prompt_ids: Sequence[int], earlier: Sequence[Trajectory], target: Trajectory | Sequence[int],
                 bins: JointBins, encode: Callable[[str], Sequence[int]], feedback_template: str,
                 supervise_from: int) -> PackedContext:
    """prompt + (y_i + f_i for each earlier trajectory) + target.

    Every token of a trajectory with a known reward (the earlier ones; the target when it is a `Trajectory`) is
    labelled with k*(i, j) (`trajectory_labels`); a target given as bare token ids (a partial attempt, reward
    unknown) is not. `supervised` is True exactly on the labelled tokens of trajectories i >= supervise_from
    (1-based; the target is trajectory len(earlier) + 1). The feedback of trajectory i follows it, so by causality
    its own positions never see it."""
    ids, labels, supervised, number = list(prompt_ids), [NO_LABEL] * len(prompt_ids), [False] * len(prompt_ids), \
        [0] * len(prompt_ids)

    def emit(tokens: Sequence[int], token_labels: Sequence[int], which: int) -> None:
        ids.extend(tokens)
        labels.extend(token_labels)
        supervised.extend([which >= supervise_from and label != NO_LABEL for label in token_labels])
        number.extend([which] * len(tokens))

    for i, trajectory in enumerate(earlier, start=1):
        emit(trajectory.token_ids, trajectory_labels(trajectory, bins), i)
        feedback = list(encode(feedback_text(feedback_template, trajectory)))
        emit(feedback, [NO_LABEL] * len(feedback), 0)
    target_start = len(ids)
    if isinstance(target, Trajectory):
        emit(target.token_ids, trajectory_labels(target, bins), len(earlier) + 1)
    else:
        emit(list(target), [NO_LABEL] * len(target), len(earlier) + 1)
    return PackedContext(ids, labels, supervised, number, target_start)


def sample_context(group: PromptGroup, cfg: CriticConfig, bins: JointBins, encode: Callable[[str], Sequence[int]],
                   rng: np.random.Generator) -> PackedContext:
    """A training context of one prompt: `cfg.context_trajectories` of its trajectories in a random order (without
    replacement when it has enough), the last one the target."""
    n = len(group.trajectories)
    if n == 0:
        raise UserError(f"prompt {group.prompt_id!r} has no trajectories")
    k = cfg.context_trajectories
    order = rng.permutation(n)[:k] if n >= k else rng.integers(0, n, size=k)
    chosen = [group.trajectories[int(i)] for i in order]
    return pack_context(group.prompt_ids, chosen[:-1], chosen[-1], bins, encode, cfg.feedback_template,
                        cfg.supervise_from)


# --------------------------------------------------------------------------------------------------------------
# Trajectories sampled from the reference policy, and their columnar file


SPLITS = ("train", "val")  # the trajectories file's splits, in file order


@dataclass(frozen=True)
class GenerationBatch:
    """The `index`-th batch of one split's generation: consecutive jobs of its (prompt, sample) list, prompt-major
    (prompt 0's samples 0..n-1, then prompt 1's, ...; `generation_batches`), generated together (one KV cache).
    A prompt is a built episode (critic.data.source `episodes`) or a code task (`code`)."""

    split: str
    index: int
    prompts: tuple  # per job: its prompt (each prompt repeated once per sample)
    samples: tuple[int, ...]  # per job: its sample number within its prompt

    @property
    def order(self) -> tuple[int, int]:
        """Its place in the trajectories file: train batches first, then val, each in batch order."""
        return (SPLITS.index(self.split), self.index)


def generation_batches(prompts: Sequence, samples_per_prompt: int, batch_size: int,
                       split: str) -> list[GenerationBatch]:
    """The jobs (prompt p, sample s), prompt-major, cut into batches of `batch_size`: batch i holds jobs
    [i * batch_size, (i + 1) * batch_size). A batch is fixed by the prompts and these two numbers alone, so which
    process generates it changes nothing."""
    jobs = [(prompt, sample) for prompt in prompts for sample in range(samples_per_prompt)]
    return [GenerationBatch(split, index, tuple(p for p, _ in part), tuple(s for _, s in part))
            for index, part in enumerate(chunks(jobs, batch_size))]


def batch_generator(seed: int, split: str, index: int) -> torch.Generator:
    """The random draws of one generation batch, seeded by (seed, split, batch index) alone: a batch samples the
    same tokens whichever worker generates it and whatever that worker generated before (shard-invariant)."""
    key = np.random.default_rng([seed, SPLITS.index(split), index]).integers(2**62)
    return torch.Generator().manual_seed(int(key))


def trajectory_row(prompt_id: str, split: str, sample: int, rollout, reward: float, success: bool,
                   gold: str) -> dict:
    """One row of the trajectories file (`TRAJECTORY_COLUMNS`) from a one-query rollout: the prompt as the policy
    saw it (its ids up to the answer), the answer's ids (end-of-turn included when it finished), its reward.
    `success` (exact match; every test passed) feeds the stage's metrics and is not written."""
    answer = rollout.answers[0]
    return {"prompt_id": prompt_id, "split": split, "sample": sample,
            "prompt_ids": rollout.input_ids[:answer.start], "trajectory_ids": list(answer.token_ids),
            "reward": float(reward), "length": len(answer.token_ids), "finished": bool(answer.finished),
            "answer": answer.text, "gold": gold, "success": bool(success)}


@torch.no_grad()
def sample_episode_batch(policy, batch: GenerationBatch, sampling, max_new_tokens: int, max_tokens: int,
                         seed: int) -> list[dict]:
    """Answers to the first query of each job's episode (its exemplars in context, as the harness renders them),
    generated together by the token-mode rollout (icrl_core/rollout.py) with `batch_generator(seed, split,
    index)`, rewarded by exact match with the gold answer (reward 1 or 0). -> one row per job, in job order."""
    from icrl_core.rollout import generate_rollouts

    episodes = [episode.model_copy(update={"queries": episode.queries[:1]}) for episode in batch.prompts]
    rollouts = generate_rollouts(policy, episodes, sampling, max_new_tokens, max_tokens,
                                 batch_generator(seed, batch.split, batch.index))
    return [trajectory_row(episode.episode_id, batch.split, sample, rollout, rollout.answers[0].task_reward,
                           rollout.answers[0].task_reward == 1.0, episode.queries[0].preferred_answer)
            for episode, sample, rollout in zip(episodes, batch.samples, rollouts, strict=True)]


TRAJECTORY_COLUMNS = ("prompt_id", "split", "sample", "prompt_ids", "trajectory_ids", "reward", "length", "finished",
                      "answer", "gold")


def trajectory_table_bytes(rows: Sequence[dict]) -> bytes:
    """The trajectories as a zstd-compressed Parquet file, in memory (the caller writes it atomically); keys of a
    row other than `TRAJECTORY_COLUMNS` are not written."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([("prompt_id", pa.string()), ("split", pa.string()), ("sample", pa.int32()),
                        ("prompt_ids", pa.list_(pa.int32())), ("trajectory_ids", pa.list_(pa.int32())),
                        ("reward", pa.float64()), ("length", pa.int32()), ("finished", pa.bool_()),
                        ("answer", pa.string()), ("gold", pa.string())])
    sink = io.BytesIO()
    columns = [{name: row[name] for name in TRAJECTORY_COLUMNS} for row in rows]
    pq.write_table(pa.Table.from_pylist(columns, schema=schema), sink, compression="zstd")
    return sink.getvalue()


def read_trajectory_groups(path) -> dict[str, list[PromptGroup]]:
    """The trajectories file as prompt groups per split (prompts in file order, samples in sample order)."""
    import io

    import pyarrow.parquet as pq

    from icrl_core.io import read_user_bytes

    table = pq.read_table(io.BytesIO(read_user_bytes(path, "trajectories file", "run `icrl stage critic_data`")))
    groups: dict[tuple[str, str], tuple[tuple[int, ...], list[tuple[int, Trajectory]]]] = {}
    for row in table.to_pylist():
        key = (row["split"], row["prompt_id"])
        entry = groups.setdefault(key, (tuple(row["prompt_ids"]), row["gold"], []))
        entry[2].append((row["sample"], Trajectory(tuple(row["trajectory_ids"]), float(row["reward"]))))
    out: dict[str, list[PromptGroup]] = {}
    for (split, prompt_id), (prompt_ids, gold, samples) in groups.items():
        trajectories = tuple(t for _, t in sorted(samples, key=lambda item: item[0]))
        out.setdefault(split, []).append(PromptGroup(prompt_ids, trajectories, prompt_id, gold))
    return out


# --------------------------------------------------------------------------------------------------------------
# The critic's predictions and loss


@dataclass
class CriticBatch:
    """Right-padded contexts. Shapes (B, T)."""

    input_ids: torch.Tensor  # long
    attention_mask: torch.Tensor  # long
    labels: torch.Tensor  # long, joint bin or NO_LABEL
    supervised: torch.Tensor  # bool

    @property
    def n_labels(self) -> int:
        return int(self.supervised.sum())


def pad_contexts(contexts: Sequence[PackedContext], pad_id: int) -> CriticBatch:
    ids, attention = pad_sequences([c.input_ids for c in contexts], pad_id)
    labels = torch.full_like(ids, NO_LABEL)
    supervised = torch.zeros_like(ids, dtype=torch.bool)
    for row, context in enumerate(contexts):
        labels[row, :len(context)] = torch.tensor(context.labels, dtype=torch.long)
        supervised[row, :len(context)] = torch.tensor(context.supervised, dtype=torch.bool)
    return CriticBatch(ids, attention, labels, supervised)


def joint_bin_logits(critic, tokens: CriticTokens, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     at: torch.Tensor, **cache) -> torch.Tensor:
    """z[joint token ids] at the selected positions: the LM head's logits of the K added tokens after reading each
    selected position. input_ids, attention_mask, at: (B, T); `cache`: past_key_values and positions of a KV
    cache the input continues. -> (N, K) float32, N = at.sum()."""
    logits, _, _ = critic.forward(input_ids, attention_mask, logits_at=at, **cache)  # (N, V + K)
    return logits[:, list(tokens.ids)]


def critic_loss(bin_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """L_n = -log softmax(z_n)[k*_n]. bin_logits: (N, K); targets: (N,) joint bins. -> (N,)"""
    return F.cross_entropy(bin_logits.float(), targets, reduction="none")


def joint_probabilities(bin_logits: torch.Tensor, bins: JointBins) -> torch.Tensor:
    """P(r, l) = softmax(z)_(r L + l). (N, K) -> (N, R, L)."""
    return torch.softmax(bin_logits.float(), dim=-1).reshape(-1, bins.n_reward, bins.n_length)


def success_probability(bin_logits: torch.Tensor, bins: JointBins) -> torch.Tensor:
    """P(success) = sum_(r: value_r >= threshold) sum_l P(r, l). (N, K) -> (N,)"""
    p_reward = joint_probabilities(bin_logits, bins).sum(dim=-1)  # (N, R)
    return (p_reward * bins.success_bins().to(p_reward.device)).sum(dim=-1)


def expected_reward(bin_logits: torch.Tensor, bins: JointBins) -> torch.Tensor:
    """E[r] = sum_r value_r sum_l P(r, l). (N, K) -> (N,)"""
    p_reward = joint_probabilities(bin_logits, bins).sum(dim=-1)  # (N, R)
    return p_reward @ bins.reward_of_bins().to(p_reward.device)


def critic_values(bin_logits: torch.Tensor, bins: JointBins, kind: str = "expected_reward") -> torch.Tensor:
    """The critic's scalar reading (critic.q.value): E[r] or P(success). (N, K) -> (N,)"""
    return expected_reward(bin_logits, bins) if kind == "expected_reward" else success_probability(bin_logits, bins)


def critic_micro_step(critic, tokens: CriticTokens, batch: CriticBatch, n_labels: int, scale: float = 1.0,
                      backward: bool = True) -> dict[str, float]:
    """Backpropagate scale * sum_n L_n / n_labels over this micro-batch's supervised positions (n_labels: those
    of the whole step, so micro-batches add up to the mean). Returns the loss and the bin accuracy (argmax = k*)
    as sums / n_labels (times scale)."""
    at = batch.supervised
    bin_logits = joint_bin_logits(critic, tokens, batch.input_ids, batch.attention_mask, at)  # (N, K)
    targets = batch.labels[at].to(bin_logits.device)
    losses = critic_loss(bin_logits, targets)
    loss = losses.sum() / max(n_labels, 1) * scale
    if backward:
        loss.backward()
    correct = (bin_logits.detach().argmax(-1) == targets).float().sum()
    return {"loss": float(loss.detach()), "bin_accuracy": float(correct) / max(n_labels, 1) * scale}


# --------------------------------------------------------------------------------------------------------------
# Metrics of predicted success: AUC, its confidence interval, calibration


def roc_auc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """AUC = P(score of a success > score of a failure) + 1/2 P(equal) (Mann-Whitney U / (n_pos n_neg), ties by
    average rank). NaN when one class is missing."""
    scores, labels = np.asarray(scores, dtype=float), np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(labels.sum()), int((~labels).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average rank over each run of equal scores
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def auc_interval(scores: Sequence[float], labels: Sequence[int], groups: Sequence | None = None,
                 resamples: int = 1000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of `roc_auc`, resampling whole groups (prompts: trajectories of one prompt
    are not independent) or single items when `groups` is None."""
    scores, labels = np.asarray(scores, dtype=float), np.asarray(labels, dtype=int)
    keys = np.arange(len(scores)) if groups is None else np.asarray(groups)
    members = [np.flatnonzero(keys == key) for key in dict.fromkeys(keys.tolist())]
    rng = np.random.default_rng(seed)
    values = []
    for _ in range(resamples):
        take = np.concatenate([members[i] for i in rng.integers(0, len(members), size=len(members))])
        value = roc_auc(scores[take], labels[take])
        if not math.isnan(value):
            values.append(value)
    if not values:
        return float("nan"), float("nan")
    alpha = (1 - level) / 2
    return float(np.quantile(values, alpha)), float(np.quantile(values, 1 - alpha))


def expected_calibration_error(probs: Sequence[float], labels: Sequence[int], n_bins: int = 10) -> float:
    """ECE = sum_b (n_b / n) |mean label in b - mean prob in b| over equal-width probability bins."""
    probs, labels = np.asarray(probs, dtype=float), np.asarray(labels, dtype=float)
    if len(probs) == 0:
        return float("nan")
    which = np.minimum((probs * n_bins).astype(int), n_bins - 1)
    total = 0.0
    for b in range(n_bins):
        inside = which == b
        if inside.any():
            total += inside.sum() / len(probs) * abs(labels[inside].mean() - probs[inside].mean())
    return float(total)


@torch.no_grad()
def evaluate_critic(critic, tokens: CriticTokens, contexts: Sequence[PackedContext], batch_size: int,
                    prompt_keys: Sequence | None = None) -> dict[str, float]:
    """On held-out contexts: token-mean critic loss and bin accuracy over the supervised positions, and, for each
    supervised trajectory, P(success) at its first and last token against its success: val_auc (last token: a
    finished attempt) with its 95% bootstrap interval over prompts (`prompt_keys`: each context's prompt),
    val_auc_first_token (after one token), val_ece and val_brier (last token). Every rank scores all contexts
    (evaluation is small)."""
    critic.eval()
    bins = tokens.bins
    success = bins.success_bins()
    loss_sum, correct, n_labels = 0.0, 0.0, 0
    first_p, last_p, outcome, keys = [], [], [], []
    for start in range(0, len(contexts), batch_size):
        part = contexts[start:start + batch_size]
        batch = pad_contexts(part, critic.tokenizer.pad_token_id)
        bin_logits = joint_bin_logits(critic, tokens, batch.input_ids, batch.attention_mask, batch.supervised)
        targets = batch.labels[batch.supervised].to(bin_logits.device)
        loss_sum += float(critic_loss(bin_logits, targets).sum())
        correct += float((bin_logits.argmax(-1) == targets).sum())
        n_labels += len(targets)
        p_success = success_probability(bin_logits, bins).cpu().tolist()  # (N,) in row-major position order
        n = 0
        for offset, context in enumerate(part):
            spans: dict[int, list[int]] = {}  # trajectory number -> its supervised entries of p_success
            for number, supervised in zip(context.trajectory, context.supervised):
                if supervised:
                    spans.setdefault(number, []).append(n)
                    n += 1
            for entries in spans.values():
                r, _ = bins.split(int(targets[entries[-1]]))
                first_p.append(p_success[entries[0]])
                last_p.append(p_success[entries[-1]])
                outcome.append(int(success[r]))
                keys.append(prompt_keys[start + offset] if prompt_keys is not None else start + offset)
    nan = float("nan")
    metrics = {"val_loss": loss_sum / n_labels if n_labels else nan,
               "val_bin_accuracy": correct / n_labels if n_labels else nan,
               "val_auc": roc_auc(last_p, outcome), "val_auc_first_token": roc_auc(first_p, outcome),
               "val_ece": expected_calibration_error(last_p, outcome),
               "val_brier": float(np.mean((np.asarray(last_p) - np.asarray(outcome)) ** 2)) if outcome else nan,
               "val_success_rate": float(np.mean(outcome)) if outcome else nan,
               "val_trajectories": float(len(outcome))}
    metrics["val_auc_low"], metrics["val_auc_high"] = auc_interval(last_p, outcome, keys)
    return metrics


def train_critic(critic, tokens: CriticTokens, train_groups: Sequence[PromptGroup],
                 val_contexts: Sequence[PackedContext], cfg: CriticConfig, encode: Callable[[str], Sequence[int]],
                 seed: int, runtime, val_keys: Sequence | None = None) -> tuple[dict, list[dict]]:
    """The critic (config `critic`) on the shared loop (icrl_core/training_loop.py): each step packs one context
    for each of `batch_size * grad_accum` prompts (drawn by `supervised.batch_indices`, the trajectories' order by
    (seed, step, slot): a pure function of (seed, step), so a resumed run reads the same contexts), AdamW on the
    LoRA matrices and the added tokens' rows, loss `critic_loss` averaged over the step's supervised positions,
    gradient clipping, the warm-up schedule; `evaluate_critic` on `val_contexts` every eval_steps and before the
    first step. Returns (last step's metrics, every step's metrics)."""
    from icrl_core.supervised import _check_world, apply_update, batch_indices, make_scheduler
    from icrl_core.training_loop import Schedule, Trainer, run_loop

    params = critic.trainable_parameters()
    if not params:
        raise UserError("the critic has nothing to train; use model.adapter.kind=lora")
    if not train_groups:
        raise UserError("the critic has no training prompts: generate trajectories first (critic_data stage)")
    optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    scheduler = make_scheduler(optimizer, cfg.warmup_steps, cfg.max_steps, cfg.lr_schedule)
    bins = tokens.bins
    val_contexts = list(val_contexts)[: cfg.max_eval_contexts]
    global_batch = cfg.batch_size * cfg.grad_accum
    world = _check_world(global_batch)
    pad = critic.tokenizer.pad_token_id

    def step(number: int) -> dict[str, float]:
        began = time.perf_counter()
        critic.train()
        drawn = batch_indices(len(train_groups), seed, number - 1, global_batch)
        contexts = [sample_context(train_groups[i], cfg, bins, encode, np.random.default_rng([seed, number, slot]))
                    for slot, i in enumerate(drawn)]
        n_labels = sum(sum(c.supervised) for c in contexts)
        optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"tokens": 0.0}
        for part in chunks(distributed.shard(contexts), cfg.batch_size):
            out = critic_micro_step(critic, tokens, pad_contexts(part, pad), n_labels, scale=world)
            for key, value in out.items():  # scaled by W: their mean over ranks is the global value
                sums[key] = sums.get(key, 0.0) + value
            sums["tokens"] += sum(len(c) for c in part)
        metrics = apply_update(params, optimizer, scheduler, cfg.max_grad_norm, sums, world, began)
        metrics["labels"] = float(n_labels)
        return metrics

    def evaluate() -> dict[str, float]:
        return evaluate_critic(critic, tokens, val_contexts, cfg.batch_size, val_keys)

    trainer = Trainer(step, optimizer, scheduler, params, critic.trainable_state_dict,
                      lambda tensors: critic.load_trainable_state_dict(tensors, "checkpoint"),
                      evaluate if val_contexts else None)
    result = run_loop(trainer, Schedule(cfg.max_steps, cfg.eval_steps, cfg.save_steps, evaluate_first=True), runtime)
    metrics = dict(result.last)
    if result.evals:
        metrics["val_auc_before"] = result.evals[0].get("val_auc", float("nan"))
    return metrics, result.history


# --------------------------------------------------------------------------------------------------------------
# Q-weighted sampling over min-p candidates, and its distillation


def min_p_candidates(ref_logits: torch.Tensor, min_p: float, max_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """C(s) = the at most `max_candidates` most probable tokens a with pi_ref(a|s) >= min_p * max_a' pi_ref(a'|s),
    in decreasing probability. ref_logits: (B, V). -> (candidate ids (B, C), mask (B, C) bool), C = min(max, V)."""
    probs = torch.softmax(ref_logits.float(), dim=-1)
    top = probs.topk(min(max_candidates, probs.shape[-1]), dim=-1)
    mask = top.values >= min_p * top.values[:, :1]
    return top.indices, mask


def q_weighted_logprobs(ref_logprobs: torch.Tensor, q: torch.Tensor, mask: torch.Tensor, tau: float) -> torch.Tensor:
    """log pi_new(a|s) = log pi_ref(a|s) + Q(s, a) / tau - log sum_(a' in C) pi_ref(a'|s) exp(Q(s, a') / tau).

    ref_logprobs: (B, C) log pi_ref over the whole vocabulary, gathered at the candidates; q: (B, C); mask: (B, C)
    the real candidates. -> (B, C), -inf at padding."""
    scores = ref_logprobs.float() + q.float() / tau
    return torch.log_softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


def sample_candidates(log_probs: torch.Tensor, candidate_ids: torch.Tensor,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """a ~ pi over the candidates. log_probs, candidate_ids: (B, C). -> (B,) token ids."""
    choice = torch.multinomial(log_probs.exp(), 1, generator=generator)  # (B, 1)
    return candidate_ids.gather(-1, choice).squeeze(-1)


def reverse_kl_loss(policy_logits: torch.Tensor, target_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """KL(pi_theta || pi_new) over the candidates, pi_theta renormalised over them:

        log pi_theta(a) = z_a - log sum_(a' in C) exp z_a'
        KL              = sum_(a in C) pi_theta(a) (log pi_theta(a) - log pi_new(a))

    Mode-seeking: it is large where the policy puts mass the target does not. policy_logits: (B, C) the policy's
    logits at the candidates; target_logprobs: (B, C) log pi_new; mask: (B, C). -> (B,)"""
    log_theta = torch.log_softmax(policy_logits.float().masked_fill(~mask, float("-inf")), dim=-1)
    # padding would give 0 * (-inf - -inf) = NaN, in the gradient too: take the real entries before the product
    log_theta = torch.where(mask, log_theta, torch.zeros_like(log_theta))
    log_target = torch.where(mask, target_logprobs.float(), torch.zeros_like(log_theta))
    return (torch.where(mask, log_theta.exp(), torch.zeros_like(log_theta)) * (log_theta - log_target)).sum(dim=-1)


@torch.no_grad()
def candidate_q_values(critic, tokens: CriticTokens, context_ids: Sequence[int], candidate_ids: Sequence[int],
                       kind: str = "expected_reward") -> torch.Tensor:
    """Q(s, a) for each candidate a: the critic's reading (`critic_values`) after context + a. The context is read
    once into a KV cache, which is then repeated for the C candidates, each read as one more token (cost L + C
    tokens instead of C (L + 1)). -> (C,) float32"""
    from transformers import DynamicCache

    critic.eval()
    context = torch.tensor([list(context_ids)], dtype=torch.long)
    n = len(candidate_ids)
    cache = DynamicCache()
    critic.forward(context, torch.ones_like(context), logits_at=torch.zeros_like(context, dtype=torch.bool),
                   past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(n)
    candidates = torch.tensor([[int(a)] for a in candidate_ids], dtype=torch.long)  # (C, 1)
    bin_logits = joint_bin_logits(critic, tokens, candidates, torch.ones(n, context.shape[1] + 1, dtype=torch.long),
                                  torch.ones_like(candidates, dtype=torch.bool), past_key_values=cache, use_cache=True,
                                  position_ids=torch.full((n, 1), context.shape[1], dtype=torch.long))
    return critic_values(bin_logits, tokens.bins, kind).cpu()


@dataclass
class QStep:
    """One decision of a Q-labelled trajectory: at the state before token `position`, the reference's candidates,
    their log pi_ref and Q, the Q-weighted log pi_new, and the token taken with its Q."""

    position: int
    candidate_ids: list[int]
    ref_logprobs: list[float]
    q: list[float]
    new_logprobs: list[float]
    token: int
    token_q: float


@torch.no_grad()
def q_weighted_decode(reference, critic, tokens: CriticTokens, prompt_ids: Sequence[int],
                      critic_prefix_ids: Sequence[int], q_cfg: QSampling, max_new_tokens: int,
                      stop_ids: Sequence[int] = (), trajectory: Sequence[int] | None = None,
                      generator: torch.Generator | None = None, weighted: bool = True) -> list[QStep]:
    """Q-label a trajectory token by token. At each state s_t (prompt + y[:t] for the policy, critic_prefix + y[:t]
    for the critic: the prompt and earlier attempts with their feedback, `pack_context` with an empty target):
    min-p candidates of pi_ref(.|s_t) (`reference` is a policy: wrap the call in `policy.reference()` to use a
    trained policy's base), Q(s_t, a) for each, log pi_new; the next token is sampled from pi_new (Q-weighted
    sampling) or, given `trajectory`, taken from it (labelling an existing trajectory; its Q is computed even when
    min-p dropped it). Stops after a token of `stop_ids` or max_new_tokens. `weighted=False` is the control: Q = 0
    for every candidate (no critic pass), so pi_new is pi_ref renormalised over the min-p candidates."""
    reference.eval()
    critic.eval()
    generated: list[int] = []
    steps: list[QStep] = []
    limit = len(trajectory) if trajectory is not None else max_new_tokens
    for t in range(limit):
        state = torch.tensor([list(prompt_ids) + generated], dtype=torch.long)
        at = torch.zeros_like(state, dtype=torch.bool)
        at[0, -1] = True
        ref_logits, _, _ = reference.forward(state, torch.ones_like(state), logits_at=at)  # (1, V)
        # the critic's own tokens are outputs of the critic, never actions (pi_ref may be the critic's base)
        ref_logits[:, [i for i in tokens.ids if i < ref_logits.shape[-1]]] = float("-inf")
        candidates, mask = min_p_candidates(ref_logits, q_cfg.min_p, q_cfg.max_candidates)
        candidates, mask = candidates[mask].unsqueeze(0), mask[mask].unsqueeze(0)  # (1, C) real ones only
        ref_logprobs = torch.log_softmax(ref_logits.float(), dim=-1).gather(-1, candidates)
        scored = candidates[0].tolist()
        if trajectory is not None and trajectory[t] not in scored:
            scored = scored + [int(trajectory[t])]
        q_all = (candidate_q_values(critic, tokens, list(critic_prefix_ids) + generated, scored, q_cfg.value)
                 if weighted else torch.zeros(len(scored)))
        q = q_all[: candidates.shape[1]].unsqueeze(0)
        new_logprobs = q_weighted_logprobs(ref_logprobs, q, mask, q_cfg.tau)
        if trajectory is not None:
            token = int(trajectory[t])
        else:
            token = int(sample_candidates(new_logprobs, candidates, generator)[0])
        steps.append(QStep(t, scored[: candidates.shape[1]], ref_logprobs[0].tolist(), q[0].tolist(),
                           new_logprobs[0].tolist(), token, float(q_all[scored.index(token)])))
        generated.append(token)
        if token in stop_ids:
            break
    return steps


class ReferenceView:
    """A policy seen through `policy.reference()` (adapters off) for every forward pass: pi_ref for
    `q_weighted_decode` when the critic's own base weights are the reference, with no second model in memory."""

    def __init__(self, policy):
        self.policy = policy

    def eval(self):
        self.policy.eval()
        return self

    def forward(self, *args, **kwargs):
        with self.policy.reference():
            return self.policy.forward(*args, **kwargs)


def q_sampling_metrics(critic, tokens: CriticTokens, groups: Sequence[PromptGroup], cfg: CriticConfig,
                       encode: Callable[[str], Sequence[int]], answer_of: Callable[[Sequence[int]], str],
                       max_new_tokens: int, stop_ids: Sequence[int], seed: int) -> dict[str, float]:
    """Q-weighted vs plain sampling at the same number of samples on held-out prompts: `cfg.q.eval_samples`
    trajectories of pi_new (`q_weighted_decode`, pi_ref = the critic's base weights, the critic reading the
    prompt's first K - 1 trajectories and their feedback) against as many of the prompt's plain samples (the
    candidates of `candidate_contexts`), both rewarded by exact match of the answer (`answer_of`: token ids ->
    answer text) with the gold answer. A third arm separates the critic from the candidate filter: as many
    samples of pi_ref renormalised over the same min-p candidates, Q weights off (`min_p_sampling_reward`).
    Differences are paired by prompt, with 95% percentile bootstrap intervals over prompts (`*_low`, `*_high`).
    Prompts with fewer plain candidates than samples are skipped, and so are prompts without a gold answer (code
    tasks: their reward needs the sandbox, not exact match); with none left the rewards are NaN."""
    from icrl_core.rollout import exact_match

    n = cfg.q.eval_samples
    arms: dict[str, list[float]] = {"q_weighted": [], "min_p": [], "plain": []}  # per-prompt mean rewards
    reference = ReferenceView(critic)
    for index, group in enumerate(groups):
        earlier = list(group.trajectories[: cfg.context_trajectories - 1])
        plain = list(group.trajectories[cfg.context_trajectories - 1:])[:n]
        if len(plain) < n or not group.gold:
            continue
        prefix = pack_context(group.prompt_ids, earlier, [], tokens.bins, encode, cfg.feedback_template,
                              cfg.supervise_from).input_ids
        for arm, weighted in (("q_weighted", True), ("min_p", False)):
            generator = torch.Generator().manual_seed(seed * 100_003 + index)  # the same draws for both arms
            rewards = []
            for _ in range(n):
                steps = q_weighted_decode(reference, critic, tokens, group.prompt_ids, prefix, cfg.q,
                                          max_new_tokens, stop_ids, generator=generator, weighted=weighted)
                rewards.append(exact_match(answer_of([s.token for s in steps]), group.gold))
            arms[arm].append(float(np.mean(rewards)))
        arms["plain"].append(float(np.mean([t.reward for t in plain])))
    nan = float("nan")
    names = {"q_weighted": "q_weighted_reward", "min_p": "min_p_sampling_reward", "plain": "plain_sampling_reward"}
    metrics = {names[arm]: float(np.mean(v)) if v else nan for arm, v in arms.items()}
    for other in ("plain", "min_p"):
        diff = np.asarray(arms["q_weighted"]) - np.asarray(arms[other])
        low, high = mean_interval(diff, seed=seed)
        metrics |= {f"q_minus_{other}": float(diff.mean()) if len(diff) else nan,
                    f"q_minus_{other}_low": low, f"q_minus_{other}_high": high}
    return metrics | {"q_sampling_prompts": float(len(arms["plain"])), "q_samples_per_prompt": float(n)}


def mean_interval(values: Sequence[float], resamples: int = 2000, level: float = 0.95,
                  seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` (one value per prompt)."""
    values = np.asarray(values, dtype=float)
    if len(values) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def q_distillation_loss(policy, prompt_ids: Sequence[int], steps: Sequence[QStep]) -> torch.Tensor:
    """Mean over the trajectory's states of KL(pi_theta(.|s_t) || pi_new(.|s_t)) (`reverse_kl_loss`), pi_theta from
    one forward pass over prompt + trajectory, read at the token before each position. -> scalar with gradients"""
    sequence = list(prompt_ids) + [s.token for s in steps]
    ids = torch.tensor([sequence], dtype=torch.long)
    at = torch.zeros_like(ids, dtype=torch.bool)
    at[0, [len(prompt_ids) - 1 + s.position for s in steps]] = True
    logits, _, _ = policy.forward(ids, torch.ones_like(ids), logits_at=at)  # (S, V)
    width = max(len(s.candidate_ids) for s in steps)
    candidate_ids = torch.zeros(len(steps), width, dtype=torch.long)
    target = torch.zeros(len(steps), width)
    mask = torch.zeros(len(steps), width, dtype=torch.bool)
    for row, s in enumerate(steps):
        n = len(s.candidate_ids)
        candidate_ids[row, :n] = torch.tensor(s.candidate_ids)
        target[row, :n] = torch.tensor(s.new_logprobs)
        mask[row, :n] = True
    policy_logits = logits.float().gather(-1, candidate_ids.to(logits.device))
    return reverse_kl_loss(policy_logits, target.to(logits.device), mask.to(logits.device)).mean()


@torch.no_grad()
def sample_answers(policy, prompt_ids: Sequence[int], n: int, max_new_tokens: int, stop_ids: Sequence[int],
                   generator: torch.Generator | None, temperature: float = 1.0) -> list[list[int]]:
    """n answers to one prompt sampled from the policy at `temperature` in one KV cache (rollout.BatchedCache);
    each ends at its first stop token or after max_new_tokens."""
    from icrl_core.rollout import BatchedCache, Sampling, mixture_sample

    policy.eval()
    cache = BatchedCache(policy, n)
    logits = cache.feed([list(prompt_ids)] * n)
    answers: list[list[int]] = [[] for _ in range(n)]
    live = list(range(n))
    for _ in range(max_new_tokens):
        drawn, _, _ = mixture_sample(logits, Sampling(temperature=temperature), generator)
        for row, token in zip(live, drawn.tolist()):
            answers[row].append(int(token))
        live = [row for row in live if answers[row][-1] not in stop_ids]
        if not live:
            break
        logits = cache.feed([[answers[row][-1]] if row in live else [] for row in range(n)])
    return answers


def rft_loss(policy, prompt_ids: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> torch.Tensor:
    """Rejection fine-tuning: L = token mean over the answers of -log pi_theta(y_t | x, y_<t), one padded batch."""
    from icrl_core.supervised import masked_token_cross_entropy

    sequences = [list(x) + list(y) for x, y in zip(prompt_ids, answers, strict=True)]
    ids, attention = pad_sequences(sequences, policy.tokenizer.pad_token_id)
    predict_at = torch.zeros_like(ids, dtype=torch.bool)  # positions whose next token is an answer token
    for row, (x, y) in enumerate(zip(prompt_ids, answers)):
        predict_at[row, len(x) - 1: len(x) + len(y) - 1] = True
    logits, _, _ = policy.forward(ids, attention, logits_at=predict_at)
    targets = ids[:, 1:][predict_at[:, :-1]].to(logits.device)
    return masked_token_cross_entropy(logits, targets).mean()


def train_distilled_policy(policy, critic, tokens: CriticTokens, train_groups: Sequence[PromptGroup],
                           val_groups: Sequence[PromptGroup], cfg: CriticConfig, dcfg: CriticDistillConfig,
                           encode: Callable[[str], Sequence[int]],
                           answer_of: Callable[[Sequence[int]], str], stop_ids: Sequence[int], seed: int,
                           runtime) -> tuple[dict, list[dict]]:
    """The policy trained by `dcfg.method` (config `critic_distill`) on the shared loop, with the critic's
    settings `cfg` (Q sampling, context, trajectory length). Each step draws `batch_size * grad_accum`
    train prompts (`supervised.batch_indices`):

        reverse_kl   one trajectory per prompt from pi_new (`q_weighted_decode`, pi_ref = the policy's base
                     weights, the critic reading the prompt's first K - 1 critic_data trajectories and their
                     feedback; draws seeded by (seed, step, slot)), L = mean over them of `q_distillation_loss`
        rft          one successful critic_data trajectory per prompt (prompts without one are skipped when the
                     train prompts are indexed), L = `rft_loss`

    Evaluation (before the first step and every eval_steps): `dcfg.eval_samples` answers per held-out prompt
    from the policy (temperature 1, seeded), val_reward = their mean exact-match reward. Both exact-match
    measurements (val_reward, and reverse_kl's sampled_reward) cover only prompts with a gold answer: code tasks
    have none (NaN when no prompt has one). Single process: the step does not shard prompts over data-parallel
    workers."""
    from icrl_core.rollout import exact_match
    from icrl_core.supervised import apply_update, batch_indices, make_scheduler
    from icrl_core.training_loop import Schedule, Trainer, run_loop

    if distributed.world_size() > 1:
        raise UserError("critic_distill runs in one process: set ray.num_workers=1")
    params = policy.trainable_parameters()
    if not params:
        raise UserError("model.adapter.kind=none leaves nothing to train; use lora or last_blocks")
    threshold = tokens.bins.success_threshold
    if dcfg.method == "rft":
        items = [(g.prompt_ids, t.token_ids) for g in train_groups for t in successful_trajectories(g, threshold)]
    else:
        items = [(g.prompt_ids, g) for g in train_groups if len(g.trajectories) >= cfg.context_trajectories - 1]
    if not items:
        raise UserError(f"critic_distill ({dcfg.method}) has no training data: "
                        + ("no trajectory succeeded" if dcfg.method == "rft" else "no train prompts"))
    optimizer = torch.optim.AdamW(params, lr=dcfg.learning_rate, weight_decay=dcfg.weight_decay)
    scheduler = make_scheduler(optimizer, dcfg.warmup_steps, dcfg.max_steps, dcfg.lr_schedule)
    global_batch = dcfg.batch_size * dcfg.grad_accum
    reference = ReferenceView(policy)
    max_new_tokens = cfg.data.max_new_tokens

    def step(number: int) -> dict[str, float]:
        began = time.perf_counter()
        drawn = [items[i] for i in batch_indices(len(items), seed, number - 1, global_batch)]
        optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {"tokens": 0.0, "loss": 0.0}
        if dcfg.method == "rft":
            policy.train()
            for part in chunks(drawn, dcfg.batch_size):
                loss = rft_loss(policy, [x for x, _ in part], [y for _, y in part]) * len(part) / len(drawn)
                loss.backward()
                sums["loss"] += float(loss.detach())
                sums["tokens"] += sum(len(x) + len(y) for x, y in part)
        else:
            q_values, sampled_rewards = [], []
            for slot, (prompt_ids, group) in enumerate(drawn):
                prefix = pack_context(prompt_ids, list(group.trajectories[: cfg.context_trajectories - 1]), [],
                                      tokens.bins, encode, cfg.feedback_template, cfg.supervise_from).input_ids
                generator = torch.Generator().manual_seed(int(np.random.default_rng([seed, number, slot])
                                                              .integers(2**62)))
                steps = q_weighted_decode(reference, critic, tokens, prompt_ids, prefix, cfg.q, max_new_tokens,
                                          stop_ids, generator=generator)
                policy.train()
                loss = q_distillation_loss(policy, prompt_ids, steps) / len(drawn)
                loss.backward()
                sums["loss"] += float(loss.detach())
                sums["tokens"] += len(prompt_ids) + len(steps)
                if group.gold:  # exact match needs a gold answer (code tasks have none)
                    sampled_rewards.append(exact_match(answer_of([s.token for s in steps]), group.gold))
                q_values += [s.token_q for s in steps]
            sums["sampled_reward"] = float(np.mean(sampled_rewards)) if sampled_rewards else float("nan")
            sums["token_q"] = float(np.mean(q_values)) if q_values else float("nan")
        return apply_update(params, optimizer, scheduler, dcfg.max_grad_norm, sums, 1, began)

    def evaluate() -> dict[str, float]:
        rewards = []
        for index, group in enumerate(val_groups):
            if not group.gold:  # exact match needs a gold answer (code tasks have none)
                continue
            generator = torch.Generator().manual_seed(seed * 100_003 + index)
            for answer in sample_answers(policy, group.prompt_ids, dcfg.eval_samples, max_new_tokens, stop_ids,
                                         generator):
                rewards.append(exact_match(answer_of(answer), group.gold))
        return {"val_reward": float(np.mean(rewards)) if rewards else float("nan"), "val_samples": float(len(rewards))}

    trainer = Trainer(step, optimizer, scheduler, params, policy.trainable_state_dict,
                      lambda tensors: policy.load_trainable_state_dict(tensors, "checkpoint"),
                      evaluate if val_groups and dcfg.eval_samples else None)
    result = run_loop(trainer, Schedule(dcfg.max_steps, dcfg.eval_steps, dcfg.save_steps, evaluate_first=True),
                      runtime)
    metrics = dict(result.last)
    if result.evals:
        metrics["val_reward_before"] = result.evals[0]["val_reward"]
    metrics["train_items"] = float(len(items))
    return metrics, result.history


# --------------------------------------------------------------------------------------------------------------
# Selection among n sampled trajectories; rejection fine-tuning's data


def best_of_n(scores: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """The reward of the trajectory the critic scores highest in each group (ties: the first). scores, rewards:
    (P, n). -> (P,)"""
    return rewards.gather(-1, scores.argmax(dim=-1, keepdim=True)).squeeze(-1)


def random_of_n(rewards: torch.Tensor) -> torch.Tensor:
    """The expected reward of a uniformly random pick in each group: the mean (exact, no draw). (P, n) -> (P,)"""
    return rewards.float().mean(dim=-1)


def majority_vote(answers: Sequence[str]) -> int:
    """Consistency: the index of the first answer of the most frequent kind (ties: the kind seen first)."""
    if not answers:
        raise ValueError("majority_vote of no answers")
    counts = Counter(answers)
    best = max(counts.values())
    return next(i for i, answer in enumerate(answers) if counts[answer] == best)


@torch.no_grad()
def target_values(critic, tokens: CriticTokens, contexts: Sequence[PackedContext], kind: str,
                  batch_size: int = 8) -> list[list[float]]:
    """The critic's reading (`critic_values`) at every token of each context's target trajectory: Q(s_t, a_t) of
    the tokens taken (the value after reading each). -> one list per context, one value per target token."""
    critic.eval()
    out: list[list[float]] = []
    for start in range(0, len(contexts), batch_size):
        part = contexts[start:start + batch_size]
        batch = pad_contexts(part, critic.tokenizer.pad_token_id)
        at = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
        for row, context in enumerate(part):
            at[row, context.target_start:len(context)] = True
        values = critic_values(joint_bin_logits(critic, tokens, batch.input_ids, batch.attention_mask, at),
                               tokens.bins, kind).cpu().tolist()
        for context in part:
            n = len(context) - context.target_start
            out.append(values[:n])
            values = values[n:]
    return out


def candidate_contexts(group: PromptGroup, cfg: CriticConfig, bins: JointBins,
                       encode: Callable[[str], Sequence[int]]) -> list[PackedContext]:
    """Best-of-n on a held-out prompt: its first K - 1 trajectories with their feedback as context, each remaining
    one a candidate read as an unlabelled target (the critic's regime: the K-th trajectory of a context)."""
    earlier = list(group.trajectories[: cfg.context_trajectories - 1])
    return [pack_context(group.prompt_ids, earlier, list(candidate.token_ids), bins, encode, cfg.feedback_template,
                         cfg.supervise_from) for candidate in group.trajectories[cfg.context_trajectories - 1:]]


def selection_metrics(critic, tokens: CriticTokens, groups: Sequence[PromptGroup], cfg: CriticConfig,
                      encode: Callable[[str], Sequence[int]], decode: Callable[[Sequence[int]], str]) -> dict:
    """Mean reward of one pick among the n candidates of each held-out prompt (`candidate_contexts`, n >= 2):
    best_of_n (the critic's highest value at the candidate's last token), random_of_n (uniform pick: the mean),
    consistency (majority vote over the decoded answers), oracle (the best candidate)."""
    picks: dict[str, list[float]] = {"best_of_n": [], "random_of_n": [], "consistency": [], "oracle": []}
    sizes = []
    for group in groups:
        candidates = list(group.trajectories[cfg.context_trajectories - 1:])
        if len(candidates) < 2:
            continue
        values = target_values(critic, tokens, candidate_contexts(group, cfg, tokens.bins, encode), cfg.q.value)
        scores = torch.tensor([[v[-1] for v in values]])
        rewards = torch.tensor([[c.reward for c in candidates]])
        picks["best_of_n"].append(float(best_of_n(scores, rewards)[0]))
        picks["random_of_n"].append(float(random_of_n(rewards)[0]))
        picks["consistency"].append(candidates[majority_vote([decode(c.token_ids) for c in candidates])].reward)
        picks["oracle"].append(float(rewards.max()))
        sizes.append(len(candidates))
    metrics = {f"{name}_reward": float(np.mean(v)) if v else float("nan") for name, v in picks.items()}
    metrics.update({"selection_prompts": float(len(sizes)), "candidates_per_prompt": float(np.mean(sizes)) if sizes
                    else float("nan")})
    return metrics


def successful_trajectories(group: PromptGroup, threshold: float) -> list[Trajectory]:
    """Rejection fine-tuning's data: the trajectories of a prompt whose reward reaches the threshold."""
    return [t for t in group.trajectories if t.reward >= threshold]


# --------------------------------------------------------------------------------------------------------------
# The HTML view


def q_colour(q: float, low: float, high: float) -> str:
    """Background of a token: red at `low`, white at the midpoint, green at `high` (clamped)."""
    x = 0.5 if high <= low else min(max((q - low) / (high - low), 0.0), 1.0)
    if x < 0.5:  # red -> white
        r, g, b = 255, int(255 * 2 * x + 110 * (1 - 2 * x)), int(255 * 2 * x + 110 * (1 - 2 * x))
    else:  # white -> green
        r, g, b = int(255 * (2 - 2 * x) + 90 * (2 * x - 1)), 255, int(255 * (2 - 2 * x) + 120 * (2 * x - 1))
    return f"#{r:02x}{g:02x}{b:02x}"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
h1 { font-size: 1.2em; } h2 { font-size: 1em; margin-top: 1.5em; }
.prompt { white-space: pre-wrap; color: #666; font-family: monospace; background: #eee; padding: .5em; }
.trajectory { white-space: pre-wrap; font-family: monospace; line-height: 1.8; background: #fff; padding: .5em;
              border: 1px solid #ddd; }
.tok { border-radius: 2px; padding: 1px 0; }
.legend span { display: inline-block; width: 3.5em; text-align: center; font-family: monospace; }
.meta { color: #555; font-size: .9em; }
summary { color: #666; font-size: .85em; cursor: pointer; margin: .3em 0; }
"""


def render_q_html(title: str, trajectories: Sequence[dict], low: float | None = None,
                  high: float | None = None) -> str:
    """A self-contained HTML page (inline CSS, no scripts or external resources) showing each trajectory's tokens
    coloured by their Q-value (hover: the value). Each trajectory is a dict with `pieces` (the decoded text of each
    token), `q` (one value per token), and optional `prompt` (shown folded), `heading`, `meta` (a short line under
    the heading).
    The colour scale spans [low, high] (default: the range of all values)."""
    values = [q for t in trajectories for q in t["q"] if q is not None and math.isfinite(q)]
    low = min(values, default=0.0) if low is None else low
    high = max(values, default=1.0) if high is None else high
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>", '<div class="legend">Q: ']
    for i in range(5):
        q = low + (high - low) * i / 4
        parts.append(f'<span style="background:{q_colour(q, low, high)}">{q:.2f}</span>')
    parts.append("</div>")
    for number, trajectory in enumerate(trajectories, start=1):
        if len(trajectory["pieces"]) != len(trajectory["q"]):
            raise ValueError(f"trajectory {number}: {len(trajectory['pieces'])} tokens but {len(trajectory['q'])} "
                             "Q-values")
        parts.append(f"<h2>{html.escape(str(trajectory.get('heading', f'trajectory {number}')))}</h2>")
        if trajectory.get("meta"):
            parts.append(f'<div class="meta">{html.escape(str(trajectory["meta"]))}</div>')
        if trajectory.get("prompt"):  # folded (a native <details>, no script): the tokens are what the page shows
            parts.append(f'<details><summary>prompt ({len(trajectory["prompt"])} characters)</summary>'
                         f'<div class="prompt">{html.escape(trajectory["prompt"])}</div></details>')
        spans = []
        for piece, q in zip(trajectory["pieces"], trajectory["q"]):
            if q is None or not math.isfinite(q):
                spans.append(f'<span class="tok">{html.escape(piece)}</span>')
            else:
                spans.append(f'<span class="tok" style="background:{q_colour(q, low, high)}" '
                             f'title="Q = {q:.4f}">{html.escape(piece)}</span>')
        parts.append(f'<div class="trajectory">{"".join(spans)}</div>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"

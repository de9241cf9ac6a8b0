"""The reward model: a policy backbone (+ its LoRA adapter or trained last blocks) with a scalar head on the
final hidden state of the last answer token.

Stable API (the PPO stage codes against it):

    from icrl_core.reward_model import load_reward_model
    rm = load_reward_model(folder, config.model)      # folder = ppo.reward_model_path, e.g.
                                                      # artifacts/reward_model/model (or its parent)
    rewards = rm.score(sequences)                     # list of token-id lists -> float32 tensor (B,), no grad
    rewards = rm.forward(input_ids, attention_mask)   # right-padded (B, T) tensors -> (B,), differentiable

A scored sequence is prompt + answer exactly as training renders it: the episode's context up to and including
the answer prefix, then `Conversation.answer_ids(prefix, answer)` = " answer" + the end-of-turn token (the
`preferred_ids` / `rejected_ids` columns of the tokenized file). The reward is read at the last real token of
each row (with right padding: index attention_mask.sum(1) - 1), i.e. on the end-of-turn token, after the whole
answer has been seen. Rewards are raw Bradley-Terry logits: r(x, y+) - r(x, y-) is the log-odds that y+ is
preferred; only differences are meaningful (`reward_model.json` holds the mean/std of validation rewards if a
caller wants to standardise).

On disk (written atomically as one folder):

    adapter.safetensors      the trained backbone weights (LoRA matrices or last blocks), by parameter name
    reward_head.safetensors  linear.weight (1, H), linear.bias (1,), float32
    reward_model.json        {"format": 1, "spec", "dtype", "adapter": <model.adapter section>, "base",
                              "score_position": "last_token", "hidden_size", "reward_stats", "metrics"}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import TypeAdapter, ValidationError

from icrl_core.config import Adapter, ModelConfig
from icrl_core.errors import CheckpointError, UserError
from icrl_core.io import atomic_dir
from icrl_core.model import Policy, ValueHead, load_policy

FORMAT_VERSION = 1
ADAPTER_FILE = "adapter.safetensors"
HEAD_FILE = "reward_head.safetensors"
META_FILE = "reward_model.json"
_HEAD_PREFIX = "reward_head."


class RewardModel:
    """r(x, y) = w . h_last + b, h_last = final hidden state (after the last norm) at the last real token.

    The head is a `ValueHead` (same math as the critic: a linear map of a hidden state, kept in float32)."""

    def __init__(self, policy: Policy, head: ValueHead | None = None, seed: int = 0):
        self.policy = policy
        if head is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                head = ValueHead(policy.config.hidden_size)
        self.head = head.to(policy.device)

    @property
    def pad_id(self) -> int:
        return self.policy.tokenizer.pad_token_id

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """input_ids, attention_mask: (B, T), right-padded. -> rewards (B,) float32 (on the policy's device)."""
        input_ids, attention_mask = input_ids.to(self.policy.device), attention_mask.to(self.policy.device)
        hidden = self.policy.causal_lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.long().sum(dim=1) - 1  # (B,) index of the last real token
        h_last = hidden[torch.arange(hidden.shape[0]), last]  # (B, H)
        return self.head(h_last)

    __call__ = forward

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], batch_size: int = 8) -> torch.Tensor:
        """Rewards of token-id sequences (each = prompt + answer + end-of-turn), in batches. -> (B,) float32."""
        from icrl_core.batching import pad_sequences

        was_training = self.head.training
        self.eval()
        out = []
        for start in range(0, len(sequences), batch_size):
            ids, attention = pad_sequences(sequences[start:start + batch_size], self.pad_id)
            out.append(self.forward(ids, attention))
        self.train(was_training)
        return torch.cat(out).cpu() if out else torch.zeros(0)

    def backbone_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.policy.model.parameters() if p.requires_grad]

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.backbone_parameters() + list(self.head.parameters())

    def trainable_tensors(self) -> dict[str, torch.Tensor]:
        """Backbone trainable weights by name + head weights under 'reward_head.' (for checkpoints)."""
        tensors = dict(self.policy.trainable_state_dict())
        tensors.update({_HEAD_PREFIX + k: v.detach().contiguous() for k, v in self.head.state_dict().items()})
        return tensors

    def load_trainable_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        head = {k[len(_HEAD_PREFIX):]: v for k, v in tensors.items() if k.startswith(_HEAD_PREFIX)}
        backbone = {k: v for k, v in tensors.items() if not k.startswith(_HEAD_PREFIX)}
        self.policy.load_trainable_state_dict(backbone, "checkpoint")
        try:
            self.head.load_state_dict(head)
        except RuntimeError as exc:
            raise CheckpointError(f"checkpoint: reward head does not match ({exc})") from None

    def train(self, mode: bool = True) -> RewardModel:
        self.policy.train(mode)
        self.head.train(mode)
        return self

    def eval(self) -> RewardModel:
        return self.train(False)


def new_reward_model(model_config: ModelConfig, init_adapter: Path | None, seed: int = 0) -> RewardModel:
    """A reward model to train: `model_config.spec` with `model_config.adapter` (weights from `init_adapter`,
    e.g. the bootstrap output, or fresh) and a new head."""
    policy = load_policy(model_config.spec, model_config.dtype, model_config.adapter, value_head=False,
                         cache_dir=model_config.cache_dir, seed=seed, init_adapter=init_adapter,
                         device=model_config.device, right_padding_mask=model_config.right_padding_mask)
    return RewardModel(policy, seed=seed)


def save_reward_model(folder: Path | str, reward_model: RewardModel, meta: dict | None = None) -> Path:
    """Write adapter + head + description into `folder` in one atomic rename."""
    from safetensors.torch import save_file

    folder = Path(folder)
    policy = reward_model.policy
    with atomic_dir(folder) as tmp:
        save_file(policy.trainable_state_dict(), str(tmp / ADAPTER_FILE))
        reward_model.head.save(tmp / HEAD_FILE)
        description = {
            "format": FORMAT_VERSION,
            "spec": policy.spec,
            "dtype": str(next(policy.causal_lm.parameters()).dtype).removeprefix("torch."),
            "adapter": policy.adapter.model_dump(mode="json"),
            "score_position": "last_token",
            "hidden_size": int(policy.config.hidden_size),
            **(meta or {}),
        }
        (tmp / META_FILE).write_text(json.dumps(description, indent=2, sort_keys=True, default=str) + "\n")
    return folder


def resolve_reward_model_dir(folder: Path | str) -> Path:
    """The folder itself, or its `model/` sub-folder when given the reward_model stage's output_dir."""
    folder = Path(folder)
    if not (folder / META_FILE).exists() and (folder / "model" / META_FILE).exists():
        return folder / "model"
    return folder


def read_reward_model_meta(folder: Path | str) -> dict:
    path = Path(folder) / META_FILE
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{folder}: not a reward model folder ({META_FILE} missing); train one with "
                        "`icrl stage reward_model` or fix ppo.reward_model_path") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: corrupt ({exc.msg})") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: reward model format {meta.get('format')}, expected {FORMAT_VERSION}")
    return meta


def load_reward_model(folder: Path | str, model_config: ModelConfig) -> RewardModel:
    """Load a saved reward model for scoring (eval mode, nothing trainable).

    The backbone is `model_config.spec` in `model_config.dtype` (dtype may differ from training, e.g. bf16 for
    speed); the adapter *shape* comes from the folder's reward_model.json, so the policy's own adapter settings
    do not have to match. A different spec than the one trained on is refused (the head reads its hidden
    states). Corrupt or truncated files raise CheckpointError."""
    from icrl_core.adapter_format import load_safetensors

    folder = resolve_reward_model_dir(folder)
    meta = read_reward_model_meta(folder)
    if meta.get("spec") != model_config.spec:
        raise UserError(f"{folder}: reward model was trained on model.spec='{meta.get('spec')}', but "
                        f"model.spec='{model_config.spec}'; use the same base model")
    try:
        adapter = TypeAdapter(Adapter).validate_python(meta["adapter"])
    except (KeyError, ValidationError) as exc:
        raise CheckpointError(f"{folder / META_FILE}: bad adapter description ({exc})") from None
    policy = load_policy(model_config.spec, model_config.dtype, adapter, value_head=False,
                         cache_dir=model_config.cache_dir, device=model_config.device,
                         right_padding_mask=model_config.right_padding_mask)
    policy.load_trainable_state_dict(load_safetensors(folder / ADAPTER_FILE), str(folder / ADAPTER_FILE))
    head = ValueHead.load(folder / HEAD_FILE)
    if head.linear.weight.shape[1] != policy.config.hidden_size:
        raise CheckpointError(f"{folder / HEAD_FILE}: head width {head.linear.weight.shape[1]} != hidden size "
                              f"{policy.config.hidden_size}")
    for param in list(policy.model.parameters()) + list(head.parameters()):
        param.requires_grad_(False)
    return RewardModel(policy, head).eval()

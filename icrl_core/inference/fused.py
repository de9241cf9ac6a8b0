"""Fusing the forward passes of several evaluation streams into one (the torch engine's `fuse_streams` mode).

Each stream (a thread running one evaluation) appends tokens to its own key/value cache: a context extension
(causal) or a tree pass (queries and candidates, kernels.TreeScorer). On a CPU a pass of a few dozen tokens
is bound by reading the weights, not by arithmetic: a 30-token pass of SmolLM2-135M costs about a third of a
300-token pass. `StreamBatcher` collects the passes the streams submit and runs them as one *ragged* pass
(`ragged_forward`): the tokens of all passes are concatenated into one row block for every linear layer (norms,
projections, MLP), while attention runs per pass against its own cache with its own mask and positions. Nothing
is padded.

Numerics: every token's result is the same function of the same inputs, but the matrix products see more rows,
so their float rounding may differ from a pass on its own (about 1e-6 relative): not bit-identical, hence the
engine reports exact=False in this mode and docs/INFERENCE.md states the measured agreement with the exact mode.
A batch of one pass runs the plain forward (exact).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from icrl_core.kernels import _cache_length, model_forward


def supports_ragged(policy) -> bool:
    """The ragged pass re-implements a Llama decoder stack (SmolLM2's architecture)."""
    return getattr(policy.causal_lm.config, "model_type", None) == "llama"


@torch.no_grad()
def ragged_forward(policy, passes: list[tuple[torch.Tensor, torch.Tensor, object, torch.Tensor | None]],
                   ) -> list[torch.Tensor]:
    """Run several passes (ids (1, n_i), positions (1, n_i), cache, mask (1, 1, n_i, P_i + n_i) bool or None =
    causal) of one model at once; per pass its final hidden states (n_i, H). Each cache is extended as
    model_forward would extend it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    model = policy.causal_lm.model
    sizes = [ids.shape[1] for ids, _, _, _ in passes]
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    device = policy.device  # inputs are built on the CPU (model_forward moves them the same way)
    masks = []
    for (ids, _, cache, mask), n in zip(passes, sizes):
        if mask is None:
            past = _cache_length(cache)
            mask = torch.ones((1, 1, n, past + n), dtype=torch.bool)
            mask[0, 0, :, past:] = torch.ones((n, n), dtype=torch.bool).tril()
        masks.append(mask.to(device))
    hidden = model.embed_tokens(torch.cat([ids for ids, _, _, _ in passes], dim=1).to(device))   # (1, N, H)
    positions = torch.cat([pos for _, pos, _, _ in passes], dim=1).to(device)
    cos, sin = model.rotary_emb(hidden, position_ids=positions)                       # (1, N, head_dim)
    for layer_index, layer in enumerate(model.layers[: model.config.num_hidden_layers]):
        attention = layer.self_attn
        residual = hidden
        x = layer.input_layernorm(hidden)
        q_all, k_all, v_all = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        outputs = []
        for i, (_, _, cache, _) in enumerate(passes):
            a, b = bounds[i], bounds[i + 1]
            shape = (1, b - a, -1, attention.head_dim)
            q = q_all[:, a:b].view(shape).transpose(1, 2)
            k = k_all[:, a:b].view(shape).transpose(1, 2)
            v = v_all[:, a:b].view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos[:, a:b], sin[:, a:b])
            k, v = cache.update(k, v, layer_index)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, repeat_kv(k, attention.num_key_value_groups), repeat_kv(v, attention.num_key_value_groups),
                attn_mask=masks[i], scale=attention.scaling)                          # (1, heads, n, head_dim)
            outputs.append(out.transpose(1, 2).reshape(1, b - a, -1))
        hidden = residual + attention.o_proj(torch.cat(outputs, dim=1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    hidden = model.norm(hidden)[0]
    return [hidden[bounds[i]:bounds[i + 1]] for i in range(len(passes))]


@dataclass(eq=False)  # identity: `job in pending` must not compare tensors
class _Pass:
    policy: object
    ids: torch.Tensor
    positions: torch.Tensor
    cache: object
    mask: torch.Tensor | None
    submitted: float = field(default_factory=time.perf_counter)
    result: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


class StreamBatcher:
    """Collects the passes of the registered streams and runs them fused (`ragged_forward`, one fused pass per
    model at a time). A batch runs when every registered stream is waiting for a pass, or when the oldest pass
    has waited `max_wait` seconds (a stream busy elsewhere, e.g. writing its logs, delays the others at most
    that long). `forward` has model_forward's signature: give it to PrefixCache and TreeScorer."""

    def __init__(self, max_wait: float = 0.05):
        self.max_wait = max_wait
        self._cond = threading.Condition()
        self._streams = 0
        self._pending: list[_Pass] = []
        self._running = False
        self.batches = 0        # fused passes run (statistics)
        self.passes = 0         # stream passes they contained

    def register(self) -> None:
        with self._cond:
            self._streams += 1

    def unregister(self) -> None:
        with self._cond:
            self._streams -= 1
            self._cond.notify_all()

    def forward(self, policy, ids, positions, cache, mask=None) -> torch.Tensor:
        job = _Pass(policy, ids, positions, cache, mask)
        with self._cond:
            self._pending.append(job)
            self._cond.notify_all()
            while not job.done:
                ready = (len(self._pending) >= self._streams
                         or time.perf_counter() - self._pending[0].submitted >= self.max_wait) if self._pending else False
                if ready and not self._running and job in self._pending:
                    batch, self._pending = self._pending, []
                    self._running = True
                    break
                self._cond.wait(timeout=self.max_wait / 4)
            else:
                return self._result(job)
        try:
            self._run(batch)
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()
        return self._result(job)

    @staticmethod
    def _result(job: _Pass) -> torch.Tensor:
        if job.error is not None:
            raise job.error
        return job.result

    def _run(self, batch: list[_Pass]) -> None:
        groups: dict[int, list[_Pass]] = {}
        for job in batch:
            groups.setdefault(id(job.policy), []).append(job)
        for jobs in groups.values():
            try:
                if len(jobs) == 1:
                    job = jobs[0]
                    job.result = model_forward(job.policy, job.ids, job.positions, job.cache, job.mask)
                else:
                    results = ragged_forward(jobs[0].policy, [(j.ids, j.positions, j.cache, j.mask) for j in jobs])
                    for job, result in zip(jobs, results):
                        job.result = result
            except BaseException as error:  # noqa: BLE001 - every stream of the failed pass sees the error
                for job in jobs:
                    job.error = error
            self.batches += 1
            self.passes += len(jobs)
        with self._cond:
            for job in batch:
                job.done = True
            self._cond.notify_all()

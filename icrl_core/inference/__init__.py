"""Inference engines behind the evaluation harness, the probes and the rollouts (see base.py, docs/INFERENCE.md).
Kept empty: importing the package loads no backend."""

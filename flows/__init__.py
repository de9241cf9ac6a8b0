"""Prefect flows that chain the stages; they orchestrate and hold no stage logic."""

"""Process-wide defaults applied before any heavy import: offline hubs, no telemetry, local-only servers."""

from __future__ import annotations

import os

DEFAULTS = {
    # Nothing downloads weights or datasets at run time; hub ids resolve from the local HF cache only.
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "DO_NOT_TRACK": "true",
    "DVC_NO_ANALYTICS": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # Prefect's ephemeral server (a flow run without PREFECT_API_URL outside `icrl pipeline`/`icrl demo`, e.g. the
    # tests) gets 20 s to start by default;
    # on a loaded 2-core machine it needed more and the run died before its first stage.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    # A Prefect server write waits this long for SQLite's lock (default 10 s) before answering 503; on a loaded
    # 2-core machine a deployment trigger got that 503 (CI, 2026-11-28).
    "PREFECT_SERVER_DATABASE_TIMEOUT": "60",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Otherwise Ray listens on every interface even when given 127.0.0.1.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    # MKL's conditional numerical reproducibility: without it, fp32 matmuls on an AVX512/AMX CPU rounded differently
    # from one run to the next (a forced bootstrap rerun changed one byte of the adapter; on AVX2 CPUs it did not),
    # which breaks "a rerun or a resume gives the same weights". STRICT: whatever the arrays' memory alignment.
    "MKL_CBWR": "AUTO,STRICT",
}


def apply_defaults() -> None:
    """Set each default unless the user already set that variable."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)

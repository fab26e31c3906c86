#!/usr/bin/env bash
# The test-only vLLM layer: vLLM's wheel (and the few pure-Python packages its import paths
# need) installed --no-deps into a --target folder under ~/.cache, added to sys.path by the
# tests of agentserving.engine.vllm only. It never runs inference (vLLM's C extension needs
# libcuda); it lets the connector be tested against vLLM's real classes. Torch, LMCache,
# transformers etc. come from the project's .venv, which this folder never shadows (it is
# appended to sys.path, not prepended).
#
#   scripts/vllm-test-env.sh          install if missing (cached; ~340 MB download, ~30 s)
#   scripts/vllm-test-env.sh --path   print the folder
# Skip it with AGENTSERVING_SKIP_VLLM_ENV=1 (the vLLM tests then skip, saying why).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION=0.33.0
DIR="${AGENTSERVING_VLLM_ENV:-$HOME/.cache/agentserving/vllm-env-$VLLM_VERSION}"
PIP="${PIP:-.venv/bin/pip}"
# Pinned: what vLLM's import paths of the connector need and the project venv lacks.
PACKAGES=(
  "vllm==$VLLM_VERSION" "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11"
  "cloudpickle==3.1.2" "cbor2==5.7.1" "pybase64==1.4.2" "partial-json-parser==0.2.1.1.post6"
  "llguidance==1.7.3" "einops==0.8.1" "oss-harmony==0.0.11"
)
if [[ "${1:-}" == "--path" ]]; then echo "$DIR"; exit 0; fi
if [[ "${AGENTSERVING_SKIP_VLLM_ENV:-0}" == "1" ]]; then
  echo "vllm test env: skipped (AGENTSERVING_SKIP_VLLM_ENV=1)"; exit 0
fi
STAMP="$DIR/.agentserving-installed"
WANT="${PACKAGES[*]}"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then exit 0; fi
echo "vllm test env: installing vLLM $VLLM_VERSION (--no-deps) into $DIR"
rm -rf "$DIR.tmp"
"$PIP" install -q --no-deps --no-compile --target "$DIR.tmp" "${PACKAGES[@]}"
rm -rf "$DIR"
mv "$DIR.tmp" "$DIR"
echo "$WANT" > "$STAMP"

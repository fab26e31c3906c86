#!/usr/bin/env bash
# The coding agents' own command-line clients, pinned, in a folder of their own under ~/.cache:
# Claude Code (Anthropic Messages) and Codex (OpenAI Responses), which the tests point at the
# proxy (e2e/vllm/test_agent_apis_on_vllm.py). npm takes them from the registry the machine's
# npm configuration names; each ships its native binary as a platform package (no install
# script runs). Node.js comes from Debian when the machine has none.
#
#   scripts/agent-clis.sh          install if missing (~250 MB, about 15 s the first time)
#   scripts/agent-clis.sh --path   print the folder (its node_modules/.bin holds claude, codex)
# Skip it with AGENTSERVING_SKIP_AGENT_CLIS=1 (the CLI tests then skip, saying why).
set -euo pipefail
CLAUDE_CODE_VERSION=2.1.197
CODEX_VERSION=0.171.0
DIR="${AGENTSERVING_AGENT_CLIS:-$HOME/.cache/agentserving/agent-clis-$CLAUDE_CODE_VERSION-$CODEX_VERSION}"
if [[ "${1:-}" == "--path" ]]; then echo "$DIR"; exit 0; fi
if [[ "${AGENTSERVING_SKIP_AGENT_CLIS:-0}" == "1" ]]; then
  echo "agent CLIs: skipped (AGENTSERVING_SKIP_AGENT_CLIS=1)"; exit 0
fi
if [[ -x "$DIR/node_modules/.bin/claude" && -x "$DIR/node_modules/.bin/codex" ]]; then exit 0; fi
if ! command -v npm >/dev/null; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get install -y -q nodejs npm
fi
echo "agent CLIs: installing Claude Code $CLAUDE_CODE_VERSION and Codex $CODEX_VERSION into $DIR"
rm -rf "$DIR.tmp"
mkdir -p "$DIR.tmp"
npm install --prefix "$DIR.tmp" --no-audit --no-fund --loglevel=error \
  "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION"
rm -rf "$DIR"
mv "$DIR.tmp" "$DIR"

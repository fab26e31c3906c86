#!/usr/bin/env bash
# Debian packages the local fleet needs (redis-server); with --test, the test cluster's and the
# images' too (scripts/debian.sh lists them), so that one apt run installs everything before the
# test set-up's phases run side by side. Installs only what is missing.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
log() { echo "$*"; }
# shellcheck source=scripts/debian.sh
source "$REPO/scripts/debian.sh"
case "${1:-}" in
  "") install_debs "${FLEET_DEBS[@]}" ;;
  --test) install_debs "${FLEET_DEBS[@]}" "${K8S_DEBS[@]}" "${IMAGES_DEBS[@]}" ;;
  *) echo "usage: $0 [--test]" >&2; exit 2 ;;
esac

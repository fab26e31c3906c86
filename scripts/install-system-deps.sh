#!/usr/bin/env bash
# Debian packages the tests and the local fleet need; installs only what is missing.
# (The test cluster's and the images' own packages: scripts/k8s-test-cluster.sh, images.sh.)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
log() { echo "$*"; }
# shellcheck source=scripts/debian.sh
source "$REPO/scripts/debian.sh"
command -v redis-server >/dev/null 2>&1 || install_debs redis-server

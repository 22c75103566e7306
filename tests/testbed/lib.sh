# shellcheck shell=bash
# Shared functions of the testbed harness. Sourced, not executed.
set -euo pipefail

TESTBED_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$TESTBED_DIR/../.." && pwd)"
# Everything slow to build is cached here and reused by later runs (images live in the Docker engine).
TESTBED_CACHE="${TESTBED_CACHE:-/var/cache/teamserve-testbed}"
mkdir -p "$TESTBED_CACHE"
# The vLLM release a healthy upgrade starts from (engine/Dockerfile.previous, engine/requirements-<it>.txt);
# the engine image itself is 0.32.0, the testbed lock file's pin.
TESTBED_PREVIOUS_VLLM=0.31.0

log() { printf '[testbed %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# Serialise concurrent builders of the same artefact (make -j, several checkouts, CI).
with_lock() {
  local name=$1; shift
  exec {lockfd}>"$TESTBED_CACHE/$name.lock"
  flock "$lockfd"
  "$@"
  flock -u "$lockfd"
}

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

# The testbed's two networks (docs/contracts.md): the team's LAN and an "outside" network. Docker hands
# out dynamic addresses only from the upper half (--ip-range), so the fixed addresses in the lower half
# (apt repo .2, registry .3, box .10, clients .20) never collide with a container started without one.
ensure_networks() {
  local name net br
  # A Docker data directory wiped while dockerd ran leaves its bridges behind; one still holding a
  # testbed gateway address would capture the route to the new network. Remove only such leftovers:
  # br-* links that hold 10.231.0.1 or 10.232.0.1 and belong to no network this engine knows.
  for br in $(ip -o -4 addr show | awk '$4 ~ /^10\.23[12]\.0\.1\// && $2 ~ /^br-/ { print $2 }'); do
    docker network ls -q --no-trunc | grep -q "^${br#br-}" || { log "removing stale bridge $br"; ip link delete "$br"; }
  done
  for name in lan:231 wan:232; do
    net="teamserve-${name%%:*}"
    docker network inspect "$net" >/dev/null 2>&1 ||
      docker network create --subnet "10.${name##*:}.0.0/24" --gateway "10.${name##*:}.0.1" \
        --ip-range "10.${name##*:}.0.128/25" "$net" >/dev/null
  done
}

# The Hugging Face token of the stand-in hub (tests/testbed/hf-hub.sh): $TESTBED_CACHE/hf-token, root
# only, made on first use in the shape of a real HF user access token ("hf_" + 34 letters). Prints its path.
ensure_hf_token() {
  local file="$TESTBED_CACHE/hf-token"
  if [[ ! -s $file ]]; then
    (umask 077; printf 'hf_%s\n' "$(tr -dc 'A-Za-z' </dev/urandom | head -c 34)" >"$file.tmp" && mv "$file.tmp" "$file")
  fi
  chmod 0600 "$file"
  printf '%s\n' "$file"
}

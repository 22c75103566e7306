# shellcheck shell=bash
# Shared helpers for the testbed harness. Sourced, not executed.
set -euo pipefail

TESTBED_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$TESTBED_DIR/../.." && pwd)"
# Everything slow to build is cached here and reused by later runs (images live in the Docker engine).
TESTBED_CACHE="${TESTBED_CACHE:-/var/cache/teamserve-testbed}"
mkdir -p "$TESTBED_CACHE"

log() { printf '[testbed %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

# Serialise concurrent builders of the same artefact (make -j, helpers, CI).
with_lock() {
  local name=$1; shift
  exec {lockfd}>"$TESTBED_CACHE/$name.lock"
  flock "$lockfd"
  "$@"
  flock -u "$lockfd"
}

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

# The testbed's two networks (docs/contracts.md): the team's LAN and an "outside" network.
ensure_networks() {
  docker network inspect teamserve-lan >/dev/null 2>&1 ||
    docker network create --subnet 10.231.0.0/24 --gateway 10.231.0.1 teamserve-lan >/dev/null
  docker network inspect teamserve-wan >/dev/null 2>&1 ||
    docker network create --subnet 10.232.0.0/24 --gateway 10.232.0.1 teamserve-wan >/dev/null
}

#!/usr/bin/env bash
# Run the firewall scenario: make sure the engine and the shared networks exist, then molecule.
# Usage: tests/firewall/molecule.sh [molecule command, default: test]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
bash "$repo/tests/testbed/docker-engine.sh"
# shellcheck source=../testbed/lib.sh
source "$repo/tests/testbed/lib.sh"
ensure_networks
image_exists teamserve-testbed/debian:bookworm || bash "$repo/tests/testbed/base-images.sh" bookworm
export PATH="$repo/.venv/bin:$PATH"
cd "$repo"
exec molecule "${@:-test}" -s firewall

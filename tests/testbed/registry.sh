#!/usr/bin/env bash
# Run the testbed's local Docker registry and push the engine images into it (docs/contracts.md):
#   container teamserve-registry on teamserve-lan at 10.231.0.3:5000 (plain HTTP), also published on
#   127.0.0.1:5000 so the host's dockerd pushes to it without an insecure-registries entry (Docker
#   trusts localhost registries by default); one storage, so both names serve the same digests.
# Image: Debian's own `docker-registry` package (distribution 2.8 on bookworm) on the bookworm base.
# Storage persists in $TESTBED_CACHE/registry, so a second run pushes nothing.
# Writes $TESTBED_CACHE/engine-image.env:
#   VLLM_IMAGE_REPOSITORY=10.231.0.3:5000/vllm/vllm-openai
#   VLLM_IMAGE_DIGEST=sha256:...          (tag v0.32.0)
#   VLLM_IMAGE_BROKEN_DIGEST=sha256:...   (tag v0.32.0-broken)
#   VLLM_IMAGE_PREVIOUS_DIGEST=sha256:... (tag v0.31.0, TESTBED_PREVIOUS_VLLM)
#   VLLM_PREVIOUS_VERSION=0.31.0
#   VLLM_IMAGE_SLOW_DIGEST=sha256:...     (tag v0.32.0-slow)
# The box pulls e.g. 10.231.0.3:5000/vllm/vllm-openai:v0.32.0@sha256:... (the docker role marks
# 10.231.0.3:5000 as an insecure registry).
# Usage: registry.sh   (builds the engine images first via engine-image.sh; logs on stderr)
source "$(dirname "$0")/lib.sh"

REGISTRY_IMAGE=teamserve-testbed/registry:bookworm
REGISTRY_NAME=teamserve-registry
# The contract address; overridable only to test this script while another container holds it.
REGISTRY_IP="${TESTBED_REGISTRY_IP:-10.231.0.3}"
REGISTRY_PORT=5000
PUSH_HOST="127.0.0.1:$REGISTRY_PORT"
REPOSITORY=vllm/vllm-openai
TAGS=(v0.32.0 v0.32.0-broken "v$TESTBED_PREVIOUS_VLLM" v0.32.0-slow)
STORAGE="$TESTBED_CACHE/registry"

# Debian's docker-registry reads /etc/docker/registry/config.yml (package default path). Everything it
# needs is below: filesystem storage, plain HTTP on :5000, deletes allowed for garbage collection.
REGISTRY_DOCKERFILE=$(cat <<'EOF'
FROM teamserve-testbed/debian:bookworm
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-registry \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
RUN printf '%s\n' 'version: 0.1' 'log:' '  level: info' 'storage:' '  filesystem:' \
      '    rootdirectory: /var/lib/docker-registry' '  delete:' '    enabled: true' \
      'http:' '  addr: :5000' 'health:' '  storagedriver:' '    enabled: true' \
      >/etc/docker/registry/config.yml
LABEL org.opencontainers.image.title="teamserve testbed registry (Debian docker-registry)"
EXPOSE 5000
ENTRYPOINT ["/usr/bin/docker-registry", "serve", "/etc/docker/registry/config.yml"]
EOF
)

build_registry_image() {
  local hash; hash=$(printf '%s' "$REGISTRY_DOCKERFILE" | sha256sum | cut -c1-16)
  if [[ "$(docker image inspect -f '{{ index .Config.Labels "io.teamserve.testbed.inputs-hash" }}' \
         "$REGISTRY_IMAGE" 2>/dev/null)" == "$hash" ]]; then
    log "$REGISTRY_IMAGE cached"; return 0
  fi
  bash "$TESTBED_DIR/base-images.sh" bookworm
  printf '%s\nLABEL io.teamserve.testbed.inputs-hash="%s"\n' "$REGISTRY_DOCKERFILE" "$hash" |
    DOCKER_BUILDKIT=0 docker build --quiet -t "$REGISTRY_IMAGE" - >"$TESTBED_CACHE/registry-build.log" 2>&1 ||
    { log "registry image build failed; see $TESTBED_CACHE/registry-build.log"; return 1; }
  log "$REGISTRY_IMAGE built"
}

start_registry() {
  local image_id; image_id=$(docker image inspect -f '{{ .Id }}' "$REGISTRY_IMAGE")
  if [[ "$(docker inspect -f '{{ .Image }} {{ .State.Running }}' "$REGISTRY_NAME" 2>/dev/null)" == "$image_id true" ]]; then
    log "$REGISTRY_NAME already running"
  else
    # Only our own container of that name is ever replaced (it is labelled by this script).
    if docker inspect "$REGISTRY_NAME" >/dev/null 2>&1; then
      [[ "$(docker inspect -f '{{ index .Config.Labels "io.teamserve.testbed.owner" }}' "$REGISTRY_NAME")" == registry.sh ]] ||
        { log "a container named $REGISTRY_NAME exists that registry.sh did not create; leaving it"; return 1; }
      docker rm -f "$REGISTRY_NAME" >/dev/null
    fi
    ensure_networks
    local holder
    holder=$(docker network inspect teamserve-lan \
      -f '{{ range .Containers }}{{ .Name }} {{ .IPv4Address }}{{ println }}{{ end }}' |
      awk -v ip="$REGISTRY_IP/24" '$2 == ip { print $1 }')
    if [[ -n "$holder" ]]; then
      log "$REGISTRY_IP on teamserve-lan is already held by container '$holder' (Docker gave it that address" \
          "dynamically). Start the registry before other LAN containers, or give teamserve-lan an --ip-range" \
          "that excludes the fixed addresses of docs/contracts.md."
      return 1
    fi
    mkdir -p "$STORAGE"
    docker run -d --name "$REGISTRY_NAME" --label io.teamserve.testbed.owner=registry.sh \
      --network teamserve-lan --ip "$REGISTRY_IP" -p "127.0.0.1:$REGISTRY_PORT:$REGISTRY_PORT" \
      -v "$STORAGE:/var/lib/docker-registry" --restart unless-stopped "$REGISTRY_IMAGE" >/dev/null ||
      { docker rm -f "$REGISTRY_NAME" >/dev/null 2>&1; log "could not start $REGISTRY_NAME"; return 1; }
    log "$REGISTRY_NAME started on $REGISTRY_IP:$REGISTRY_PORT and $PUSH_HOST"
  fi
  for _ in $(seq 1 30); do
    curl -fsS -o /dev/null --max-time 2 "http://$PUSH_HOST/v2/" && return 0
    sleep 1
  done
  log "registry did not answer on http://$PUSH_HOST/v2/ within 30 s"; docker logs --tail 20 "$REGISTRY_NAME" >&2; return 1
}

# Digest the registry serves for a tag (the manifest the box will pull), or nothing.
registry_digest() {
  curl -fsS -o /dev/null -D - --max-time 10 \
    -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' \
    "http://$PUSH_HOST/v2/$REPOSITORY/manifests/$1" 2>/dev/null |
    tr -d '\r' | awk 'tolower($1) == "docker-content-digest:" { print $2 }' || true
}

push_tag() {
  local tag=$1 local_ref="$REPOSITORY:$1" remote_ref="$PUSH_HOST/$REPOSITORY:$1" served known start
  served=$(registry_digest "$tag")
  # Digests this image ID already had when pushed to this registry before (kept by the engine).
  known=$(docker image inspect -f '{{ range .RepoDigests }}{{ println . }}{{ end }}' "$local_ref" |
          awk -F@ -v r="$PUSH_HOST/$REPOSITORY" '$1 == r { print $2 }' || true)
  if [[ -n "$served" ]] && grep -qxF "$served" <<<"$known"; then
    log "$remote_ref already in the registry ($served)"; return 0
  fi
  docker tag "$local_ref" "$remote_ref"
  start=$SECONDS
  docker push "$remote_ref" >"$TESTBED_CACHE/registry-push-$tag.log" 2>&1 ||
    { log "push of $remote_ref failed; see $TESTBED_CACHE/registry-push-$tag.log"; return 1; }
  log "pushed $remote_ref in $((SECONDS - start)) s ($(registry_digest "$tag"))"
}

main() {
  bash "$TESTBED_DIR/engine-image.sh"
  build_registry_image
  start_registry
  local tag digest env_tmp
  env_tmp=$(mktemp "$TESTBED_CACHE/engine-image.env.XXXX")
  echo "VLLM_IMAGE_REPOSITORY=$REGISTRY_IP:$REGISTRY_PORT/$REPOSITORY" >"$env_tmp"
  for tag in "${TAGS[@]}"; do
    push_tag "$tag"
    digest=$(registry_digest "$tag")
    [[ "$digest" == sha256:* ]] || { log "registry serves no digest for $REPOSITORY:$tag"; rm -f "$env_tmp"; return 1; }
    if [[ "$tag" == *-broken ]]; then
      echo "VLLM_IMAGE_BROKEN_DIGEST=$digest" >>"$env_tmp"
    elif [[ "$tag" == "v$TESTBED_PREVIOUS_VLLM" ]]; then
      printf 'VLLM_IMAGE_PREVIOUS_DIGEST=%s\nVLLM_PREVIOUS_VERSION=%s\n' "$digest" "$TESTBED_PREVIOUS_VLLM" >>"$env_tmp"
    elif [[ "$tag" == *-slow ]]; then
      echo "VLLM_IMAGE_SLOW_DIGEST=$digest" >>"$env_tmp"
    else
      echo "VLLM_IMAGE_DIGEST=$digest" >>"$env_tmp"
    fi
  done
  chmod 0644 "$env_tmp"
  mv "$env_tmp" "$TESTBED_CACHE/engine-image.env"
  log "wrote $TESTBED_CACHE/engine-image.env"
}

with_lock registry main

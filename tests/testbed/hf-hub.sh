#!/usr/bin/env bash
# Run the testbed's stand-in Hugging Face Hub (docs/contracts.md): container teamserve-hf-hub on
# teamserve-lan at 10.231.0.4:80 (plain HTTP), serving the engine image's tiny model as the PRIVATE
# repository teamserve/tiny-llama at the fixed commit below. Every Hub call needs the bearer token kept in
# $TESTBED_CACHE/hf-token (0600; made on first use, mounted read-only into the container, never in its
# environment); tests/testbed/inventory.sh puts the same token in the testbed vault as
# vault_vllm_hf_token. The vllm role reaches it through vllm_hf_endpoint (HF_ENDPOINT of its downloader).
# Image teamserve-testbed/hf-hub:bookworm (tests/testbed/hf-hub/), rebuilt when its inputs or the engine
# image change. Usage: hf-hub.sh   (needs the engine image: engine-image.sh; logs on stderr)
source "$(dirname "$0")/lib.sh"

HUB_IMAGE=teamserve-testbed/hf-hub:bookworm
HUB_NAME=teamserve-hf-hub
HUB_IP="${TESTBED_HF_HUB_IP:-10.231.0.4}"
ENGINE_IMAGE="${ENGINE_IMAGE:-vllm/vllm-openai:v0.32.0}"
# The repository and its one commit; the testbed inventory pins the same (vllm_model.name in main.yml,
# vllm_model_revision in lock.yml; tests/unit/test_testbed_stand_ins.py checks that they agree).
HF_REPO=teamserve/tiny-llama
HF_REVISION=ef486eba9ff0b47394b3d9daf8a30e736bf68ef8

build_hub_image() {
  local engine_id hash
  engine_id=$(docker image inspect -f '{{ .Id }}' "$ENGINE_IMAGE") ||
    { log "$ENGINE_IMAGE missing; run tests/testbed/engine-image.sh"; return 1; }
  hash=$( { (cd "$TESTBED_DIR/hf-hub" && sha256sum Dockerfile hub_server.py); echo "$engine_id"; } | sha256sum | cut -c1-16)
  if [[ "$(docker image inspect -f '{{ index .Config.Labels "io.teamserve.testbed.inputs-hash" }}' \
         "$HUB_IMAGE" 2>/dev/null)" == "$hash" ]]; then
    log "$HUB_IMAGE cached"; return 0
  fi
  bash "$TESTBED_DIR/base-images.sh" bookworm
  DOCKER_BUILDKIT=0 docker build --quiet --build-arg ENGINE_IMAGE="$engine_id" \
    --build-arg TESTBED_INPUTS_HASH="$hash" -t "$HUB_IMAGE" "$TESTBED_DIR/hf-hub" \
    >"$TESTBED_CACHE/hf-hub-build.log" 2>&1 ||
    { log "hub image build failed; see $TESTBED_CACHE/hf-hub-build.log"; return 1; }
  log "$HUB_IMAGE built"
}

start_hub() {
  local image_id token_file holder
  image_id=$(docker image inspect -f '{{ .Id }}' "$HUB_IMAGE")
  token_file=$(ensure_hf_token)
  if [[ "$(docker inspect -f '{{ .Image }} {{ .State.Running }}' "$HUB_NAME" 2>/dev/null)" == "$image_id true" ]]; then
    log "$HUB_NAME already running"
  else
    if docker inspect "$HUB_NAME" >/dev/null 2>&1; then
      [[ "$(docker inspect -f '{{ index .Config.Labels "io.teamserve.testbed.owner" }}' "$HUB_NAME")" == hf-hub.sh ]] ||
        { log "a container named $HUB_NAME exists that hf-hub.sh did not create; leaving it"; return 1; }
      docker rm -f "$HUB_NAME" >/dev/null
    fi
    ensure_networks
    holder=$(docker network inspect teamserve-lan \
      -f '{{ range .Containers }}{{ .Name }} {{ .IPv4Address }}{{ println }}{{ end }}' |
      awk -v ip="$HUB_IP/24" '$2 == ip { print $1 }')
    [[ -z "$holder" ]] || { log "$HUB_IP on teamserve-lan is already held by container '$holder'"; return 1; }
    docker run -d --name "$HUB_NAME" --label io.teamserve.testbed.owner=hf-hub.sh \
      --network teamserve-lan --ip "$HUB_IP" -v "$token_file:/run/secrets/hf_token:ro" \
      --restart unless-stopped "$HUB_IMAGE" --repo "$HF_REPO" --revision "$HF_REVISION" >/dev/null ||
      { docker rm -f "$HUB_NAME" >/dev/null 2>&1; log "could not start $HUB_NAME"; return 1; }
    log "$HUB_NAME started on http://$HUB_IP/ ($HF_REPO@$HF_REVISION)"
  fi
  # The unauthenticated counters endpoint answers once the server has indexed the repository.
  for _ in $(seq 1 30); do
    docker exec "$HUB_NAME" python3 -c \
      "import urllib.request as u; u.urlopen('http://127.0.0.1/_testbed/stats', timeout=2)" 2>/dev/null && return 0
    sleep 1
  done
  log "$HUB_NAME did not answer within 30 s"; docker logs --tail 20 "$HUB_NAME" >&2; return 1
}

main() {
  build_hub_image
  start_hub
}

with_lock hf-hub main

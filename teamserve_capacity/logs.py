"""Read the memory lines of a real vLLM start-up log.

Lines understood (vLLM 0.32 ``gpu_worker.py``/``gpu_model_runner.py``/
``kv_cache_utils.py``, and the older V0 forms still common in bug reports):

* ``Model loading took 14.99 GiB memory and 5.1 seconds`` /
  ``Loading model weights took 14.9888 GB``
* ``Available KV cache memory: 53.29 GiB``
* ``GPU KV cache size: 42,656 tokens`` (or ``CPU KV cache size``)
* ``Maximum concurrency for 32,768 tokens per request: 1.30x``
* ``Memory profiling results: total_gpu_memory=23.58GiB ... non_torch_memory=0.35GiB
  kv_cache_size=3.81GiB gpu_memory_utilization=0.90`` (V0, one line) and
  ``total_gpu_memory 79.22GiB`` / ``non_torch_memory 1.79GiB`` /
  ``PyTorch activation peak memory 1.26GiB`` / ``available_kv_cache_memory 53.29GiB``
  (V0 table form, vLLM PR #10511).
* ``# GPU blocks: 1952`` (V0).
* ``Initial free memory: 139.12 GiB, free memory: 81.52 GiB, requested GPU memory:
  69.86 GiB`` / ``Memory profiling takes 40.46 seconds. Total non KV cache memory:
  62.79GiB; torch peak memory increase: 5.62GiB; non-torch forward increase memory:
  2.04GiB; weights memory: 55.13GiB.`` (V1 ``gpu_worker.py`` DEBUG lines, vLLM
  PR #21429).
* ``Free memory on device (30.27/31.4 GiB) on startup. Desired GPU memory
  utilization is (0.92, 28.88 GiB). Actual usage is 15.03 GiB for consumed
  memory (weights + non-torch), 1.59 GiB for peak activation, and 0.09 GiB for
  CUDAGraph memory. ... Current kv cache memory in use is 12.26 GiB.`` (0.32
  ``gpu_worker.py`` summary).
* ``Estimated CUDA graph memory: 0.09 GiB total`` (0.32) / ``Graph capturing
  finished in 5 secs, took 0.53 GiB`` (older).
"""

from __future__ import annotations

import re
from typing import Any

GIB = 1024 ** 3

_FLOAT = r"(-?[0-9]+(?:\.[0-9]+)?)"
_PATTERNS: dict[str, tuple[re.Pattern[str], ...]] = {
    "weights_gib": (re.compile(r"(?:Model loading took|Loading model weights took|model weights take)\s+"
                               + _FLOAT + r"\s*Gi?B"),
                    re.compile(r"; weights memory: " + _FLOAT + r"\s*GiB")),
    "requested_gib": (re.compile(r"requested GPU memory: " + _FLOAT + r"\s*GiB"),),
    "consumed_gib": (re.compile(r"Actual usage is " + _FLOAT + r" GiB for consumed memory"),),
    "kv_cache_gib": (re.compile(r"(?:Available KV cache memory:?|available_kv_cache_memory|kv_cache_size=)\s*"
                                + _FLOAT + r"\s*GiB"),
                     re.compile(r"Current kv cache memory in use is " + _FLOAT + r" GiB")),
    "kv_tokens": (re.compile(r"(?:GPU|CPU|XPU) KV cache size:\s*([0-9,]+) tokens"),),
    "max_model_len": (re.compile(r"Maximum concurrency for ([0-9,]+) tokens per request"),),
    "concurrency": (re.compile(r"Maximum concurrency for [0-9,]+ tokens per request:\s*" + _FLOAT + "x"),),
    "total_gib": (re.compile(r"total_gpu_memory[=\s(]+" + _FLOAT + r"\s*GiB"),
                  re.compile(r"Free memory on device \([0-9.]+/" + _FLOAT + r" GiB\)")),
    "non_torch_gib": (re.compile(r"non_torch_memory(?: takes)?[=\s]+" + _FLOAT + r"\s*GiB"),
                      re.compile(r"non-torch forward increase memory: " + _FLOAT + r"\s*GiB")),
    "activation_gib": (re.compile(r"PyTorch activation peak memory(?: takes)?\s*" + _FLOAT + r"\s*GiB"),
                       re.compile(_FLOAT + r" GiB for peak activation"),
                       re.compile(r"torch peak memory increase: " + _FLOAT + r"\s*GiB")),
    "gpu_memory_utilization": (re.compile(r"gpu_memory_utilization[=\s(]+" + _FLOAT),
                               re.compile(r"Desired GPU memory utilization is \(" + _FLOAT)),
    "gpu_blocks": (re.compile(r"# GPU blocks:\s*([0-9,]+)"),),
    "cudagraph_gib": (re.compile(r"(?:Estimated CUDA graph memory:|Graph capturing finished in [0-9.]+ secs?, took)"
                                 r"\s*" + _FLOAT + r"\s*GiB"),
                      re.compile(_FLOAT + r" GiB for CUDAGraph memory")),
}


def parse_startup_log(text: str) -> dict[str, Any]:
    """Extract the memory numbers of the first start-up in ``text``.

    Args:
        text: the log (any prefix noise such as ``(EngineCore pid=1) INFO`` is fine).
    Returns:
        a dict with any of: weights_gib, kv_cache_gib, total_gib, requested_gib,
        non_torch_gib, activation_gib, cudagraph_gib (floats, GiB), kv_tokens, max_model_len,
        gpu_blocks (ints), concurrency, gpu_memory_utilization (floats).
        Keys whose line is absent are left out.
    """
    out: dict[str, Any] = {}
    for key, patterns in _PATTERNS.items():
        match = next((m for m in (p.search(text) for p in patterns) if m), None)
        if not match:
            continue
        raw = match.group(1).replace(",", "")
        out[key] = int(raw) if key in ("kv_tokens", "max_model_len", "gpu_blocks") else float(raw)
    return out


def measured_from_log(parsed: dict[str, Any]) -> dict[str, int]:
    """Turn :func:`parse_startup_log` output into the planner's ``measured`` bytes.

    Args:
        parsed: the dict from :func:`parse_startup_log`.
    Returns:
        keys of :class:`teamserve_capacity.memory.Measured` in bytes
        (kv_cache_bytes, weights_bytes, non_torch_bytes, activation_bytes,
        cudagraph_bytes, total_memory_bytes).
    """
    names = {"kv_cache_gib": "kv_cache_bytes", "weights_gib": "weights_bytes",
             "non_torch_gib": "non_torch_bytes", "activation_gib": "activation_bytes",
             "cudagraph_gib": "cudagraph_bytes", "total_gib": "total_memory_bytes"}
    out = {names[k]: int(parsed[k] * GIB) for k in names if k in parsed}
    if "consumed_gib" in parsed:
        # vLLM 0.32 summary line: "consumed" is weights + non-torch, and its
        # "peak activation" already includes the CUDA-graph estimate.
        out["weights_bytes"] = int(parsed["consumed_gib"] * GIB)
        out["non_torch_bytes"] = 0
        out["cudagraph_bytes"] = 0
    return out

#!/usr/bin/python
"""Ansible module: the model's weight bytes on the host and the disk's sequential read rate of them (read-only)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: vllm_weights_read
short_description: Sum a model's weight bytes and time a bounded sequential read of its largest shard
description:
  - Sums the bytes of the weight files vLLM's default loader reads from O(path) - the top-level
    C(*.safetensors) files (only those C(model.safetensors.index.json) names, when it exists: vLLM skips
    the duplicates some repositories carry, such as C(consolidated.safetensors)), else C(*.bin), else
    C(*.pt), without training-state files (C(training_args.bin), C(optimizer.pt) ...). Links are followed
    (a Hugging Face snapshot holds links into C(blobs/)).
  - Reads the largest of them from its start, sequentially, in O(block_size) blocks, with C(O_DIRECT) so
    the page cache (which the engine's own read has just filled) does not serve it - at most O(max_bytes)
    bytes and O(max_seconds) seconds - and reports the rate.
  - Where the filesystem refuses C(O_DIRECT) (C(EINVAL); tmpfs, or overlayfs in a container) it reads
    the same way without it and says so (C(direct) false): that rate may be the page cache's, not the disk's.
  - Writes nothing; changed is always false; supports check mode (the read runs there too).
options:
  path:
    description: The directory holding the model's weight files on the host.
    type: path
    required: true
  max_bytes:
    description: Bytes read at most (rounded up to a multiple of 4096).
    type: int
    default: 2147483648
  max_seconds:
    description: Seconds the read runs at most.
    type: float
    default: 20.0
  block_size:
    description: Bytes asked for per read (a multiple of 4096).
    type: int
    default: 8388608
author: teamserve
"""

EXAMPLES = r"""
- name: Time a read of the weights
  vllm_weights_read:
    path: /var/lib/teamserve/vllm/huggingface/hub/models--OWNER--NAME/snapshots/COMMIT
    max_bytes: 2147483648
    max_seconds: 20
  register: weights_read
"""

RETURN = r"""
bytes: {description: Bytes of the weight files vLLM reads (0 when there are none)., returned: always, type: int}
files: {description: Number of those files., returned: always, type: int}
shard: {description: The file read (the largest); null when there is none., returned: always, type: str}
read_bytes: {description: Bytes read from the shard., returned: always, type: int}
read_seconds: {description: Seconds the read took., returned: always, type: float}
read_bytes_per_second:
  description: read_bytes / read_seconds in bytes per second; null when nothing was read.
  returned: always
  type: int
direct: {description: Whether the read bypassed the page cache (O_DIRECT)., returned: always, type: bool}
direct_error: {description: Why O_DIRECT was not used (the OS error), or null., returned: always, type: str}
msg: {description: What was read, in words., returned: always, type: str}
"""

import errno
import fnmatch
import json
import mmap
import os
import time
from collections.abc import Callable
from typing import Any

from ansible.module_utils.basic import AnsibleModule

ALIGN = 4096  # O_DIRECT needs buffer, offset and length aligned to the device's logical block (<= 4 KiB)
PATTERNS = ("*.safetensors", "*.bin", "*.pt")  # vLLM's default loader, in its order of preference
TRAINING_FILES = {"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt", "scaler.pt"}
INDEX = "model.safetensors.index.json"


def weight_files(path: str) -> list[str]:
    """The weight files vLLM's default loader reads from directory ``path`` (absolute paths, sorted): the
    first of PATTERNS with a match at the top level, less TRAINING_FILES; for safetensors, only the files
    named by INDEX when it exists. ``[]`` when the directory is absent or holds none."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    for pattern in PATTERNS:
        chosen = [n for n in names if fnmatch.fnmatch(n, pattern) and n not in TRAINING_FILES
                  and os.path.isfile(os.path.join(path, n))]
        if not chosen:
            continue
        if pattern == "*.safetensors" and INDEX in names:
            try:
                with open(os.path.join(path, INDEX), encoding="utf-8") as handle:
                    indexed = set(json.load(handle)["weight_map"].values())
                chosen = [n for n in chosen if n in indexed] or chosen
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass
        return [os.path.join(path, n) for n in chosen]
    return []


def _read(fd: int, buffer: mmap.mmap, max_bytes: int, max_seconds: float, block_size: int,
          clock: Callable[[], float]) -> tuple[int, float]:
    """Read ``fd`` from its current offset into ``buffer`` until EOF, ``max_bytes`` (rounded up to ALIGN)
    or ``max_seconds``; return (bytes read, seconds)."""
    view = memoryview(buffer)
    total = 0
    start = clock()
    try:
        while total < max_bytes:
            want = min(block_size, -(-(max_bytes - total) // ALIGN) * ALIGN)
            got = os.readv(fd, [view[:want]])
            total += got
            if got < want or clock() - start >= max_seconds:
                break
        return total, clock() - start
    finally:
        view.release()


def read_rate(path: str, max_bytes: int, max_seconds: float, block_size: int = 8 << 20,
              clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Read file ``path`` sequentially from its start, with O_DIRECT where the filesystem allows it.

    Bounds: ``max_bytes`` (bytes, rounded up to 4096), ``max_seconds`` (seconds; checked after each block),
    EOF. ``block_size``: bytes per read, rounded up to 4096. ``clock``: seconds, monotonic (tests pass a
    fake one). Returns ``{"read_bytes": int, "read_seconds": float, "read_bytes_per_second": int or None,
    "direct": bool, "direct_error": str or None}``. EINVAL from O_DIRECT (at open or at the first read)
    falls back to a buffered read from the start; any other OSError is raised.
    """
    block_size = max(ALIGN, -(-block_size // ALIGN) * ALIGN)
    buffer = mmap.mmap(-1, block_size)  # anonymous mappings are page-aligned, as O_DIRECT needs
    direct_error: str | None = None
    try:
        fd = -1
        if hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                # Some filesystems accept the flag at open and refuse the read: probe one aligned block.
                os.readv(fd, [memoryview(buffer)[:ALIGN]])
                os.lseek(fd, 0, os.SEEK_SET)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                direct_error = f"{os.strerror(exc.errno)} (errno {exc.errno})"
                if fd >= 0:
                    os.close(fd)
                fd = -1
        else:  # pragma: no cover - not Linux
            direct_error = "O_DIRECT is not available on this OS"
        direct = fd >= 0
        if not direct:
            fd = os.open(path, os.O_RDONLY)
        try:
            read_bytes, seconds = _read(fd, buffer, max_bytes, max_seconds, block_size, clock)
        finally:
            os.close(fd)
    finally:
        buffer.close()
    return {"read_bytes": read_bytes, "read_seconds": round(seconds, 3),
            "read_bytes_per_second": int(read_bytes / seconds) if read_bytes > 0 and seconds > 0 else None,
            "direct": direct, "direct_error": direct_error}


def measure(path: str, max_bytes: int, max_seconds: float, block_size: int,
            clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """The module's result for weights directory ``path`` (see RETURN); nothing is read when it holds no
    weight files."""
    files = weight_files(path)
    sizes = {f: os.path.getsize(f) for f in files}
    result: dict[str, Any] = {"changed": False, "bytes": sum(sizes.values()), "files": len(files), "shard": None,
                              "read_bytes": 0, "read_seconds": 0.0, "read_bytes_per_second": None,
                              "direct": False, "direct_error": None}
    if not files:
        result["msg"] = f"no weight files ({', '.join(PATTERNS)}) in {path}"
        return result
    result["shard"] = max(files, key=lambda f: (sizes[f], f))
    result.update(read_rate(result["shard"], max_bytes, max_seconds, block_size, clock))
    how = "O_DIRECT" if result["direct"] else f"buffered, O_DIRECT refused: {result['direct_error']}"
    result["msg"] = (f"read {result['read_bytes']} of {sizes[result['shard']]} bytes of {result['shard']} in "
                     f"{result['read_seconds']} s ({how})")
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            path=dict(type="path", required=True),
            max_bytes=dict(type="int", default=2 << 30),
            max_seconds=dict(type="float", default=20.0),
            block_size=dict(type="int", default=8 << 20),
        ),
        supports_check_mode=True,
    )
    params = module.params
    if params["max_bytes"] <= 0 or params["max_seconds"] <= 0 or params["block_size"] <= 0:
        module.fail_json(msg="max_bytes, max_seconds and block_size must be positive")
    try:
        result = measure(params["path"], params["max_bytes"], params["max_seconds"], params["block_size"])
    except OSError as exc:
        module.fail_json(msg=f"reading the weights in {params['path']} failed: {exc}")
    module.exit_json(**result)


if __name__ == "__main__":
    main()

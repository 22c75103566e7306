"""Ansible filter ``vllm_weights_floor``: the cold start's weights-load phase against the disk's floor.

    {{ vllm_weights_read_result | vllm_weights_floor(vllm_cold_start.logged_durations.weights_loading | default(none)) }}

Input: the ``vllm_weights_read`` module's result and the seconds vLLM logged for "Loading weights took".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# A load within 1.5 x the floor runs at the disk's pace (the loader's own overhead, e.g. first-touch of
# mmapped pages, stays below that); under 0.75 x it read faster than the disk, so the page cache served it.
DISK_BOUND_MAX_RATIO = 1.5
CACHED_MAX_RATIO = 0.75

DISK_BOUND = ("the disk, not vLLM, is the limit: a faster disk or keeping the weights in page cache shortens "
              "the cold start")
SLOWER = ("the load is slower than the disk: the time goes elsewhere (deserialisation, the copy to the GPU), "
          "not to the disk")
CACHED = ("the load ran faster than the disk: the weights came from page cache; a start after a reboot (cache "
          "empty) takes about the floor")
BUFFERED = " (buffered read: O_DIRECT refused, so the rate may be the page cache's, not the disk's)"


def _number(value: Any) -> float | None:
    """``value`` as a positive float, or None (absent, null, zero, negative, not a number)."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


def _size(value: float | None) -> str:
    """Bytes in decimal units (GB = 10^9 bytes; MB below 1 GB), or "?"."""
    if value is None:
        return "?"
    return f"{value / 1e9:.2f} GB" if value >= 1e9 else f"{value / 1e6:.1f} MB"


def weights_floor(weights_bytes: Any, read_bytes_per_second: Any, load_seconds: Any, direct: bool = True,
                  threshold: float = DISK_BOUND_MAX_RATIO, error: str | None = None) -> dict[str, Any]:
    """The floor of the weights-load phase and how the logged load compares with it.

    Inputs: ``weights_bytes`` (bytes of the weight files vLLM reads), ``read_bytes_per_second`` (the disk's
    sequential read rate of them, bytes/s), ``load_seconds`` (seconds vLLM logged for "Loading weights
    took"), ``direct`` (whether the rate came from an O_DIRECT read), ``threshold`` (the ratio up to which
    the load counts as running at the disk's pace), ``error`` (why the read failed, if it did).
    Output: ``{"bytes": int|None, "read_bytes_per_second": int|None, "direct": bool, "floor_seconds":
    float|None, "load_seconds": float|None, "ratio": float|None, "verdict": str, "summary": str}`` with
    floor_seconds = weights_bytes / read_bytes_per_second (seconds) and ratio = load_seconds /
    floor_seconds (unitless). Verdict: ratio <= ``threshold``: DISK_BOUND; above: SLOWER; below
    CACHED_MAX_RATIO: CACHED. A missing or zero input gives None for what depends on it and a verdict
    that names what is missing; nothing raises.
    """
    size, rate, load = _number(weights_bytes), _number(read_bytes_per_second), _number(load_seconds)
    exact_floor = size / rate if size and rate else None
    floor = round(exact_floor, 2) if exact_floor else None
    ratio = round(load / exact_floor, 2) if load and exact_floor else None
    if error:
        verdict = f"the read of the weights failed ({error}): no floor"
    elif size is None:
        verdict = "no weight files found on the host (a model inside the image is not measured): no floor"
    elif rate is None:
        verdict = "the read of the weights gave no rate: no floor"
    elif load is None:
        verdict = "the engine logged no \"Loading weights took\" line: no ratio to the floor"
    elif ratio is not None and ratio < CACHED_MAX_RATIO:
        verdict = CACHED
    elif ratio is not None and ratio <= threshold:
        verdict = DISK_BOUND
    else:
        verdict = SLOWER
    if rate is not None and not direct:
        verdict += BUFFERED

    summary = (f"{_size(size)} of weights, load {'?' if load is None else f'{load} s'} (vLLM's log), "
               f"disk read {'?' if rate is None else _size(rate) + '/s ' + ('(O_DIRECT)' if direct else '(buffered)')}, "
               f"floor {'?' if floor is None else f'{floor} s'}, ratio {'?' if ratio is None else ratio}: {verdict}")
    return {"bytes": int(size) if size else None, "read_bytes_per_second": int(rate) if rate else None,
            "direct": bool(direct), "floor_seconds": floor, "load_seconds": load, "ratio": ratio,
            "verdict": verdict, "summary": summary}


def vllm_weights_floor(read: Mapping[str, Any] | None, load_seconds: Any = None,
                       threshold: float = DISK_BOUND_MAX_RATIO) -> dict[str, Any]:
    """``weights_floor`` from a ``vllm_weights_read`` result (``bytes``, ``read_bytes_per_second``,
    ``direct``; a skipped task counts as missing, a failed one gives its message) and the logged load seconds."""
    read = read or {}
    error = str(read.get("msg") or "unknown error") if read.get("failed") else None
    return weights_floor(read.get("bytes"), read.get("read_bytes_per_second"), load_seconds,
                         bool(read.get("direct", False)), threshold, error)


class FilterModule:
    """Ansible filters of the vllm role (cold start)."""

    def filters(self) -> dict[str, Any]:
        return {"vllm_weights_floor": vllm_weights_floor}

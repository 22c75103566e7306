"""Parser of the Prometheus text exposition format, as vLLM's ``GET /metrics`` serves it.

Standard library only: imported by modules on the box and by the controller-side
filters (``ansible_collections.teamserve.core.plugins.module_utils.prometheus``). Format 0.0.4: https://prometheus.io/docs/instrumenting/exposition_formats/
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

# One sample line: name{labels} value [timestamp]. Label values may hold escaped quotes.
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Sample(NamedTuple):
    """One sample: metric name, its labels and its value (the metric's own unit)."""

    name: str
    labels: dict[str, str]
    value: float


def samples(text: str) -> list[Sample]:
    """Every sample of a ``/metrics`` text; comments (``# HELP``, ``# TYPE``) and unparsable lines are skipped.

    Raises TypeError when ``text`` is not a string.
    """
    if not isinstance(text, str):
        raise TypeError(f"expected the /metrics text, got {type(text).__name__}")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        try:
            value = float(match.group(3))  # also "+Inf", "NaN"
        except ValueError:
            continue
        out.append(Sample(match.group(1), dict(_LABEL.findall(match.group(2) or "")), value))
    return out


def value(text: str, name: str) -> float | None:
    """Sum of every sample named exactly ``name`` (all label sets, e.g. one per engine); None if absent."""
    values = [s.value for s in samples(text) if s.name == name]
    return sum(values) if values else None


def histogram(text: str, name: str) -> dict[str, Any]:
    """A histogram summed over its label sets: ``{"count", "sum", "buckets": {upper bound: cumulative count}}``.

    ``name`` is the base name without ``_bucket``/``_count``/``_sum``; bounds are floats (``+Inf`` is
    ``inf``). All zero/empty when the histogram is absent.
    """
    result: dict[str, Any] = {"count": 0.0, "sum": 0.0, "buckets": {}}
    for sample in samples(text):
        if sample.name == f"{name}_count":
            result["count"] += sample.value
        elif sample.name == f"{name}_sum":
            result["sum"] += sample.value
        elif sample.name == f"{name}_bucket" and "le" in sample.labels:
            bound = float(sample.labels["le"])
            result["buckets"][bound] = result["buckets"].get(bound, 0.0) + sample.value
    return result

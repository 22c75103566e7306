"""The status view's per-user counts (tasks/status.yml), as exact integers from the counters' raw samples.

PromQL's increase() cannot give them: it extrapolates to the window's edges (3.03 requests) and only counts
growth between two samples, so a series mtail creates at a user's first event (its first sample already 3)
adds nothing: a burst of refusals that starts the series shows as 0. ``monitoring_counter_counts`` counts
from the raw samples of the window and the last sample before it, as Prometheus holds them.

Plain functions, no Ansible imports: ``tests/unit/test_monitoring_status.py`` tests them directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def _series(metric: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """A series' identity: its labels without the name (functions such as last_over_time drop it)."""
    return tuple(sorted((str(k), str(v)) for k, v in metric.items() if k != "__name__"))


def monitoring_counter_counts(samples: Any, before: Any = None, by: Sequence[str] = ("user",)) -> list[dict[str, Any]]:
    """What each group of a counter counted in a window, from Prometheus's query results.

    ``samples``: the result of ``<counter>[<window>]`` at the instant (a matrix: ``metric`` and ``values``
    [[time, "value"], ...] per series); ``before``: the result of ``last_over_time(<counter>[<w>] offset
    <window>)`` at the same instant (a vector: ``metric`` and ``value`` [time, "value"]), each series' last
    sample before the window. ``by``: the labels to sum over series by.

    Per series: every rise between consecutive samples, the first sample's rise over the series' sample
    before the window, or its whole value when there is none (the series started in the window, from 0),
    and after a drop (the exporter restarted from 0) the new value. Output: ``{"metric": {label: value for
    label in by}, "value": int}`` per group with a sample in the window, sorted by those labels. Counters
    count whole events, so the sums are integral: round() only removes float noise. A non-numeric or
    non-finite sample is skipped. Raises nothing on missing keys or ``None``.
    """
    baseline: dict[tuple[tuple[str, str], ...], float] = {}
    for row in before or []:
        try:
            value = float(row["value"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            continue
        if math.isfinite(value):
            baseline[_series(row.get("metric") or {})] = value
    totals: dict[tuple[str, ...], float] = {}
    for row in samples or []:
        metric = row.get("metric") or {}
        previous = baseline.get(_series(metric), 0.0)
        count = 0.0
        for point in row.get("values") or []:
            try:
                value = float(point[1])
            except (IndexError, TypeError, ValueError):
                continue
            if not math.isfinite(value):
                continue
            count += value - previous if value >= previous else value
            previous = value
        group = tuple(str(metric.get(label, "")) for label in by)
        totals[group] = totals.get(group, 0.0) + count
    return [{"metric": dict(zip(by, group, strict=True)), "value": int(round(total))}
            for group, total in sorted(totals.items())]


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        """Map filter names to functions."""
        return {"monitoring_counter_counts": monitoring_counter_counts}

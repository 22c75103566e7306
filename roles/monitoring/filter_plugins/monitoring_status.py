"""The status view's per-user counts (tasks/status.yml), as exact integers from the counters' raw samples,
the usage report's tokens per user and day (tasks/usage.yml), and a front gateway's view of its boxes.

PromQL's increase() cannot give them: it extrapolates to the window's edges (3.03 requests) and only counts
growth between two samples, so a series mtail creates at a user's first event (its first sample already 3)
adds nothing: a burst of refusals that starts the series shows as 0. ``monitoring_counter_counts`` counts
from the raw samples of the window and the last sample before it, as Prometheus holds them.

Plain functions, no Ansible imports: ``tests/unit/test_monitoring_status.py`` tests them directly.
"""

from __future__ import annotations

import datetime as dt
import math
import re
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


# --- The usage report ---------------------------------------------------------------------------------------
# The usage report's per-user, per-day token counts (tasks/usage.yml, playbooks/usage.yml).
#
# The ledger is Prometheus's own store: the gateway's per-user token counter, ``teamserve_gateway_tokens_total``
# (mtail, from the access log), kept for ``monitoring_prometheus_retention``. A UTC day's tokens are the
# counter's value at the day's end less its value at the day's start, read at the day boundaries (one range
# query of last_over_time(...[1d]) with a one-day step, so a boundary Prometheus missed still reads the day's
# last value), exact while the counter runs on. A day in which the counter restarted from 0
# (mtail restarted) is counted from that day's raw samples instead (``monitoring_counter_counts``, exact too).

DAY_SECONDS = 86_400


_DURATION = re.compile(r"(\d+)(ms|[ywdhms])")
_UNIT_SECONDS = {"y": 365 * DAY_SECONDS, "w": 7 * DAY_SECONDS, "d": DAY_SECONDS, "h": 3600, "m": 60, "s": 1,
                 "ms": 0.001}


def monitoring_duration_days(duration: Any) -> int:
    """Whole days in a Prometheus duration (``30d``, ``720h``, ``1y2w``; units y = 365 d, w, d, h, m, s,
    ms, as Prometheus reads --storage.tsdb.retention.time). Raises ValueError for anything else."""
    text = str(duration).strip()
    parts = _DURATION.findall(text)
    if not text or "".join(n + unit for n, unit in parts) != text:
        raise ValueError(f"{duration!r} is not a Prometheus duration such as 30d or 720h")
    return int(sum(int(n) * _UNIT_SECONDS[unit] for n, unit in parts) // DAY_SECONDS)


def monitoring_usage_boundaries(now: Any, days: Any) -> list[int]:
    """The instants a report of the last ``days`` UTC days reads the counter at.

    Inputs: ``now`` (Unix seconds) and ``days`` (int >= 1, today included). Output: the Unix seconds of
    00:00 UTC of the first day, of each following day, and ``now`` last (today is counted up to now):
    ``days + 1`` ascending instants. Raises ValueError for days < 1.
    """
    count = int(days)
    if count < 1:
        raise ValueError(f"monitoring_usage_days={days!r} must be >= 1 (today included)")
    today = int(float(now)) // DAY_SECONDS * DAY_SECONDS
    return [today - (count - 1 - i) * DAY_SECONDS for i in range(count)] + [int(float(now))]


def _points(results: Any) -> dict[tuple[tuple[str, str], ...], dict[int, float]]:
    """Series -> {Unix second: value} from Prometheus results: matrices (``values``) and vectors (``value``)
    alike, merged by label set (the metric name left out); non-numeric and non-finite samples skipped."""
    out: dict[tuple[tuple[str, str], ...], dict[int, float]] = {}
    for series in results or []:
        labels = tuple(sorted((str(k), str(v)) for k, v in (series.get("metric") or {}).items() if k != "__name__"))
        points = series.get("values") or ([series["value"]] if series.get("value") else [])
        for point in points:
            try:
                at, value = int(float(point[0])), float(point[1])
            except (IndexError, TypeError, ValueError):
                continue
            if math.isfinite(value):
                out.setdefault(labels, {})[at] = value
    return out


def _key(metric: Mapping[str, Any]) -> tuple[str, str]:
    return str(metric.get("user", "")), str(metric.get("kind", ""))


def monitoring_usage_reset_days(resets: Any, boundaries: list[int]) -> list[int]:
    """The indexes of the days whose counter restarted, from ``resets(<counter>[1d])`` read at each day's
    end (matrices and vectors: the value at boundaries[i + 1] covers day i; today's, read at ``now``, covers
    the last 24 hours). Output: sorted day indexes."""
    found: set[int] = set()
    for points in _points(resets).values():
        for i, end in enumerate(boundaries[1:]):
            if points.get(end):
                found.add(i)
    return sorted(found)


def monitoring_usage_rows(values: Any, boundaries: list[int], reset_days: Any = None,
                          raw: Any = None) -> list[dict[str, Any]]:
    """Tokens per UTC day and user.

    ``values``: the counter's value at each boundary (Prometheus results, matrices and vectors alike:
    ``metric`` {user, kind, ...} and ``values`` [[time, "value"], ...] or ``value``; a day's start without a
    sample is a time the series did not exist, read as 0; a day's end without one is not counted).
    ``boundaries``: from ``monitoring_usage_boundaries``. ``reset_days``: the days the counter restarted
    (``monitoring_usage_reset_days``), counted from ``raw`` instead: for each of them in order, the result
    of ``<counter>[<the day>]`` at the day's end, then of ``last_over_time(<counter>[<the day>] offset <the
    day>)`` (``monitoring_counter_counts``'s two inputs). Output: ``{"day": "YYYY-MM-DD", "user", "prompt_tokens",
    "completion_tokens"}`` (ints) per day and user with any token, sorted by day then user. Series of the
    same user and kind (several exporters or label sets) are added up. Raises nothing on missing keys.
    """
    days = len(boundaries) - 1
    totals: dict[tuple[int, str], dict[str, float]] = {}
    raw = list(raw or [])
    replaced = {int(day): monitoring_counter_counts(raw[2 * i] if 2 * i < len(raw) else [],
                                                    raw[2 * i + 1] if 2 * i + 1 < len(raw) else [], ["user", "kind"])
                for i, day in enumerate(reset_days or [])}

    def add(day: int, user: str, kind: str, tokens: float) -> None:
        if kind in ("prompt", "completion") and tokens > 0:
            row = totals.setdefault((day, user), {"prompt": 0.0, "completion": 0.0})
            row[kind] += tokens

    for labels, points in _points(values).items():
        user, kind = _key(dict(labels))
        for day in range(days):
            if day in replaced:
                continue
            start = points.get(boundaries[day], 0.0)
            end = points.get(boundaries[day + 1])
            if end is not None and end >= start:
                add(day, user, kind, end - start)
    for day, counts in replaced.items():
        for row in counts or []:
            user, kind = _key(row.get("metric") or {})
            add(day, user, kind, float(row.get("value") or 0))
    out = []
    for (day, user), kinds in sorted(totals.items()):
        date = dt.datetime.fromtimestamp(boundaries[day], tz=dt.UTC).strftime("%Y-%m-%d")
        out.append({"day": date, "user": user, "prompt_tokens": int(round(kinds["prompt"])),
                    "completion_tokens": int(round(kinds["completion"]))})
    return out


def monitoring_usage_months(rows: Any) -> list[dict[str, Any]]:
    """``monitoring_usage_rows``'s rows summed per calendar month (UTC) and user: ``{"month": "YYYY-MM",
    "user", "prompt_tokens", "completion_tokens", "days"}`` (days with any token), sorted."""
    months: dict[tuple[str, str], dict[str, int]] = {}
    for row in rows or []:
        entry = months.setdefault((row["day"][:7], row["user"]), {"prompt_tokens": 0, "completion_tokens": 0, "days": 0})
        entry["prompt_tokens"] += int(row["prompt_tokens"])
        entry["completion_tokens"] += int(row["completion_tokens"])
        entry["days"] += 1
    return [{"month": month, "user": user, **entry} for (month, user), entry in sorted(months.items())]


def monitoring_usage_csv(rows: Any) -> str:
    """The rows as CSV text with a header line (day,user,prompt_tokens,completion_tokens), newline-ended.
    User names are the gateway's (letters, digits, - and _), so no field needs quoting."""
    lines = ["day,user,prompt_tokens,completion_tokens"]
    lines += [f"{r['day']},{r['user']},{int(r['prompt_tokens'])},{int(r['completion_tokens'])}" for r in rows or []]
    return "\n".join(lines) + "\n"


def _first(results: Any) -> float | None:
    """The first sample's value of an instant-query result (a vector), or None when empty or not a number."""
    try:
        value = float((results or [])[0]["value"][1])
    except (IndexError, KeyError, TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _count(results: Any) -> int | None:
    """``_first`` for a gauge of whole requests (running, waiting): an int, None when absent."""
    value = _first(results)
    return None if value is None else round(value)


def monitoring_fleet_rows(boxes: Any, healthy: Any, statuses: Any = None) -> list[dict[str, Any]]:
    """A front gateway's status view of its boxes, one row per box in the pool's order.

    ``boxes``: ``[{"box": name, "upstream": "host:port", "max_inflight": int}, ...]`` (the front's pool);
    ``healthy``: the front Prometheus's ``caddy_reverse_proxy_upstreams_healthy`` vector (label
    ``upstream``, value 1 healthy or 0 not: Caddy's own health checks); ``statuses``: ``{name:
    monitoring_status}`` for the boxes whose own Prometheus was read in the same run (the status entry
    point's results by figure name), others left out.

    Output per box: ``box``, ``upstream``, ``max_inflight`` (sequences), ``healthy`` (True, False, or None
    when the front has no sample for it), and from the box's own status, None where absent: ``running`` and
    ``waiting`` (requests), ``kv_cache_usage`` (fraction 0-1), ``ttft_p95`` (seconds), ``engine_up`` (bool).
    Raises nothing on missing keys.
    """
    by_upstream = {}
    for row in healthy or []:
        upstream = str((row.get("metric") or {}).get("upstream", ""))
        value = _first([row])
        if value is not None:
            by_upstream[upstream] = value >= 1
    rows = []
    for box in boxes or []:
        own = (statuses or {}).get(box.get("box")) or {}
        up = _first(own.get("engine_up"))
        rows.append({
            "box": box.get("box"), "upstream": box.get("upstream"), "max_inflight": box.get("max_inflight"),
            "healthy": by_upstream.get(str(box.get("upstream"))),
            "engine_up": None if up is None else up >= 1,
            "running": _count(own.get("running")), "waiting": _count(own.get("waiting")),
            "kv_cache_usage": _first(own.get("kv_cache_usage")), "ttft_p95": _first(own.get("ttft_p95")),
        })
    return rows


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        """Map filter names to functions."""
        return {"monitoring_counter_counts": monitoring_counter_counts,
                "monitoring_fleet_rows": monitoring_fleet_rows,
                "monitoring_duration_days": monitoring_duration_days,
                "monitoring_usage_boundaries": monitoring_usage_boundaries,
                "monitoring_usage_reset_days": monitoring_usage_reset_days,
                "monitoring_usage_rows": monitoring_usage_rows,
                "monitoring_usage_months": monitoring_usage_months,
                "monitoring_usage_csv": monitoring_usage_csv}

"""The usage report's per-user, per-day token counts (tasks/usage.yml, playbooks/usage.yml).

The ledger is Prometheus's own store: the gateway's per-user token counter, ``teamserve_gateway_tokens_total``
(mtail, from the access log), kept for ``monitoring_prometheus_retention``. A UTC day's tokens are the
counter's value at the day's end less its value at the day's start, read at the day boundaries (one range
query with a one-day step), exact while the counter runs on. A day in which the counter restarted from 0
(mtail restarted) is counted from that day's raw samples instead (``monitoring_counter_counts``, exact too).

Plain functions, no Ansible imports: ``tests/unit/test_monitoring_usage.py`` tests them directly.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping
from typing import Any

DAY_SECONDS = 86_400


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


def monitoring_usage_rows(values: Any, boundaries: list[int], exact_days: Any = None) -> list[dict[str, Any]]:
    """Tokens per UTC day and user.

    ``values``: the counter's value at each boundary (Prometheus results, matrices and vectors alike:
    ``metric`` {user, kind, ...} and ``values`` [[time, "value"], ...] or ``value``; a day's start without a
    sample is a time the series did not exist, read as 0; a day's end without one is not counted).
    ``boundaries``: from ``monitoring_usage_boundaries``. ``exact_days``: {day index: the output of
    ``monitoring_counter_counts(..., by=["user", "kind"])`` for that day} for the days the counter
    restarted; those days are taken from it. Output: ``{"day": "YYYY-MM-DD", "user", "prompt_tokens",
    "completion_tokens"}`` (ints) per day and user with any token, sorted by day then user. Series of the
    same user and kind (several exporters or label sets) are added up. Raises nothing on missing keys.
    """
    days = len(boundaries) - 1
    totals: dict[tuple[int, str], dict[str, float]] = {}
    replaced = {int(k): v for k, v in (exact_days or {}).items()}

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


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        """Map filter names to functions."""
        return {"monitoring_usage_boundaries": monitoring_usage_boundaries,
                "monitoring_usage_reset_days": monitoring_usage_reset_days,
                "monitoring_usage_rows": monitoring_usage_rows,
                "monitoring_usage_months": monitoring_usage_months,
                "monitoring_usage_csv": monitoring_usage_csv}

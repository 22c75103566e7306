"""A checklist record: one check's verdict, as every ``verify_check_*`` filter returns it::

    {"id": int, "name": str, "status": "PASS" | "FAIL" | "SKIP", "summary": str,
     "measured": {...}, "target": {...}, "reason": str (SKIP only)}

The nine checks and their numbers are the deployment checklist's (roles/teamserve_verify/README.md).
"""

from __future__ import annotations

from typing import Any

Record = dict[str, Any]

NAMES = {
    1: "capacity arithmetic",
    2: "engine, model and flags at the pin",
    3: "TTFT and TPOT targets",
    4: "load test at 1x and 2x",
    5: "long prompt while others stream",
    6: "per-user rate limits",
    7: "cold start",
    8: "own evaluation set",
    9: "unreachable from outside the LAN",
}


def record(check_id: int, status: str, summary: str, **details: Any) -> Record:
    """A check's record: id, its name, PASS/FAIL/SKIP, a one-line summary, then ``details``."""
    return {"id": check_id, "name": NAMES[check_id], "status": status, "summary": " ".join(summary.split()),
            **details}


def skipped(check_id: int, summary: str, reason: str) -> Record:
    """A SKIP record; ``reason`` names the setting that skipped it."""
    return record(check_id, "SKIP", summary, reason=reason)

"""Filter of a run's drain: the Retry-After users get while the gateway drains (``teamserve_retry_after``).

    {{ history_lines | teamserve_retry_after(60) }}
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any


def teamserve_retry_after(lines: Iterable[str], fallback: Any) -> int:
    """Seconds until the engine is expected back, from the box's cold-start history.

    Input: the lines of the vllm role's ``vllm_cold_start_history`` (JSON objects with ``trigger``,
    ``deploy`` or ``restart``, and ``seconds_to_health``); ``fallback`` (seconds) when no start was
    measured. Output: the last ``deploy`` start's seconds to /health rounded up (an upgrade recreates
    the engine the way a deploy does), else the last ``restart``'s, else ``fallback``; at least 1.
    Lines that are not JSON objects with a numeric ``seconds_to_health`` are skipped.
    """
    last: dict[str, float] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        seconds = record.get("seconds_to_health") if isinstance(record, dict) else None
        if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds > 0:
            last[str(record.get("trigger"))] = float(seconds)
    for trigger in ("deploy", "restart"):
        if trigger in last:
            return max(1, math.ceil(last[trigger]))
    return max(1, int(fallback))


class FilterModule:
    """Registers teamserve_retry_after."""

    def filters(self) -> dict[str, Any]:
        return {"teamserve_retry_after": teamserve_retry_after}

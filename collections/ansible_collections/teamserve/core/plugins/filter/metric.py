"""One value from a ``/metrics`` text (vLLM's or Caddy's), for tasks that read one gauge:

    {{ metrics.content | teamserve.core.metric('vllm:num_requests_running') }}
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

from ansible_collections.teamserve.core.plugins.module_utils import prometheus


def metric(text: Any, name: str) -> float | None:
    """Sum of every sample named ``name`` (all label sets) in a ``/metrics`` text, in the metric's own unit;
    None when absent. Raises AnsibleFilterError when ``text`` is not a string (the scrape returned nothing)."""
    if not isinstance(text, str):
        raise AnsibleFilterError(f"metric: expected the /metrics text, got {type(text).__name__}")
    value: float | None = prometheus.value(text, name)
    return value


class FilterModule:
    """``teamserve.core.metric``."""

    def filters(self) -> dict[str, Any]:
        return {"metric": metric}

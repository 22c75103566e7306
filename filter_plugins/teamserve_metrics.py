"""Filter ``teamserve_metric``: one value from vLLM's ``GET /metrics`` text, on the controller.

    {{ metrics.content | teamserve_metric('vllm:num_requests_running') }}

Sum of every sample of that name (all label sets, e.g. one per engine), in the metric's own unit; none
when the metric is absent. The parser is the project's shared one, ``module_utils/teamserve_prometheus.py``
(found through ansible.cfg ``module_utils``), which modules on the box import as well.
"""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType
from typing import Any

from ansible import constants as C
from ansible.errors import AnsibleFilterError

_NAME = "teamserve_prometheus"


def _parser() -> ModuleType:
    """Import module_utils/teamserve_prometheus.py from Ansible's module_utils paths (once)."""
    key = f"ansible.module_utils.{_NAME}"
    if key in sys.modules:
        return sys.modules[key]
    for directory in C.DEFAULT_MODULE_UTILS_PATH or []:
        spec = importlib.util.spec_from_file_location(key, f"{directory}/{_NAME}.py")
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except FileNotFoundError:
            continue
        sys.modules[key] = module
        return module
    raise AnsibleFilterError(f"{_NAME}.py is not in the module_utils paths {C.DEFAULT_MODULE_UTILS_PATH}; "
                             "run with the project's ansible.cfg (module_utils = module_utils)")


def teamserve_metric(text: Any, name: str) -> float | None:
    """Sum of the samples named ``name`` in a /metrics text; None when absent. Raises AnsibleFilterError
    when ``text`` is not a string (e.g. the scrape failed and returned no content)."""
    if not isinstance(text, str):
        raise AnsibleFilterError(f"teamserve_metric: expected the /metrics text, got {type(text).__name__}")
    value: float | None = _parser().value(text, name)
    return value


class FilterModule:
    """Registers teamserve_metric."""

    def filters(self) -> dict[str, Any]:
        return {"teamserve_metric": teamserve_metric}

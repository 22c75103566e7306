"""teamserve capacity planner: from a model's config.json and the GPU to vLLM flags.

Plain Python, standard library only; used by the ``teamserve-plan`` CLI, the
Ansible filter ``teamserve_capacity_plan`` (roles/vllm/filter_plugins) and the
report ``site.yml`` prints.
"""

from .errors import PlanError
from .kv import KVLayout, kv_layout
from .logs import measured_from_log, parse_startup_log
from .memory import GIB, MIB
from .model import ModelSpec, estimate_params, parse_config
from .planner import PINNED_VLLM, plan

__all__ = [
    "GIB", "MIB", "KVLayout", "ModelSpec", "PINNED_VLLM", "PlanError", "estimate_params",
    "kv_layout", "measured_from_log", "parse_config", "parse_startup_log", "plan",
]
__version__ = "0.1.0"

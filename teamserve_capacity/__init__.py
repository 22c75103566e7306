"""teamserve capacity planner: from a model's config.json and the GPU to vLLM flags.

Plain Python, standard library only; used by the ``teamserve-plan`` CLI, the
Ansible filter ``teamserve_capacity_plan`` (roles/vllm/filter_plugins) and the
report ``site.yml`` prints.
"""

from .errors import PlanError
from .gpus import GPU_TABLE, GPUModel, find_gpu
from .kv import KVLayout, kv_layout
from .logs import measured_from_log, parse_startup_log
from .memory import GIB, MIB
from .model import ModelSpec, parse_config
from .planner import PINNED_VLLM, SUPPORTED_VLLM, plan
from .weights import checkpoint_total, estimate_params, estimate_weights, quant_from_config

__all__ = [
    "GIB", "GPU_TABLE", "GPUModel", "MIB", "KVLayout", "ModelSpec", "PINNED_VLLM", "PlanError", "SUPPORTED_VLLM",
    "checkpoint_total", "estimate_params", "estimate_weights", "find_gpu", "kv_layout",
    "measured_from_log", "parse_config", "parse_startup_log", "plan", "quant_from_config",
]
__version__ = "0.1.0"

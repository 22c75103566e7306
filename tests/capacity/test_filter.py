"""The Ansible filter wraps the planner and turns PlanError into AnsibleFilterError."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError

from .conftest import ENGINE, RTX_PRO_6000

PLUGIN = Path(__file__).resolve().parents[2] / "roles/vllm/filter_plugins/capacity.py"


def _filters():
    spec = importlib.util.spec_from_file_location("capacity_filter", PLUGIN)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module.FilterModule().filters()


def test_filter_plans_testbed_model(tiny_model, workload) -> None:
    result = _filters()["teamserve_capacity_plan"](tiny_model, workload, [RTX_PRO_6000], ENGINE)
    assert result["fits"] is True
    assert set(result) >= {"fits", "verdict", "levers", "table", "numbers", "flags"}
    assert set(result["flags"]) >= {"max-model-len", "max-num-seqs", "gpu-memory-utilization",
                                    "kv-cache-dtype", "max-num-batched-tokens", "enable-prefix-caching",
                                    "enable-chunked-prefill", "tensor-parallel-size", "quantization"}


def test_filter_error_carries_planner_message(tiny_model, workload) -> None:
    tiny_model["config"]["num_hidden_layers"] = 0
    with pytest.raises(AnsibleFilterError, match=r"config\.num_hidden_layers: 0"):
        _filters()["teamserve_capacity_plan"](tiny_model, workload, [RTX_PRO_6000], ENGINE)

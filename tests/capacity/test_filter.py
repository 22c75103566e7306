"""The Ansible filter wraps the planner and turns PlanError into AnsibleFilterError."""

from __future__ import annotations

import importlib.util
import json
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


def _snapshot_module():
    path = Path(__file__).resolve().parents[2] / "roles/vllm/library/vllm_hf_snapshot.py"
    spec = importlib.util.spec_from_file_location("vllm_hf_snapshot_capacity", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


REV = "0e9e39f249a16976918f6564b8830bc894c89659"


def test_snapshot_module_reports_the_checkpoint_for_the_plan(tmp_path, tiny_model, workload) -> None:
    """Before the download the hub's tree listing gives the files' sizes; after it, the local index."""
    storage = tmp_path / "hub" / "models--teamserve--tiny-llama"
    (storage / "trees").mkdir(parents=True)
    listing = {"config.json": 700, "model-00001-of-00002.safetensors": 4_000_000_000,
               "model-00002-of-00002.safetensors": 2_500_000_000, "original/consolidated.00.pth": 9}
    (storage / "trees" / f"{REV}.json").write_text(json.dumps(
        {"format_version": 1, "files": {p: {"size": n, "blob_id": "0" * 40} for p, n in listing.items()}}))
    module = _snapshot_module()
    status = module.snapshot_status(str(tmp_path / "hub"), "teamserve/tiny-llama", REV, ["original/"])
    assert not status["complete"]
    assert status["checkpoint"] == {"total_size": 6_500_000_000, "source": "2 safetensors files",
                                    "origin": "hub tree listing", "revision": REV}
    snapshot = storage / "snapshots" / REV
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 6_499_990_000}, "weight_map": {}}))
    status = module.snapshot_status(str(tmp_path / "hub"), "teamserve/tiny-llama", REV, ["original/"])
    assert status["checkpoint"]["total_size"] == 6_499_990_000
    assert status["checkpoint"]["origin"] == "local HF cache"
    tiny_model["checkpoint"] = status["checkpoint"]
    result = _filters()["teamserve_capacity_plan"](tiny_model, workload, [RTX_PRO_6000], ENGINE)
    assert result["numbers"]["weights_source"] == ("checkpoint: safetensors index metadata.total_size "
                                                   f"(local HF cache @{REV[:12]})")
    assert module.snapshot_status(str(tmp_path / "none"), "teamserve/tiny-llama", REV)["checkpoint"] == {}


def test_filter_passes_the_trust_flag(tiny_model, workload) -> None:
    result = _filters()["teamserve_capacity_plan"](tiny_model, workload, [RTX_PRO_6000],
                                                   dict(ENGINE, users_trust_each_other=False))
    assert [a["id"] for a in result["advice"]] == ["untrusted_users"]


def test_plan_changes_name_each_flag_that_differs():
    """What site.yml's preflight says when the plan differs from the one the engine runs."""
    changes = _filters()["teamserve_plan_changes"]
    recorded = {"max-num-seqs": 8, "max-model-len": 2048, "kv-cache-dtype": "auto"}
    assert changes(recorded, dict(recorded)) == []
    assert changes(recorded, {"max-num-seqs": 16, "max-model-len": 2048, "enable-prefix-caching": True}) == [
        "enable-prefix-caching: (none) -> True", "kv-cache-dtype: auto -> (none)", "max-num-seqs: 8 -> 16"]
    assert changes({}, {"max-num-seqs": 8}) == ["max-num-seqs: (none) -> 8"]

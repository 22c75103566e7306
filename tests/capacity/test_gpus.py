"""The GPU table: memory as vLLM sees it, compute capability, product class, and its use in plans."""

from __future__ import annotations

import math

import pytest

from teamserve_capacity import GIB, GPU_TABLE, MIB, find_gpu, plan
from teamserve_capacity.gpus import DEFAULT_RESERVED_MIB, gpu_row, is_geforce, vllm_total

from .conftest import ENGINE, RTX_PRO_6000, tiny_llama_config

WL = {"concurrent_sequences": 8, "avg_context_tokens": 1000, "max_context_tokens": 2048}

# key -> (nvidia-smi memory.total MiB, vLLM's total GiB or None if estimated, compute capability, class)
EXPECTED = {
    "rtx-pro-6000": (97887, 94.97, "12.0", "workstation"),
    "h200": (143771, 139.80, "9.0", "datacenter"),
    "h100-80gb": (81559, 79.18, "9.0", "datacenter"),
    "a100-80gb": (81920, 79.15, "8.0", "datacenter"),
    "a100-40gb": (40960, None, "8.0", "datacenter"),
    "l40s": (46068, 44.42, "8.9", "datacenter"),
    "l4": (23034, None, "8.9", "datacenter"),
    "rtx-6000-ada": (49140, None, "8.9", "workstation"),
    "rtx-5090": (32607, None, "12.0", "geforce"),
    "rtx-4090": (24564, 23.65, "8.9", "geforce"),
    "rtx-3090": (24576, 23.58, "8.6", "geforce"),
}


def test_the_table_lists_the_documented_cards() -> None:
    assert [g.key for g in GPU_TABLE] == list(EXPECTED)


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_entry(key: str) -> None:
    mib, gib, cap, cls = EXPECTED[key]
    gpu = find_gpu(key)
    assert gpu is not None and find_gpu(gpu.names[0]) is gpu and find_gpu(gpu.names[0].upper()) is gpu
    row = gpu_row(gpu)
    assert (row["memory_total_mib"], row["compute_cap"], gpu.gpu_class) == (mib, cap, cls)
    assert gpu.measured is (gib is not None) and gpu.source
    if gib is None:
        assert gpu.total_bytes == (mib - DEFAULT_RESERVED_MIB) * MIB and gpu.source == "estimated"
    else:
        assert gpu.total_bytes == round(gib * GIB)
        assert 300 * MIB < mib * MIB - gpu.total_bytes <= DEFAULT_RESERVED_MIB * MIB  # reservations measured


def test_default_reservation_is_the_largest_measured() -> None:
    largest = max(math.ceil(g.nvidia_smi_mib - g.total_bytes / MIB) for g in GPU_TABLE if g.measured)
    assert largest == DEFAULT_RESERVED_MIB


def test_vllm_total_uses_the_table_only_for_the_matching_card() -> None:
    total, source, gpu = vllm_total("NVIDIA A100-SXM4-80GB", 81920)
    assert total == round(79.15 * GIB) and source.startswith("79.15 GiB measured") and gpu is not None
    # the same name with another total (a MIG slice, ECC toggled): nvidia-smi minus the default reservation
    total, source, _ = vllm_total("NVIDIA A100-SXM4-80GB", 40192)
    assert total == (40192 - DEFAULT_RESERVED_MIB) * MIB and source.startswith("estimated")
    total, _, gpu = vllm_total("Some Future GPU", 65536)
    assert gpu is None and total == (65536 - DEFAULT_RESERVED_MIB) * MIB


def test_geforce_by_table_or_name() -> None:
    assert is_geforce("NVIDIA GeForce RTX 4090") and is_geforce("NVIDIA GeForce RTX 2080 Ti")
    assert not is_geforce("NVIDIA RTX PRO 6000 Blackwell Workstation Edition") and not is_geforce("NVIDIA L4")


def test_plans_use_the_memory_vllm_sees() -> None:
    model = {"name": "tiny", "config": tiny_llama_config(), "weight_format": "bf16"}
    for key, (_, gib, _, cls) in EXPECTED.items():
        gpu = find_gpu(key)
        assert gpu is not None
        numbers = plan(model, WL, [gpu_row(gpu)], ENGINE)["numbers"]
        assert numbers["gpu_total_gib"] == round(gpu.total_bytes / GIB, 2)
        assert numbers["gpu_class"] == cls and numbers["compute_cap"] == EXPECTED[key][2]
        assert (numbers["sources"]["total"].startswith("estimated")) is (gib is None)
    # the role's default GPU is the table's RTX PRO 6000
    assert plan(model, WL, [RTX_PRO_6000], ENGINE)["numbers"]["gpu_total_gib"] == 94.97


# Measured on an H200, driver 580.159.04, PyTorch 2.11.0+cu130: nvidia-smi memory.total and memory.reserved
# (MiB), and torch.cuda.mem_get_info()'s total (bytes), the figure vLLM multiplies by --gpu-memory-utilization.
H200_SMI_TOTAL_MIB, H200_SMI_RESERVED_MIB, H200_TORCH_TOTAL_BYTES = 143771, 616, 150_109_880_320
H200_ROW = {"index": 0, "name": "NVIDIA H200", "memory_total_mib": H200_SMI_TOTAL_MIB, "compute_cap": "9.0",
            "driver_version": "580.159.04"}


def test_total_minus_reserved_is_what_pytorch_sees_on_an_h200() -> None:
    total, source, gpu = vllm_total("NVIDIA H200", H200_SMI_TOTAL_MIB, H200_SMI_RESERVED_MIB)
    assert total == 143_155 * MIB and gpu is not None and gpu.key == "h200"
    assert 0 <= H200_TORCH_TOTAL_BYTES - total < MIB  # within 1 MiB, and never more than the card has
    assert "memory.reserved 616 MiB" in source
    # the table's 139.80 GiB is the same card, and implies the same reservation
    assert gpu.implied_reserved_mib == H200_SMI_RESERVED_MIB
    # the default reservation it replaces for unlisted cards cost 255 MiB here
    estimated, _, _ = vllm_total("Some H200-class card", H200_SMI_TOTAL_MIB)
    assert (total - estimated) // MIB == DEFAULT_RESERVED_MIB - H200_SMI_RESERVED_MIB == 255


@pytest.mark.parametrize(("name", "total_mib"), [
    ("Some Future GPU", 65536),          # not in the table
    ("NVIDIA A100-SXM4-80GB", 40192),    # a known name with another total (a MIG slice)
    ("NVIDIA L40S", 46068),              # a measured card: the box's figure wins over the table's
])
def test_reserved_gives_the_total_on_any_card(name: str, total_mib: int) -> None:
    total, source, _ = vllm_total(name, total_mib, 500)
    assert total == (total_mib - 500) * MIB and source.startswith("nvidia-smi: memory.total")


def test_plans_use_the_boxs_reserved_and_fall_back_to_the_table_without_it() -> None:
    model = {"name": "tiny", "config": tiny_llama_config(), "weight_format": "bf16"}
    exact = plan(model, WL, [dict(H200_ROW, memory_reserved_mib=616)], ENGINE)["numbers"]
    assert exact["gpu_total_gib"] == round(143_155 * MIB / GIB, 2)
    assert exact["sources"]["total"].startswith("nvidia-smi: memory.total 143,771 MiB - memory.reserved 616 MiB")
    # a GPU list recorded before the field was read (no key), or [N/A] published as null: the table
    for row in (H200_ROW, dict(H200_ROW, memory_reserved_mib=None)):
        numbers = plan(model, WL, [row], ENGINE)["numbers"]
        assert numbers["sources"]["total"].startswith("139.80 GiB measured")
    # an unlisted card: the box's figure instead of the 871 MiB estimate
    unlisted = dict(H200_ROW, name="Some Future GPU")
    assert plan(model, WL, [unlisted], ENGINE)["numbers"]["sources"]["total"].startswith("estimated")
    with_reserved = plan(model, WL, [dict(unlisted, memory_reserved_mib=616)], ENGINE)["numbers"]
    assert with_reserved["kv_budget_bytes"] > plan(model, WL, [unlisted], ENGINE)["numbers"]["kv_budget_bytes"]


def test_the_smallest_exact_total_of_a_tensor_parallel_pair_wins() -> None:
    model = {"name": "tiny", "config": tiny_llama_config(), "weight_format": "bf16"}
    rows = [dict(H200_ROW, memory_reserved_mib=616), dict(H200_ROW, index=1, memory_reserved_mib=700)]
    numbers = plan(model, WL, rows, dict(ENGINE, tensor_parallel_size=2))["numbers"]
    assert numbers["gpu_total_gib"] == round((143_771 - 700) * MIB / GIB, 2)

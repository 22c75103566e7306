"""The three profiles the example inventory ships, planned through Ansible as the vllm role plans them.

``plan_profiles.yml`` runs ansible-playbook against ``inventories/example`` (its group_vars, the
config.json each profile reads with a lookup, the role's defaults and its filter plugin), so a profile
that stops loading, stops fitting or drifts from README's "Capacity plans" table fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from repo_modules import example_profile_plans  # noqa: E402

# README "Capacity plans": weights GiB, left for KV GiB, KV bytes per token, sequences at the average
# context, sequences at the maximum context, the maximum context (--max-model-len), the advice ids.
README_TABLE = {
    "llama-3.1-8b-bf16": (14.96, 69.40, 128 * 1024, 71, 17, 32_768, []),
    "qwen3-32b-fp8": (31.97, 51.82, 256 * 1024, 26, 6, 32_768, []),
    "gpt-oss-120b-mxfp4": (64.38, 20.12, 72 * 1024, 18, 3, 131_072, ["few_full_length"]),
}


@pytest.fixture(scope="module")
def plans() -> dict[str, dict[str, Any]]:
    """Each profile's plan, as the vllm role's filter returns it, by profile name."""
    return example_profile_plans()


def test_the_inventory_ships_the_readme_profiles(plans: dict[str, dict[str, Any]]) -> None:
    assert sorted(plans) == sorted(README_TABLE)


@pytest.mark.parametrize("profile", sorted(README_TABLE))
def test_profile_plans_to_the_readme_numbers(plans: dict[str, dict[str, Any]], profile: str) -> None:
    weights_gib, kv_gib, kv_token, seqs_avg, seqs_max, max_len, advice = README_TABLE[profile]
    result = plans[profile]
    numbers = result["numbers"]
    assert result["fits"] is True, result["table"]
    assert numbers["requested_gib"] == 85.47  # 94.97 GiB (the GPU table's RTX PRO 6000) x 0.90
    assert numbers["weights_gib"] == weights_gib
    assert numbers["kv_budget_gib"] == kv_gib
    assert numbers["kv_bytes_per_token"] == kv_token
    assert numbers["max_concurrency_avg"] == seqs_avg
    assert numbers["max_concurrency_max"] == seqs_max
    assert result["flags"]["max-model-len"] == max_len
    assert [a["id"] for a in result["advice"]] == advice

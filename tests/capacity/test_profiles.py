"""The three 96 GB example profiles plan and fit on the RTX PRO 6000 Blackwell."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from teamserve_capacity import plan

from .conftest import RTX_PRO_6000

PROFILES = sorted((Path(__file__).parent / "fixtures/profiles").glob("*.yml"))


@pytest.mark.parametrize("path", PROFILES, ids=[p.stem for p in PROFILES])
def test_profile_fits_96gb(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    result = plan(doc["vllm_model"], doc["vllm_workload"], [RTX_PRO_6000], doc["vllm_engine"])
    assert result["fits"], result["table"]
    assert result["flags"]["max-model-len"] <= doc["vllm_workload"]["max_context_tokens"]


def test_three_profiles() -> None:
    assert len(PROFILES) == 3

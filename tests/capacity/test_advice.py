"""Advice printed with a plan appears exactly when its condition holds."""

from __future__ import annotations

from typing import Any

import pytest

from teamserve_capacity import plan
from teamserve_capacity.advice import FEW_SEQUENCES, FULL_LENGTH_MIN, advise

from .conftest import ENGINE, RTX_PRO_6000, load_config

GEFORCE = {"index": 0, "name": "NVIDIA GeForce RTX 4090", "memory_total_mib": 24564, "compute_cap": "8.9"}
LLAMA = {"name": "l", "config": load_config("meta-llama--Llama-3.1-8B-Instruct"), "weight_bytes": 16060522496}


def _ids(**kw: Any) -> list[str]:
    args: dict[str, Any] = {"concurrent_sequences": 16, "gpu_names": ["NVIDIA L40S"], "geforce": False,
                            "users_trust_each_other": True, "full_length_fit": 10, "max_model_len": 32768,
                            "fits": True}
    args.update(kw)
    return [a["id"] for a in advise(**args)]


def test_none_for_a_healthy_plan() -> None:
    assert _ids() == []


@pytest.mark.parametrize(("seqs", "expected"), [(1, True), (FEW_SEQUENCES - 1, True), (FEW_SEQUENCES, False)])
def test_few_sequences(seqs: int, expected: bool) -> None:
    assert ("few_sequences" in _ids(concurrent_sequences=seqs)) is expected


def test_geforce_licence_note_is_not_legal_advice() -> None:
    advice = advise(concurrent_sequences=16, gpu_names=["NVIDIA GeForce RTX 5090"], geforce=True,
                    users_trust_each_other=True, full_length_fit=10, max_model_len=32768, fits=True)
    assert [a["id"] for a in advice] == ["geforce_licence"]
    assert "not legal advice" in advice[0]["advice"] and "datacenter" in advice[0]["reason"]


def test_untrusted_users_get_the_cache_salt_lever() -> None:
    advice = advise(concurrent_sequences=16, gpu_names=["NVIDIA L40S"], geforce=False,
                    users_trust_each_other=False, full_length_fit=10, max_model_len=32768, fits=True)
    assert [a["id"] for a in advice] == ["untrusted_users"]
    assert "cache_salt" in advice[0]["advice"] and "enable-prefix-caching: false" in advice[0]["advice"]
    assert "prefix" in advice[0]["reason"]


@pytest.mark.parametrize(("fit", "fits", "expected"), [
    (1, True, True), (FULL_LENGTH_MIN - 1, True, True), (FULL_LENGTH_MIN, True, False), (2, False, False),
])
def test_few_full_length_requests(fit: int, fits: bool, expected: bool) -> None:
    assert ("few_full_length" in _ids(full_length_fit=fit, fits=fits)) is expected


def test_every_advice_has_a_reason() -> None:
    advice = advise(concurrent_sequences=1, gpu_names=["NVIDIA GeForce RTX 3090"], geforce=True,
                    users_trust_each_other=False, full_length_fit=1, max_model_len=131072, fits=True)
    assert [a["id"] for a in advice] == ["few_sequences", "geforce_licence", "untrusted_users", "few_full_length"]
    assert all(a["advice"] and a["reason"] for a in advice)


def test_plan_wires_the_conditions() -> None:
    wl = {"concurrent_sequences": 2, "avg_context_tokens": 4000, "max_context_tokens": 32768}
    result = plan(LLAMA, wl, [GEFORCE], dict(ENGINE, users_trust_each_other=False))
    assert [a["id"] for a in result["advice"]] == ["few_sequences", "geforce_licence", "untrusted_users",
                                                   "few_full_length"]
    assert result["numbers"]["max_concurrency_max"] < FULL_LENGTH_MIN
    assert "advice" in result["table"] and "because" in result["table"]
    healthy = plan(LLAMA, dict(wl, concurrent_sequences=16), [RTX_PRO_6000], ENGINE)
    assert healthy["advice"] == [] and "advice" not in healthy["table"]


def test_trust_flag_must_be_a_bool() -> None:
    wl = {"concurrent_sequences": 8, "avg_context_tokens": 1000, "max_context_tokens": 4096}
    with pytest.raises(Exception, match="vllm_engine.users_trust_each_other"):
        plan(LLAMA, wl, [RTX_PRO_6000], dict(ENGINE, users_trust_each_other="no"))

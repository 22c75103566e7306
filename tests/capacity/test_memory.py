"""The profile-run memory model against the numbers real vLLM logs print."""

from __future__ import annotations

import pytest

from teamserve_capacity import GIB
from teamserve_capacity.memory import (
    SORT_SAMPLER_BYTES_PER_LOGIT,
    activation_bytes_per_token,
    estimate_budget,
    profile_peak_bytes,
    sampler_peak_bytes,
)
from teamserve_capacity.model import parse_config

from .conftest import load_config


def _spec(name: str):
    return parse_config(load_config(name))


@pytest.mark.parametrize(("tokens", "logged_gib"), [(20_000, 17.06 - 14.9888), (29_000, 17.98 - 14.9888)])
def test_eager_forward_peak_matches_v0_logs(tokens: int, logged_gib: float) -> None:
    """V0 ran Llama uncompiled: 3H + 3I per token (vLLM issue #10517, RTX 3090)."""
    spec = _spec("meta-llama--Llama-3.1-8B-Instruct")
    peak = profile_peak_bytes(spec, tensor_parallel_size=1, max_num_batched_tokens=tokens, max_num_seqs=256,
                              act_bytes=2, eager=True, bytes_per_logit=SORT_SAMPLER_BYTES_PER_LOGIT)
    assert abs(peak / GIB - logged_gib) < 0.02


@pytest.mark.parametrize(("name", "logged_gib"), [
    ("meta-llama--Llama-3.1-8B-Instruct", 4.76), ("Qwen--Qwen3-0.6B", 5.56),
    ("Qwen--Qwen3-32B", 5.64), ("openai--gpt-oss-20b", 7.38)])
def test_sampler_phase_matches_v1_h100_logs(name: str, logged_gib: float) -> None:
    """vLLM 0.11 on H100 (llm-d logs): 8192 tokens, 1024 sequences, sort-based sampler dominates."""
    spec = _spec(name)
    peak = profile_peak_bytes(spec, tensor_parallel_size=1, max_num_batched_tokens=8192, max_num_seqs=1024,
                              act_bytes=2, bytes_per_logit=SORT_SAMPLER_BYTES_PER_LOGIT)
    sampler = sampler_peak_bytes(spec, max_num_batched_tokens=8192, max_num_seqs=1024, act_bytes=2,
                                 bytes_per_logit=SORT_SAMPLER_BYTES_PER_LOGIT)
    assert peak == sampler
    assert abs(peak / GIB - logged_gib) / logged_gib < 0.02


def test_peak_is_the_larger_phase_not_the_sum() -> None:
    spec = _spec("meta-llama--Llama-3.1-8B-Instruct")
    forward = 32_768 * activation_bytes_per_token(spec, 1, 2)
    sampler = sampler_peak_bytes(spec, max_num_batched_tokens=32_768, max_num_seqs=8, act_bytes=2)
    peak = profile_peak_bytes(spec, tensor_parallel_size=1, max_num_batched_tokens=32_768, max_num_seqs=8,
                              act_bytes=2)
    assert forward > sampler and peak == forward


def test_compiled_forward_is_smaller_than_eager() -> None:
    spec = _spec("meta-llama--Llama-3.1-8B-Instruct")
    # H + 3I vs 3H + 3I elements, 2 bytes each
    assert activation_bytes_per_token(spec, 1, 2) == (4096 + 3 * 14336) * 2
    assert activation_bytes_per_token(spec, 1, 2, eager=True) == (3 * 4096 + 3 * 14336) * 2


def test_more_planned_sequences_never_leave_more_kv_budget() -> None:
    """The sampler's dummy run grows with --max-num-seqs, so the budget shrinks (or stays)."""
    spec = _spec("Qwen--Qwen3-32B")
    budgets = [estimate_budget(spec, total_bytes=95 * GIB, total_source="given", gpu_memory_utilization=0.9,
                               weights_bytes_total=30 * GIB, weights_source="given", tensor_parallel_size=1,
                               max_num_batched_tokens=8192, max_num_seqs=seqs).kv_budget_bytes
               for seqs in (8, 64, 256, 1024)]
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]


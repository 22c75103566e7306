"""The profile-run memory model against the numbers real vLLM logs print."""

from __future__ import annotations

import pytest

from teamserve_capacity import GIB
from teamserve_capacity.memory import (
    CUDAGRAPH_BYTES_PER_GRAPH_LAYER,
    SORT_SAMPLER_BYTES_PER_LOGIT,
    V1_SAMPLER_BYTES_PER_LOGIT,
    activation_bytes_per_token,
    cudagraph_bytes,
    cudagraph_capture_sizes,
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



def _grid(top: int) -> list[int]:
    """vLLM 0.32 _set_cudagraph_sizes' grid up to ``top``: 1, 2, 4, steps of 8 below 256, of 16 from 256."""
    return [s for s in [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)] if s <= top]


@pytest.mark.parametrize(("seqs", "batched", "expected"), [
    (32, 8192, _grid(64)),                       # max_num_seqs on the grid: nothing added
    (264, 8192, sorted(_grid(512) + [264])),     # the widest decode batch, off the 16-step grid
    (100, 2048, sorted(_grid(200) + [100])),     # ... and off the 8-step grid
    (256, 300, _grid(300) + [300]),              # max_num_batched_tokens caps the sizes and is captured
    (8, 12, [1, 2, 4, 8, 12]),
    (1024, 8192, _grid(512)),                    # wider than the 512 cap: not captured
])
def test_capture_sizes_follow_vllm_0_32(seqs: int, batched: int, expected: list[int]) -> None:
    assert cudagraph_capture_sizes(seqs, batched) == expected


def test_capture_sizes_without_the_token_cap_are_the_old_grid() -> None:
    """Without max_num_batched_tokens (the benchmark's call): the grid up to min(2 x max_num_seqs, 512) alone."""
    assert cudagraph_capture_sizes(264) == _grid(512)
    assert cudagraph_capture_sizes(256) == _grid(512)


def test_an_off_grid_max_num_seqs_costs_one_graph_per_mode() -> None:
    spec = _spec("meta-llama--Llama-3.1-8B-Instruct")
    on_grid, off_grid = cudagraph_bytes(spec, 1, 264, 2), cudagraph_bytes(spec, 1, 264, 2, 8192)
    assert off_grid - on_grid == 2 * spec.num_layers * CUDAGRAPH_BYTES_PER_GRAPH_LAYER  # one PIECEWISE, one FULL


def test_the_token_cap_shrinks_the_first_capture() -> None:
    spec = _spec("meta-llama--Llama-3.1-8B-Instruct")
    capped, uncapped = cudagraph_bytes(spec, 1, 256, 2, 300), cudagraph_bytes(spec, 1, 256, 2)
    assert capped < uncapped
    assert capped >= 300 * activation_bytes_per_token(spec, 1, 2)


def test_v2_sampler_holds_only_the_model_dtype_logits() -> None:
    """vLLM 0.32's default V2 runner: the dummy batch takes no float32 copy, no top-k/top-p, no noise."""
    spec = _spec("meta-llama--Llama-3.1-8B-Instruct")
    hidden = 8192 * spec.hidden_size * 2
    v2 = sampler_peak_bytes(spec, max_num_batched_tokens=8192, max_num_seqs=1024, act_bytes=2)
    v1 = sampler_peak_bytes(spec, max_num_batched_tokens=8192, max_num_seqs=1024, act_bytes=2,
                            bytes_per_logit=V1_SAMPLER_BYTES_PER_LOGIT)
    assert v2 == hidden + 1024 * spec.vocab_size * 2
    assert v1 - v2 == 1024 * spec.vocab_size * 12
    # at vLLM's 80 GB defaults the forward, not the V2 sampler, sets the profile's peak
    peak = profile_peak_bytes(spec, tensor_parallel_size=1, max_num_batched_tokens=8192, max_num_seqs=1024,
                              act_bytes=2)
    assert peak == 8192 * activation_bytes_per_token(spec, 1, 2) > v2

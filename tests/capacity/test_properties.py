"""Monotonicity properties of the planner (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from teamserve_capacity import plan

from .conftest import ENGINE, RTX_PRO_6000, load_config

MODELS = ["meta-llama--Llama-3.1-8B-Instruct", "google--gemma-3-27b-it", "openai--gpt-oss-20b",
          "deepseek-ai--DeepSeek-V2-Lite-Chat", "Qwen--Qwen3-Next-80B-A3B-Instruct",
          "meta-llama--Llama-4-Scout-17B-16E-Instruct", "Qwen--Qwen3-30B-A3B"]
CONFIGS = {name: load_config(name) for name in MODELS}

names = st.sampled_from(MODELS)
mib = st.integers(min_value=16_000, max_value=200_000)
contexts = st.integers(min_value=128, max_value=32_768)
weights = st.integers(min_value=1, max_value=60) .map(lambda g: g * 1024 ** 3)


def _plan(name: str, memory_mib: int, avg: int, mx: int, kv: str = "auto", w: int = 10 * 1024 ** 3):
    model = {"name": name, "config": CONFIGS[name], "weight_bytes": w}  # the checkpoint's own format
    workload = {"concurrent_sequences": 4, "avg_context_tokens": avg, "max_context_tokens": mx}
    gpu = dict(RTX_PRO_6000, memory_total_mib=memory_mib)
    return plan(model, workload, [gpu], dict(ENGINE, kv_cache_dtype=kv))["numbers"]


@settings(max_examples=60, deadline=None)
@given(names, mib, st.integers(min_value=0, max_value=50_000), contexts, weights)
def test_more_memory_never_fewer_sequences(name, memory, extra, avg, w) -> None:
    small = _plan(name, memory, avg, 32_768, w=w)
    large = _plan(name, memory + extra, avg, 32_768, w=w)
    assert large["max_concurrency_avg"] >= small["max_concurrency_avg"]
    assert large["max_concurrency_max"] >= small["max_concurrency_max"]


@settings(max_examples=60, deadline=None)
@given(names, mib, contexts, weights)
def test_fp8_never_fewer_tokens_than_bf16(name, memory, avg, w) -> None:
    bf16 = _plan(name, memory, avg, 32_768, "bfloat16", w)
    fp8 = _plan(name, memory, avg, 32_768, "fp8", w)
    assert fp8["kv_tokens"] >= bf16["kv_tokens"]
    assert fp8["max_concurrency_avg"] >= bf16["max_concurrency_avg"]


@settings(max_examples=60, deadline=None)
@given(names, mib, contexts, st.integers(min_value=0, max_value=30_000), weights)
def test_longer_context_never_more_sequences(name, memory, avg, extra, w) -> None:
    short = _plan(name, memory, avg, 65_536, w=w)
    long = _plan(name, memory, min(avg + extra, 65_536), 65_536, w=w)
    assert long["max_concurrency_avg"] <= short["max_concurrency_avg"]

"""Start-up log parsing, on real lines quoted in public vLLM issues."""

from __future__ import annotations

import json
from pathlib import Path

from teamserve_capacity import measured_from_log, parse_startup_log

CASES = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/capacity/cases.json").read_text())["cases"]


def test_v1_lines() -> None:
    text = next(c["log"] for c in CASES if c["id"] == "qwen3-14b-lmcache")
    parsed = parse_startup_log(text)
    assert parsed == {"kv_cache_gib": 6.51, "kv_tokens": 42656, "max_model_len": 32768, "concurrency": 1.30}


def test_v0_one_line_profile() -> None:
    text = next(c["log"] for c in CASES if c["id"] == "llama31-8b-3090-20k")
    parsed = parse_startup_log(text)
    assert parsed["weights_gib"] == 14.9888 and parsed["kv_cache_gib"] == 3.81
    assert parsed["total_gib"] == 23.58 and parsed["non_torch_gib"] == 0.35
    assert parsed["gpu_blocks"] == 1952 and parsed["gpu_memory_utilization"] == 0.90


def test_measured_bytes() -> None:
    measured = measured_from_log({"kv_cache_gib": 2.0, "weights_gib": 1.5})
    assert measured == {"kv_cache_bytes": 2 * 1024 ** 3, "weights_bytes": int(1.5 * 1024 ** 3)}


def _benchmark():
    import importlib.util
    path = Path(__file__).resolve().parents[2] / "benchmarks/capacity/against_logs.py"
    spec = importlib.util.spec_from_file_location("against_logs", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_benchmark_token_errors_within_target() -> None:
    """KV tokens from logged memory within 1 % on every single-GPU case; MLA need within 1 %."""
    module = _benchmark()
    rows = [module.run_case(c) for c in CASES]
    single_gpu = [r for r in rows if "tokens_error_pct" in r and r["tp"] == 1]
    assert len(single_gpu) >= 4 and all(abs(r["tokens_error_pct"]) < 1.0 for r in single_gpu)
    mla = next(r for r in rows if r["id"] == "dsv2-lite-mla-need")
    assert abs(mla["need_error_pct"]) < 1.0


def test_tp_token_case_is_bounded_by_the_quoted_rank() -> None:
    """With TP the engine sizes every rank from the smallest: tokens never exceed the quoted rank's."""
    module = _benchmark()
    row = module.run_case(next(c for c in CASES if c["id"] == "qwen3-235b-fp8-tp4"))
    assert row["logged_kv_tokens"] <= row["planner_kv_tokens"]
    assert row["implied_min_rank_kv_gib"] < row["quoted_rank_kv_gib"]


def test_benchmark_memory_median_within_target() -> None:
    """KV memory from total, utilisation and logged weights: median within 5 % over >= 8 cases."""
    module = _benchmark()
    stats = module.summary([module.run_case(c) for c in CASES])
    assert stats["memory_cases"] >= 8
    assert stats["memory_median_abs_error_pct"] < 5.0
    assert stats["tokens_max_abs_error_pct"] < 1.0


def test_v1_debug_profile_lines() -> None:
    """The V1 DEBUG profiling lines quoted in vLLM PR #21429 parse into the budget's parts."""
    text = next(c["log"] for c in CASES if c["id"] == "qwen3-235b-fp8-h200-tp4")
    parsed = parse_startup_log(text)
    assert parsed["requested_gib"] == 69.86 and parsed["weights_gib"] == 55.13
    assert parsed["activation_gib"] == 5.62 and parsed["non_torch_gib"] == 2.04
    assert parsed["kv_cache_gib"] == 7.07


def test_v032_summary_line_feeds_the_budget() -> None:
    """vLLM 0.32's summary line (quoted in noonghunna/club-3090 issue #1087) round-trips."""
    line = ("(Worker_TP0 pid=223) INFO 08-22 04:42:13 [gpu_worker.py:789] Free memory on device "
            "(30.27/31.4 GiB) on startup. Desired GPU memory utilization is (0.92, 28.88 GiB). Actual "
            "usage is 15.03 GiB for consumed memory (weights + non-torch), 1.59 GiB for peak activation, "
            "and 0.09 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with "
            "`--kv-cache-memory=12917635953` (12.03 GiB) to fit into requested memory, or "
            "`--kv-cache-memory=14405811712` (13.42 GiB) to fully utilize gpu memory. Current kv cache "
            "memory in use is 12.26 GiB.")
    parsed = parse_startup_log(line)
    assert parsed["total_gib"] == 31.4 and parsed["gpu_memory_utilization"] == 0.92
    assert parsed["kv_cache_gib"] == 12.26
    measured = measured_from_log(parsed)
    # requested - consumed - activation, as vLLM computes it, reproduces the logged KV memory
    requested = 31.4 * 0.92
    kv = requested - (measured["weights_bytes"] + measured["activation_bytes"]) / 1024 ** 3
    assert abs(kv - 12.26) < 0.02

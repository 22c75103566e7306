"""The README's worked example, an 8B model at fp16 on one 24 GB card, planned by ``teamserve-plan``.

The example's own assumptions are given to the CLI the way a measured start-up log would give them:
24 GiB usable (``total_memory_bytes`` with utilisation 1.0), 2 GiB of overhead (``non_torch_bytes``;
no separate activation or CUDA-graph deduction) and 8e9 parameters. Everything else (KV bytes per token,
blocks, sequences, the fp8 and 4-bit levers) is the planner's own arithmetic.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from teamserve_capacity import GIB, MIB
from teamserve_capacity.cli import main

from .conftest import load_config

MODEL = "meta-llama--Llama-3.1-8B-Instruct"
# quantization_config of a 4-bit AWQ export of the same model (AutoAWQ's defaults).
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], *, weight_format: str = "fp16",
          avg_context: int = 4000, kv_cache_dtype: str = "auto", table: bool = False) -> Any:
    """Run ``teamserve-plan plan --input`` on the example; the parsed JSON, or the table text."""
    config = load_config(MODEL)
    if weight_format == "awq":
        config["quantization_config"] = AWQ
    inputs = {
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct", "config": config,
                  "weight_format": weight_format, "params": 8_000_000_000},
        "workload": {"concurrent_sequences": 10, "avg_context_tokens": avg_context,
                     "max_context_tokens": 16384},
        "gpus": [{"index": 0, "name": "24 GB card", "memory_total_mib": 24576, "compute_cap": "8.9"}],
        "engine": {"gpu_memory_utilization": 1.0, "kv_cache_dtype": kv_cache_dtype,
                   "measured": {"total_memory_bytes": 24 * GIB, "non_torch_bytes": 2 * GIB,
                                "activation_bytes": 0, "cudagraph_bytes": 0}},
    }
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(inputs))
    status = main(["plan", "--input", str(path)] + ([] if table else ["--json"]))
    out = capsys.readouterr().out
    if table:
        return status, out
    result = json.loads(out)
    assert status == (0 if result["fits"] else 1)
    return result


def test_fp16_weights_leave_7_1_gib_for_kv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    numbers = _plan(tmp_path, capsys)["numbers"]
    assert numbers["weights_gib"] == 14.9  # 8e9 x 2 bytes
    assert numbers["kv_budget_gib"] == 7.1  # 24 - 14.9 - 2.0


def test_kv_token_is_128_kib_and_4000_tokens_500_mib(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    numbers = _plan(tmp_path, capsys)["numbers"]
    assert numbers["kv_bytes_per_token"] == 128 * 1024  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    assert numbers["kv_per_seq_avg_mib"] * MIB == 500 * MIB


def test_fourteen_sequences_at_4000_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = _plan(tmp_path, capsys)
    assert result["numbers"]["max_concurrency_avg"] == 14
    assert result["fits"] is True  # 10 people asked for
    # 10 rounded up to the CUDA-graph step of 8, then capped at what fits
    assert result["flags"]["max-num-seqs"] == 14


def test_table_shows_the_arithmetic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, table = _plan(tmp_path, capsys, table=True)
    assert status == 0
    assert "14 sequences" in table and "-> 7.10 GiB" in table and "-> 128 KiB" in table


def test_sixteen_k_context_gives_three(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = _plan(tmp_path, capsys, avg_context=16000)
    assert result["numbers"]["kv_per_seq_avg_mib"] == 2000.0
    assert result["numbers"]["max_concurrency_avg"] == 3
    assert result["fits"] is False
    assert any(lever.startswith("fewer concurrent sequences: 3 fit") for lever in result["levers"])


def test_four_bit_weights_free_eleven_gib_and_pass_35(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    fp16 = _plan(tmp_path, capsys)["numbers"]
    awq = _plan(tmp_path, capsys, weight_format="awq")["numbers"]
    assert round(fp16["weights_gib"] - awq["weights_gib"]) == 11
    assert awq["max_concurrency_avg"] > 35


def test_fp8_kv_cache_doubles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    auto = _plan(tmp_path, capsys)["numbers"]
    fp8 = _plan(tmp_path, capsys, kv_cache_dtype="fp8")["numbers"]
    assert fp8["kv_bytes_per_token"] * 2 == auto["kv_bytes_per_token"]
    assert fp8["max_concurrency_avg"] >= 2 * auto["max_concurrency_avg"]

#!/usr/bin/env python3
"""Planner vs real vLLM start-up logs.

For each case in cases.json (real log lines quoted in public issues, source
named per case) print:

* KV tokens: the planner's token count from the *logged* KV memory
  (num_blocks = memory // bytes per block, tokens as that vLLM era counts
  them) against the logged "KV cache size" / "# GPU blocks" — target 1 %;
* KV memory: the planner's budget from total memory, utilisation and the
  logged weights (its own non-torch/activation/graph estimates) against the
  logged "Available KV cache memory" — target 5 % median;
* MLA need: KV bytes one max-length request needs against vLLM's error text.

The logged memory is rounded to 0.01 GiB, so token errors below ~0.3 % are
rounding. Run: .venv/bin/python benchmarks/capacity/against_logs.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from teamserve_capacity import GIB, parse_config, parse_startup_log
from teamserve_capacity.kv import kv_layout
from teamserve_capacity.memory import (NON_TORCH_BYTES_TP1, NON_TORCH_BYTES_TP_EXTRA,
                                       SAMPLER_COPIES, activation_bytes_per_token)

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parents[1] / "tests/capacity/fixtures/configs"


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Compute one case's planner numbers and errors (percent, planner vs log)."""
    spec = parse_config(json.loads((CONFIGS / f"{case['config']}.json").read_text()))
    log = parse_startup_log(case["log"])
    layout = kv_layout(spec, tensor_parallel_size=case["tp"], kv_dtype_bytes=case["kv_dtype_bytes"],
                       block_size=case["block_size"], state_dtype_bytes=2, prefix_caching=True)
    out: dict[str, Any] = {"id": case["id"], "model": case["config"], "era": case["era"],
                           "kv_bytes_per_token": layout.kv_bytes_per_token}
    logged_tokens = log.get("kv_tokens")
    if logged_tokens is None and "gpu_blocks" in log:
        logged_tokens = log["gpu_blocks"] * case["block_size"]
    if "kv_cache_gib" in log and logged_tokens:
        blocks = int(log["kv_cache_gib"] * GIB) // layout.bytes_per_block
        if case["era"] == "0.32":
            tokens = layout.logged_kv_tokens(blocks, case["max_model_len"], 0)
        else:
            tokens = blocks * layout.block_size
        out.update(logged_kv_tokens=logged_tokens, planner_kv_tokens=tokens,
                   tokens_error_pct=round(100 * (tokens - logged_tokens) / logged_tokens, 3))
    if {"kv_cache_gib", "total_gib", "gpu_memory_utilization", "weights_gib"} <= log.keys():
        tp = case["tp"]
        requested = log["total_gib"] * GIB * log["gpu_memory_utilization"]
        act = (case["max_num_batched_tokens"] * activation_bytes_per_token(spec, tp, 2)
               + SAMPLER_COPIES * case["max_num_seqs"] * spec.vocab_size * 4 // tp)
        non_torch = NON_TORCH_BYTES_TP1 + (NON_TORCH_BYTES_TP_EXTRA if tp > 1 else 0)
        graphs = 0  # V0 and V1 before 0.21 did not deduct CUDA graphs from the KV budget
        kv = requested - log["weights_gib"] * GIB - non_torch - act - graphs
        out.update(logged_kv_gib=log["kv_cache_gib"], planner_kv_gib=round(kv / GIB, 2),
                   planner_activation_gib=round(act / GIB, 2),
                   memory_error_pct=round(100 * (kv / GIB - log["kv_cache_gib"]) / log["kv_cache_gib"], 2))
        if "activation_gib" in log:
            out["logged_activation_gib"] = log["activation_gib"]
    if "needed_kv_gib_for_max_len" in case:
        need = layout.blocks_per_request(case["max_model_len"], 0) * layout.bytes_per_block / GIB
        out.update(logged_need_gib=case["needed_kv_gib_for_max_len"], planner_need_gib=round(need, 3),
                   need_error_pct=round(100 * (need - case["needed_kv_gib_for_max_len"])
                                        / case["needed_kv_gib_for_max_len"], 2))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=str(HERE / "cases.json"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cases = json.loads(Path(args.cases).read_text())["cases"]
    rows = [run_case(c) for c in cases]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'case':<22} {'B/token':>8} {'logged tok':>11} {'planner tok':>11} {'err %':>7}  "
          f"{'logged GiB':>10} {'planner GiB':>11} {'err %':>7}")
    for r in rows:
        print(f"{r['id']:<22} {r['kv_bytes_per_token']:>8,} "
              f"{r.get('logged_kv_tokens', r.get('logged_need_gib', '')):>11} "
              f"{r.get('planner_kv_tokens', r.get('planner_need_gib', '')):>11} "
              f"{r.get('tokens_error_pct', r.get('need_error_pct', '')):>7}  "
              f"{r.get('logged_kv_gib', ''):>10} {r.get('planner_kv_gib', ''):>11} "
              f"{r.get('memory_error_pct', ''):>7}")
    tok = [abs(r["tokens_error_pct"]) for r in rows if "tokens_error_pct" in r]
    mem = [abs(r["memory_error_pct"]) for r in rows if "memory_error_pct" in r]
    if tok:
        print(f"KV tokens from logged memory: max |error| {max(tok):.3f} % over {len(tok)} cases (target 1 %)")
    if mem:
        print(f"KV memory from total/util/weights: median |error| {statistics.median(mem):.2f} % over "
              f"{len(mem)} cases (target 5 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

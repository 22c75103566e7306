#!/usr/bin/env python3
"""Planner vs real vLLM start-up logs.

For each case in cases.json (numbers from public vLLM issues, pull requests
and benchmark reports, source named per case) print:

* KV tokens: the planner's token count from the *logged* KV memory
  (num_blocks = memory // bytes per block, tokens as that vLLM era counts
  them) against the logged "KV cache size" / "# GPU blocks" — target 1 %;
* KV memory: the planner's budget from the logged total (or requested) memory,
  utilisation and weights, with the planner's own non-torch, profile-peak and
  CUDA-graph estimates, against the logged "Available KV cache memory" —
  target 5 % median;
* the profile-run peak ("activation") estimate against the logged one, where
  the source logs it;
* MLA need: KV bytes one max-length request needs against vLLM's error text.

Each era is accounted the way its release did (see ERAS); the estimates are
the planner's (teamserve_capacity.memory), not fitted per case. The logged
memory is rounded to 0.01 GiB, so token errors below ~0.3 % are rounding.
Run: .venv/bin/python benchmarks/capacity/against_logs.py [--json] [--markdown]
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
from teamserve_capacity.memory import (
    SAMPLER_BYTES_PER_LOGIT,
    SORT_SAMPLER_BYTES_PER_LOGIT,
    cudagraph_bytes,
    non_torch_bytes,
    profile_peak_bytes,
)

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parents[1] / "models/configs"

# How each era's profiler sized the KV budget (see teamserve_capacity.memory):
#   eager        the profile run executed the model uncompiled (V0);
#   logit_bytes  bytes per sampled logit at the sampler's peak (sort-based
#                top-k/top-p before vLLM's Triton kernel; 2 in 0.32's default
#                V2 model runner, 14 in its V1 runner);
#   cudagraphs   whether the CUDA-graph estimate is deducted (default since 0.21).
ERAS: dict[str, dict[str, Any]] = {
    "v0": {"eager": True, "logit_bytes": SORT_SAMPLER_BYTES_PER_LOGIT, "cudagraphs": False},
    "v1": {"eager": False, "logit_bytes": SORT_SAMPLER_BYTES_PER_LOGIT, "cudagraphs": False},
    "0.32": {"eager": False, "logit_bytes": SAMPLER_BYTES_PER_LOGIT, "cudagraphs": True},
}


def _pct(planned: float, logged: float) -> float:
    return round(100 * (planned - logged) / logged, 2) if logged else float("nan")


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Compute one case's planner numbers and errors (percent, planner vs log)."""
    spec = parse_config(json.loads((CONFIGS / f"{case['config']}.json").read_text()))
    log = parse_startup_log(case.get("log", ""))
    log.update(case.get("reported", {}))
    era = ERAS[case["era"]]
    tp = case["tp"]
    layout = kv_layout(spec, tensor_parallel_size=tp, kv_dtype_bytes=case["kv_dtype_bytes"],
                       block_size=case["block_size"], state_dtype_bytes=2, prefix_caching=True)
    out: dict[str, Any] = {"id": case["id"], "model": case["config"], "era": case["era"], "tp": tp,
                           "gpu": case.get("gpu", ""), "kv_bytes_per_token": layout.kv_bytes_per_token,
                           "excluded": case.get("excluded")}
    logged_tokens = log.get("kv_tokens")
    if logged_tokens is None and "gpu_blocks" in log:
        logged_tokens = log["gpu_blocks"] * case["block_size"]
    if "kv_cache_gib" in log and logged_tokens:
        blocks = int(log["kv_cache_gib"] * GIB) // layout.bytes_per_block
        # 0.32 logs int(blocks / blocks of a max-length request x max_model_len); older eras blocks x block size.
        tokens = (layout.logged_kv_tokens(blocks, case["max_model_len"], 0) if case["era"] == "0.32"
                  else blocks * layout.block_size)
        out.update(logged_kv_tokens=logged_tokens, planner_kv_tokens=tokens,
                   tokens_error_pct=round(100 * (tokens - logged_tokens) / logged_tokens, 3))
        if tp > 1:
            # vLLM sizes every rank's cache from the smallest rank's budget
            # (0.32 kv_cache_utils.get_kv_cache_configs, step 5); the log
            # quotes one rank's "Available KV cache memory".
            implied = logged_tokens // layout.block_size * layout.bytes_per_block / GIB
            out.update(quoted_rank_kv_gib=log["kv_cache_gib"], implied_min_rank_kv_gib=round(implied, 3))
    has_budget = "requested_gib" in log or {"total_gib", "gpu_memory_utilization"} <= log.keys()
    if "kv_cache_gib" in log and "weights_gib" in log and has_budget:
        requested = (log["requested_gib"] * GIB if "requested_gib" in log
                     else log["total_gib"] * GIB * log["gpu_memory_utilization"])
        batched, seqs = case["max_num_batched_tokens"], case["max_num_seqs"]
        peak = profile_peak_bytes(spec, tensor_parallel_size=tp, max_num_batched_tokens=batched,
                                  max_num_seqs=seqs, act_bytes=2, eager=era["eager"],
                                  bytes_per_logit=era["logit_bytes"])
        # 0.32 caps the capture sizes at max_num_batched_tokens; the older eras deducted no graphs.
        graphs = cudagraph_bytes(spec, tp, seqs, 2, batched) if era["cudagraphs"] else 0
        kv = requested - log["weights_gib"] * GIB - non_torch_bytes(tp) - peak - graphs
        out.update(logged_kv_gib=log["kv_cache_gib"], planner_kv_gib=round(kv / GIB, 2),
                   planner_peak_gib=round(peak / GIB, 2),
                   memory_error_pct=_pct(kv / GIB, log["kv_cache_gib"]))
        if "activation_gib" in log:
            logged_peak = log["activation_gib"]
            if case["era"] == "v0" and "peak_torch_memory" in case.get("log", ""):
                logged_peak = None  # V0 one-line form logs peak incl. weights: derived below
            if logged_peak is not None:
                out.update(logged_peak_gib=logged_peak, peak_error_pct=_pct(peak / GIB, logged_peak))
        elif "peak_torch_memory=" in case.get("log", ""):
            peak_total = float(case["log"].split("peak_torch_memory=")[1].split("GiB")[0])
            logged_peak = round(peak_total - log["weights_gib"], 2)
            out.update(logged_peak_gib=logged_peak, peak_error_pct=_pct(peak / GIB, logged_peak))
    if "needed_kv_gib_for_max_len" in case:
        need = layout.blocks_per_request(case["max_model_len"], 0) * layout.bytes_per_block / GIB
        out.update(logged_need_gib=case["needed_kv_gib_for_max_len"], planner_need_gib=round(need, 3),
                   need_error_pct=_pct(need, case["needed_kv_gib_for_max_len"]))
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Max |token error| and median |memory error| over the non-excluded cases, percent.

    Token errors are summarised over single-GPU cases: with tensor parallelism
    the log quotes one rank's memory while the tokens follow the smallest rank
    (see ``implied_min_rank_kv_gib``), so those are reported, not summarised.
    """
    tok = [abs(r["tokens_error_pct"]) for r in rows
           if "tokens_error_pct" in r and not r["excluded"] and r["tp"] == 1]
    mem = [abs(r["memory_error_pct"]) for r in rows if "memory_error_pct" in r and not r["excluded"]]
    out: dict[str, float] = {}
    if tok:
        out.update(tokens_max_abs_error_pct=max(tok), tokens_cases=len(tok))
    if mem:
        out.update(memory_median_abs_error_pct=round(statistics.median(mem), 2), memory_cases=len(mem),
                   memory_max_abs_error_pct=max(mem))
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    """The README table."""
    lines = ["| case | era | TP | B/token | logged tokens | planner | err % | logged KV GiB | planner | err % "
             "| logged peak GiB | planner | err % |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        tokens = (f"{r['logged_kv_tokens']:,} | {r['planner_kv_tokens']:,} | {r['tokens_error_pct']}"
                  if "tokens_error_pct" in r else
                  f"need {r['logged_need_gib']} GiB | {r['planner_need_gib']} | {r['need_error_pct']}"
                  if "need_error_pct" in r else " | | ")
        memory = (f"{r['logged_kv_gib']} | {r['planner_kv_gib']} | {r['memory_error_pct']}"
                  + (" (excluded)" if r["excluded"] else "")
                  if "memory_error_pct" in r else " | | ")
        peak = (f"{r['logged_peak_gib']} | {r['planner_peak_gib']} | {r['peak_error_pct']}"
                if "peak_error_pct" in r else " | | ")
        lines.append(f"| {r['id']} | {r['era']} | {r['tp']} | {r['kv_bytes_per_token']:,} | {tokens} | {memory} "
                     f"| {peak} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=str(HERE / "cases.json"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--markdown", action="store_true", help="print the README table")
    args = parser.parse_args()
    cases = json.loads(Path(args.cases).read_text())["cases"]
    rows = [run_case(c) for c in cases]
    stats = summary(rows)
    if args.json:
        print(json.dumps({"rows": rows, "summary": stats}, indent=2))
        return 0
    if args.markdown:
        print(markdown(rows))
    else:
        print(f"{'case':<30} {'era':<4} {'logged tok':>11} {'planner tok':>11} {'err %':>7}  "
              f"{'logged GiB':>10} {'planner GiB':>11} {'err %':>7}  {'peak log':>8} {'peak est':>8}")
        for r in rows:
            print(f"{r['id']:<30} {r['era']:<4} "
                  f"{r.get('logged_kv_tokens', r.get('logged_need_gib', '')):>11} "
                  f"{r.get('planner_kv_tokens', r.get('planner_need_gib', '')):>11} "
                  f"{r.get('tokens_error_pct', r.get('need_error_pct', '')):>7}  "
                  f"{r.get('logged_kv_gib', ''):>10} {r.get('planner_kv_gib', ''):>11} "
                  f"{r.get('memory_error_pct', ''):>7}{'*' if r['excluded'] else ' '} "
                  f"{r.get('logged_peak_gib', ''):>8} {r.get('planner_peak_gib', ''):>8}")
        print("* excluded from the statistics (reason in cases.json)")
    if "tokens_cases" in stats:
        print(f"KV tokens from logged memory: max |error| {stats['tokens_max_abs_error_pct']:.3f} % over "
              f"{stats['tokens_cases']} single-GPU cases (target 1 %)")
        for r in rows:
            if "implied_min_rank_kv_gib" in r:
                print(f"  {r['id']} (TP={r['tp']}): {r['tokens_error_pct']:+.3f} % against the quoted rank's "
                      f"{r['quoted_rank_kv_gib']} GiB; the logged tokens imply the smallest rank had "
                      f"{r['implied_min_rank_kv_gib']} GiB")
    if "memory_cases" in stats:
        print(f"KV memory from total/util/weights: median |error| {stats['memory_median_abs_error_pct']:.2f} % "
              f"over {stats['memory_cases']} cases (target 5 %), max {stats['memory_max_abs_error_pct']:.2f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())

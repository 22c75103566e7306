#!/usr/bin/env python3
"""The planner against public vLLM start-up logs, term by term.

Each case in ``tests/capacity/fixtures/startup_logs/`` is one public start-up
log (source URL, vLLM version, GPU, flags, the logged lines verbatim). This
script plans it the way a user would -- :func:`teamserve_capacity.plan` with
the model's config.json, the GPU row and the flags, nothing from the log --
and compares every memory term with what that vLLM logged:

* weights ("Model loading took X GiB"), the profile run's activation peak,
  CUDA-graph memory, non-torch memory, the overhead the log implies
  (requested - weights - KV cache), the KV-cache memory and the KV-cache
  tokens. The token reference is the logged KV memory counted in the
  planner's own layout, so the token error is the budget's error in tokens
  (the layout itself is checked separately against the logged token count:
  ``layout_error_pct``).

The planner reproduces vLLM 0.32's accounting. Older logs are planned with
the few switches that differ by release, each read from the log or from vLLM's
history, never fitted (:func:`accounting`):

* ``engine: v0`` -- the model runs eagerly and without chunked prefill;
* the sampler the log names: FlashInfer's top-k/top-p kernel, or the
  PyTorch sort (:data:`SAMPLER_BYTES_PER_LOGIT`);
* the CUDA-graph estimate is deducted only from vLLM 0.21 on (the 0.21+ log
  says "CUDA graph memory profiling is enabled (default since v0.21.0)").

Run (from the repository root):  PYTHONPATH=. .venv/bin/python benchmarks/capacity/startup_logs.py [--json] [--case ID] [--pinned]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from teamserve_capacity import GIB, PlanError, find_gpu, kv_layout, parse_config, parse_startup_log, plan
from teamserve_capacity.memory import SAMPLER_BYTES_PER_LOGIT as SAMPLER_032
from teamserve_capacity.memory import SORT_SAMPLER_BYTES_PER_LOGIT, profile_peak_bytes

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests/capacity/fixtures/startup_logs"
CONFIGS = REPO / "models/configs"

# Bytes per sampled logit at the sampler's peak, by the top-k/top-p path the
# log names (the profile's dummy sampler run sets top_k and top_p since vLLM PR
# #13594, so the top-k/top-p path is the one profiled):
#   "pytorch"    apply_top_k_top_p's sort (teamserve_capacity.memory.SORT_SAMPLER_BYTES_PER_LOGIT);
#   "flashinfer" vLLM 0.10 topk_topp_sampler.py flashinfer_sample ->
#                flashinfer.sampling.top_k_top_p_sampling_from_logits: the
#                model-dtype logits (2), Sampler.forward's float32 copy (4)
#                and the float32 probabilities the kernel samples from (4);
#                no sort buffers and no exponential-noise tensor;
#   "0.32"       the pinned release (teamserve_capacity.memory.SAMPLER_BYTES_PER_LOGIT).
SAMPLER_BYTES_PER_LOGIT = {"pytorch": SORT_SAMPLER_BYTES_PER_LOGIT, "flashinfer": 10, "0.32": SAMPLER_032}
# vLLM deducts its CUDA-graph estimate from the KV budget by default from this release on.
CUDAGRAPH_ESTIMATE_SINCE = (0, 21)
# Workload timing targets for plan(): they only pick flags the cases give explicitly.
_TIMING = {"ttft_p95_seconds": 2.0, "tpot_seconds": 0.05}
TERMS = ("weights", "activation", "cudagraph", "non_torch", "overhead", "kv_memory", "kv_tokens")


@dataclass
class Result:
    """One case's outcome: planner and logged figures (GiB, tokens) and errors (percent)."""

    id: str
    status: str  # "planned", "kv-only", "refused", "excluded"
    detail: str = ""
    tp: int = 0
    planned: dict[str, float] = field(default_factory=dict)
    logged: dict[str, float] = field(default_factory=dict)
    error_pct: dict[str, float] = field(default_factory=dict)
    layout_error_pct: float | None = None


def load_cases(directory: Path = CORPUS) -> list[dict[str, Any]]:
    """Every case file of the corpus, sorted by id.

    Raises:
        ValueError: a file without ``id``/``source``/``vllm_version``/``model``/``flags``/``log`` or
            whose id is not its file name.
    """
    cases = []
    for path in sorted(directory.glob("*.yml")):
        case = yaml.safe_load(path.read_text())
        missing = [k for k in ("id", "source", "vllm_version", "engine", "model", "flags") if k not in case]
        if missing or not (case.get("log") or case.get("quote")):
            raise ValueError(f"{path.name}: missing {missing or 'log/quote'}; every case needs its source and lines")
        if case["id"] != path.stem:
            raise ValueError(f"{path.name}: id {case['id']!r} is not the file name")
        cases.append(case)
    return cases


def _version(text: str) -> tuple[int, int]:
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return (99, 0)  # "V1 (January 2026)": a release after 0.21


def accounting(case: dict[str, Any], pinned: bool = False) -> dict[str, Any]:
    """How the case's vLLM release sized the KV budget where it differs from 0.32.

    Args:
        case: the corpus case.
        pinned: ignore the release and account as the pinned vLLM does (the planner as shipped).
    Returns:
        ``{eager, bytes_per_logit, cudagraph_deducted}``.
    """
    if pinned:
        return {"eager": False, "bytes_per_logit": SAMPLER_032, "cudagraph_deducted": True}
    return {
        "eager": case["engine"] == "v0",
        "bytes_per_logit": SAMPLER_BYTES_PER_LOGIT[case.get("sampler", "0.32")],
        "cudagraph_deducted": _version(case["vllm_version"]) >= CUDAGRAPH_ESTIMATE_SINCE,
    }


def logged_terms(case: dict[str, Any]) -> dict[str, float]:
    """The memory figures the case logs (GiB per GPU), from its lines and tabulated numbers."""
    parsed = parse_startup_log(case.get("log", ""))
    parsed.update(case.get("reported") or {})
    names = {"weights_gib": "weights", "activation_gib": "activation", "non_torch_gib": "non_torch",
             "cudagraph_gib": "cudagraph", "kv_cache_gib": "kv_memory", "total_gib": "total",
             "requested_gib": "requested", "kv_tokens": "kv_tokens_logged", "gpu_blocks": "gpu_blocks"}
    return {names[k]: float(v) for k, v in parsed.items() if k in names}


def _pct(planned: float, logged: float) -> float:
    return round(100 * (planned - logged) / abs(logged), 2) if logged else float("nan")


def run_case(case: dict[str, Any], pinned: bool = False) -> Result:
    """Plan one case and compare; never raises for a modelled case (a refusal is a result)."""
    flags = case["flags"]
    tp = int(flags.get("tensor_parallel_size", 1))
    res = Result(case["id"], "planned", tp=tp)
    config = json.loads((CONFIGS / f"{case['model']['config']}.json").read_text())
    logged = logged_terms(case)
    res.logged = logged
    if case.get("expect", {}).get("refused"):
        try:
            plan({"name": case["model"]["name"], "config": config}, {"concurrent_sequences": 1,
                 "avg_context_tokens": 1, "max_context_tokens": 1, **_TIMING},
                 [{"name": "x", "memory_total_mib": 81559, "compute_cap": "9.0"}])
        except PlanError as err:
            res.status, res.detail = "refused", str(err)
            return res
        res.status, res.detail = "not-refused", "expected a refusal naming " + case["expect"]["refused"]
        return res
    spec = parse_config(config)
    kv_bytes = 1 if str(flags.get("kv_cache_dtype", "auto")).startswith("fp8") else min(2, 4 if spec.dtype == "float32" else 2)
    layout = kv_layout(spec, tensor_parallel_size=tp, kv_dtype_bytes=kv_bytes, block_size=flags.get("block_size", 16),
                       state_dtype_bytes=2, prefix_caching=True)
    mml = int(flags["max_model_len"])
    # plan() counts tokens with two batches in flight (async scheduling); the reference uses the same.
    in_flight = 2 * int(flags.get("max_num_batched_tokens", 0))
    if "kv_memory" in logged and logged["kv_memory"] > 0:
        blocks = int(logged["kv_memory"] * GIB) // layout.bytes_per_block
        ref_tokens = layout.logged_kv_tokens(blocks, mml, in_flight) if blocks else 0
        res.logged["kv_tokens"] = ref_tokens
        engine_tokens = logged.get("kv_tokens_logged") or logged.get("gpu_blocks", 0) * layout.block_size
        if engine_tokens and len(layout.kinds) == 1 and layout.kinds[0].groups == 1:
            res.layout_error_pct = _pct(blocks * layout.block_size, engine_tokens)
    if "needed_kv_gib_for_max_len" in case:
        need = layout.blocks_per_request(mml, 0) * layout.bytes_per_block / GIB
        res.layout_error_pct = _pct(need, case["needed_kv_gib_for_max_len"])
    if case.get("gpu") is None:
        res.status, res.detail = "kv-only", "the GPU or the utilisation is not given: only the KV layout is checked"
        return res
    gpu = find_gpu(case["gpu"]["name"])
    if gpu is None:
        raise ValueError(f"{case['id']}: GPU {case['gpu']['name']!r} is not in teamserve_capacity.gpus.GPU_TABLE")
    acc = accounting(case, pinned)
    seqs, batched = int(flags["max_num_seqs"]), int(flags["max_num_batched_tokens"])
    peak = profile_peak_bytes(spec, tensor_parallel_size=tp, max_num_batched_tokens=batched, max_num_seqs=seqs,
                              act_bytes=2, eager=acc["eager"], bytes_per_logit=acc["bytes_per_logit"])
    measured: dict[str, int] = {"activation_bytes": peak}
    if not acc["cudagraph_deducted"]:
        measured["cudagraph_bytes"] = 0
    model: dict[str, Any] = {"name": case["model"]["name"], "config": config}
    if case["model"].get("weight_format"):
        model["weight_format"] = case["model"]["weight_format"]
    engine = {"gpu_memory_utilization": flags["gpu_memory_utilization"], "tensor_parallel_size": tp,
              "kv_cache_dtype": flags.get("kv_cache_dtype", "auto"), "block_size": flags.get("block_size", 16),
              "max_num_seqs": seqs, "max_num_batched_tokens": batched, "measured": measured}
    from teamserve_capacity.gpus import gpu_row
    result = plan(model, {"concurrent_sequences": seqs, "avg_context_tokens": mml, "max_context_tokens": mml,
                          **_TIMING}, [gpu_row(gpu, i) for i in range(tp)], engine)
    n = result["numbers"]
    graphs_estimate = plan(model, {"concurrent_sequences": seqs, "avg_context_tokens": mml,
                                   "max_context_tokens": mml, **_TIMING}, [gpu_row(gpu, i) for i in range(tp)],
                           {**engine, "measured": {}})["numbers"]["cudagraph_gib"]
    requested = n["requested_gib"]
    if "requested" in logged:
        requested_logged = logged["requested"]
    else:
        total = logged.get("total", gpu.total_bytes / GIB)
        requested_logged = total * flags["gpu_memory_utilization"]
    res.planned = {"weights": n["weights_gib"], "activation": round(peak / GIB, 2), "cudagraph": graphs_estimate,
                   "cudagraph_deducted": n["cudagraph_gib"], "non_torch": n["non_torch_gib"],
                   "overhead": round(n["non_torch_gib"] + peak / GIB + n["cudagraph_gib"], 2),
                   "kv_memory": n["kv_budget_gib"], "kv_tokens": n["kv_tokens"], "requested": requested}
    if "weights" in logged and "kv_memory" in logged:
        res.logged["overhead"] = round(requested_logged - logged["weights"] - logged["kv_memory"], 2)
    for term in TERMS:
        if term in res.logged and term in res.planned and res.logged[term] != 0:
            res.error_pct[term] = _pct(res.planned[term], res.logged[term])
    if case.get("excluded"):
        res.status, res.detail = "excluded", case["excluded"]
    return res


def summary(results: list[Result]) -> dict[str, dict[str, float]]:
    """Median and p90 of |error| per term over the planned (not excluded) cases, percent."""
    out: dict[str, dict[str, float]] = {}
    for term in TERMS:
        errs = sorted(abs(r.error_pct[term]) for r in results
                      if r.status == "planned" and term in r.error_pct and r.error_pct[term] == r.error_pct[term])
        if errs:
            p90 = errs[min(len(errs) - 1, max(0, -(-9 * len(errs) // 10) - 1))]
            out[term] = {"cases": len(errs), "median": round(statistics.median(errs), 2), "p90": round(p90, 2)}
    return out


def table(results: list[Result]) -> str:
    """Markdown: one row per case, planner / logged and error per term."""
    head = "| case | TP | " + " | ".join(TERMS) + " |"
    lines = [head, "|" + " --- |" * (len(TERMS) + 2)]
    for r in results:
        if r.status not in ("planned", "excluded"):
            lines.append(f"| {r.id} | {r.tp} | " + " | ".join(["-"] * len(TERMS))
                         + f" |  <!-- {r.status}: layout {r.layout_error_pct} % -->")
            continue
        cells = []
        for term in TERMS:
            if term in r.error_pct:
                fmt = "{:,}" if term == "kv_tokens" else "{}"
                cells.append(f"{fmt.format(r.planned[term])} / {fmt.format(r.logged[term])} ({r.error_pct[term]:+.1f} %)")
            else:
                cells.append("")
        lines.append(f"| {r.id}{' (excluded)' if r.status == 'excluded' else ''} | {r.tp} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the per-case table and the per-term summary (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--case", help="one case id")
    parser.add_argument("--pinned", action="store_true",
                        help="account every case as the pinned vLLM does, ignoring its release")
    args = parser.parse_args(argv)
    cases = [c for c in load_cases() if not args.case or c["id"] == args.case]
    results = [run_case(c, args.pinned) for c in cases]
    stats = summary(results)
    if args.json:
        print(json.dumps({"cases": [r.__dict__ for r in results], "summary": stats}, indent=1))
        return 0
    print(table(results))
    print()
    print("| term | cases | median abs error % | p90 abs error % |\n| --- | --- | --- | --- |")
    for term, s in stats.items():
        print(f"| {term} | {s['cases']} | {s['median']} | {s['p90']} |")
    for r in results:
        if r.status in ("kv-only", "refused", "not-refused"):
            print(f"{r.id}: {r.status}; layout vs engine {r.layout_error_pct} %; {r.detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The plan as an arithmetic table for people: what fills the GPU and what is left for the KV cache."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KIB = 1024


def _size(n: float) -> str:
    """``n`` bytes as text in the largest binary unit it reaches (GiB, MiB, KiB, else B)."""
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{n:.0f} B"


def format_table(result: Mapping[str, Any]) -> str:
    """Render a plan as a table: each quantity, the arithmetic behind it, its value.

    Args:
        result: the dict :func:`teamserve_capacity.planner.plan` returns
            (without ``table``).
    Returns:
        a multi-line string, one quantity per line: name, arithmetic, result;
        then the verdict, the levers, the advice (each with its reason) and
        the ``vllm serve`` command.
    """
    n = result["numbers"]
    f = result["flags"]
    rows: list[tuple[str, str, str]] = []
    src = n["sources"]
    rows.append(("model", f"{n['model']} ({n['architecture']}, {n['attention']})", ""))
    rows.append(("gpu", f"{n['gpu_count']} x {n['gpu']}, cc {n['compute_cap']}, {n['gpu_class']}",
                 f"{n['gpu_total_gib']:.2f} GiB"))
    rows.append(("  memory seen", src.get("total", ""), ""))
    rows.append(("vLLM may use", f"{n['gpu_total_gib']:.2f} GiB x {f['gpu-memory-utilization']:.2f}",
                 f"{n['requested_gib']:.2f} GiB"))
    per_gpu = f" / {n['gpu_count']} GPUs" if n["gpu_count"] > 1 and src.get("weights") != "measured" else ""
    rows.append((f"weights, {n['weight_format']}", n.get("weights_source", src.get("weights", "")) + per_gpu,
                 f"{n['weights_gib']:.2f} GiB"))
    rows.append(("non-torch", src.get("non_torch", ""), f"{n['non_torch_gib']:.2f} GiB"))
    rows.append(("activation peak", f"max(forward of {f['max-num-batched-tokens']:,} tokens, sampler), "
                 + src.get("activation", ""), f"{n['activation_peak_gib']:.2f} GiB"))
    rows.append(("CUDA graphs", src.get("cudagraph", ""), f"{n['cudagraph_gib']:.2f} GiB"))
    rows.append(("left for KV", f"{n['requested_gib']:.2f} - {n['weights_gib']:.2f} - "
                 f"{n['non_torch_gib']:.2f} - {n['activation_peak_gib']:.2f} - {n['cudagraph_gib']:.2f}",
                 f"{n['kv_budget_gib']:.2f} GiB"))
    rows.append(("", "", ""))
    for layer in result["layers"]:
        if layer["bytes_per_token"]:
            rows.append((f"kv_token {layer['kind']}", f"{layer['layers']} layers x "
                         f"{_size(layer['bytes_per_token'])} ({layer['kv_groups']} group(s))",
                         _size(layer["layers"] * layer["bytes_per_token"])))
        else:
            rows.append((f"state {layer['kind']}", f"{layer['layers']} layers x "
                         f"{_size(layer['state_bytes_per_seq'])} per sequence", ""))
    rows.append(("kv_token", f"{n['kv_dtype_bytes']}-byte elements, per GPU", _size(n["kv_bytes_per_token"])))
    rows.append(("blocks", f"{_size(n['kv_budget_bytes'])} // {_size(n['bytes_per_block'])} "
                 f"({n['block_size']} tokens)", f"{n['blocks']:,}"))
    rows.append(("KV tokens", f"vLLM's \"KV cache size\" at --max-model-len {n['max_model_len']:,}",
                 f"{n['kv_tokens']:,}"))
    if n.get("users"):
        rows.append(("concurrent", f"{n['users']} users x {n['active_fraction']:g} active at once, rounded up",
                     f"{n['concurrent_sequences']} sequences"))
        rows.append(("  assumption", n["concurrency_assumption"].split("; ", 1)[-1], ""))
    rows.append(("avg_context", "tokens", f"{n['avg_context_tokens']:,}"))
    rows.append(("kv_per_seq", f"{n['blocks_per_seq_avg']:,} blocks", f"{n['kv_per_seq_avg_mib']:,.1f} MiB"))
    rows.append(("max_concurrent", f"{n['blocks']:,} // {n['blocks_per_seq_avg']:,}",
                 f"{n['max_concurrency_avg']} sequences"))
    rows.append(("at max context", f"{n['blocks']:,} // {n['blocks_per_seq_max']:,}",
                 f"{n['max_concurrency_max']} x {n['max_model_len']:,} tokens"))
    rows.append(("", "", ""))
    rows.append(("verdict", result["verdict"], ""))
    for lever in result.get("levers", []):
        rows.append(("  lever", lever, ""))
    for item in result.get("advice", []):
        rows.append(("advice", item["advice"], ""))
        rows.append(("  because", item["reason"], ""))
    width0 = max(len(r[0]) for r in rows)
    width1 = max(len(r[1]) for r in rows if r[2])
    lines = []
    for a, b, c in rows:
        if not c:
            lines.append(f"{a:<{width0}}  {b}".rstrip())
        else:
            lines.append(f"{a:<{width0}}  {b:<{width1}}  -> {c}")
    flags = " ".join(f"--{k} {str(v).lower() if isinstance(v, bool) else v}"
                     for k, v in result["flags"].items() if v is not None and v is not True)
    bools = " ".join(f"--{k}" for k, v in result["flags"].items() if v is True)
    lines.append("")
    lines.append(f"vllm serve {n['model']} {flags} {bools}".rstrip())
    return "\n".join(lines)

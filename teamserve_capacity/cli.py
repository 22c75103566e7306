"""``teamserve-plan``: the planner on the command line.

    teamserve-plan plan --config config.json --weight-format bf16 \
        --weight-bytes 16060522496 --gpu-mib 97887 --compute-cap 12.0 \
        --concurrent 16 --avg-context 4000 --max-context 32768 [--json]

or ``teamserve-plan plan --profile profile.yml`` is not offered (no YAML in the
standard library); ``--input plan.json`` takes the four dicts the Ansible
filter takes: ``{"model": ..., "workload": ..., "gpus": [...], "engine": ...}``.
Exit status: 0 fits, 1 does not fit, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .errors import PlanError
from .logs import measured_from_log, parse_startup_log
from .planner import PINNED_VLLM, plan


def _count(text: str) -> int:
    """Parse a whole count written as an integer or in float notation ("32.8e9"); ValueError otherwise."""
    value = float(text)
    if value != int(value) or value <= 0:
        raise ValueError(text)
    return int(value)


def _parser() -> argparse.ArgumentParser:
    """The ``teamserve-plan`` argument parser (sizes in MiB/bytes, contexts in tokens, targets in s)."""
    p = argparse.ArgumentParser(prog="teamserve-plan", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    q = sub.add_parser("plan", help="plan one deployment")
    q.add_argument("--input", help="JSON file with model, workload, gpus, engine (overrides the rest)")
    q.add_argument("--config", help="the model's config.json")
    q.add_argument("--name", default="model", help="HF repo id or path, for the report")
    q.add_argument("--weight-format", default="bf16",
                   choices=["bf16", "fp16", "fp8", "awq", "gptq", "nvfp4", "mxfp4"])
    q.add_argument("--weight-bytes", type=int, help="safetensors index metadata.total_size")
    q.add_argument("--params", type=_count,
                   help="parameter count, e.g. 32800000000 or 32.8e9 (when --weight-bytes is unknown)")
    q.add_argument("--gpu-mib", type=int, default=97887, help="nvidia-smi memory.total, MiB")
    q.add_argument("--gpu-name", default="NVIDIA RTX PRO 6000 Blackwell Workstation Edition")
    q.add_argument("--compute-cap", default="12.0")
    q.add_argument("--gpus", type=int, default=1, help="GPUs available")
    q.add_argument("--tensor-parallel-size", type=int, default=1)
    q.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    q.add_argument("--kv-cache-dtype", default="auto")
    q.add_argument("--block-size", type=int, default=16)
    q.add_argument("--concurrent", type=int, default=8, help="concurrent sequences")
    q.add_argument("--avg-context", type=int, default=4000, help="average tokens per sequence")
    q.add_argument("--max-context", type=int, default=32768, help="longest request, tokens")
    q.add_argument("--ttft", type=float, default=1.0, help="p95 time-to-first-token target, s")
    q.add_argument("--tpot", type=float, default=0.05, help="time-per-output-token target, s")
    q.add_argument("--startup-log", help="a real vLLM start-up log whose numbers override estimates")
    q.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def _inputs(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's four inputs ``{model, workload, gpus, engine}`` from ``--input`` or the flags.

    Raises:
        PlanError: neither --input nor --config, or --input not a JSON object.
        OSError, json.JSONDecodeError: a file that cannot be read or parsed.
    """
    if args.input:
        with open(args.input, encoding="utf-8") as fh:
            data = json.load(fh)
        if not isinstance(data, dict):
            raise PlanError("--input", type(data).__name__,
                            "give a JSON object with model, workload, gpus and engine")
        return data
    if not args.config:
        raise PlanError("--config", None, "give the model's config.json (or --input)")
    with open(args.config, encoding="utf-8") as fh:
        config = json.load(fh)
    model: dict[str, Any] = {"name": args.name, "served_model_name": args.name, "config": config,
                             "weight_format": args.weight_format}
    if args.weight_bytes is not None:
        model["weight_bytes"] = args.weight_bytes
    if args.params is not None:
        model["params"] = args.params
    gpus = [{"index": i, "name": args.gpu_name, "memory_total_mib": args.gpu_mib,
             "compute_cap": args.compute_cap, "driver_version": ""} for i in range(args.gpus)]
    engine: dict[str, Any] = {"gpu_memory_utilization": args.gpu_memory_utilization,
                              "kv_cache_dtype": args.kv_cache_dtype,
                              "tensor_parallel_size": args.tensor_parallel_size,
                              "block_size": args.block_size, "vllm_version": PINNED_VLLM}
    workload = {"concurrent_sequences": args.concurrent, "avg_context_tokens": args.avg_context,
                "max_context_tokens": args.max_context, "ttft_p95_seconds": args.ttft,
                "tpot_seconds": args.tpot}
    return {"model": model, "workload": workload, "gpus": gpus, "engine": engine}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 fits, 1 does not fit, 2 bad input)."""
    args = _parser().parse_args(argv)
    try:
        inputs = _inputs(args)
        engine = dict(inputs.get("engine") or {})
        if getattr(args, "startup_log", None):
            with open(args.startup_log, encoding="utf-8") as fh:
                engine["measured"] = measured_from_log(parse_startup_log(fh.read()))
        result = plan(inputs["model"], inputs["workload"], inputs["gpus"], engine)
    except PlanError as err:
        print(f"teamserve-plan: {err}", file=sys.stderr)
        return 2
    except (OSError, json.JSONDecodeError, KeyError) as err:
        print(f"teamserve-plan: cannot read input: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({k: v for k, v in result.items()}, indent=2, sort_keys=True))
    else:
        print(result["table"])
    return 0 if result["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""``teamserve-plan``: the planner on the command line.

    teamserve-plan plan --config config.json --gpu rtx-pro-6000 \\
        --checkpoint model.safetensors.index.json --users 20 --avg-context 4000 --max-context 32768
    teamserve-plan plan --input plan.json          # the four dicts the Ansible filter takes
    teamserve-plan gpus                            # the GPU table --gpu reads
    teamserve-plan sweep-report SWEEP.json --png sweep.png [--ttft 2.0]   # a concurrency sweep, re-judged

Exit status, the same with and without --json: 0 the workload fits, 1 it does
not fit (the plan is still printed, with the levers), 2 bad input (the error
names the field, the value and the fix; with --json also as
``{"error": {...}}`` on stdout). argparse's own usage errors exit 2 too.
``sweep-report`` exits 0 once printed, 2 when the file is not a sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from . import sweep
from .errors import PlanError
from .gpus import GIB, GPU_TABLE, format_table, gpu_by_key, gpu_row
from .hardware import WEIGHT_FORMATS
from .logs import measured_from_log, parse_startup_log
from .planner import DEFAULT_ACTIVE_FRACTION, PINNED_VLLM, plan
from .weights import read_checkpoint_file

EXIT_FITS, EXIT_DOES_NOT_FIT, EXIT_BAD_INPUT = 0, 1, 2
# The GPU planned for when neither --gpu nor --gpu-mib is given: the vllm role's vllm_gpu_expected.
DEFAULT_GPU = "rtx-pro-6000"
# Flags that shape the plan: with --input they would be ignored, so they are refused there.
PLAN_FLAGS = ("config", "name", "weight_format", "checkpoint", "revision", "weight_bytes", "params",
              "measured_weights_gib", "gpu", "gpu_mib", "gpu_reserved_mib", "gpu_name", "compute_cap", "gpus",
              "tensor_parallel_size", "gpu_memory_utilization", "kv_cache_dtype", "block_size",
              "max_num_seqs", "max_num_batched_tokens", "concurrent", "users", "active_fraction",
              "avg_context", "max_context", "ttft", "tpot", "untrusted_users", "startup_log")


def _count(text: str) -> int:
    """Parse a whole count written as an integer or in float notation ("32.8e9"); ValueError otherwise."""
    value = float(text)
    if value != int(value) or value <= 0:
        raise ValueError(text)
    return int(value)


def _parser() -> argparse.ArgumentParser:
    """The ``teamserve-plan`` argument parser (sizes in MiB/bytes/GiB as named, contexts in tokens, targets in s)."""
    p = argparse.ArgumentParser(prog="teamserve-plan", description=__doc__.split("\n\n")[0],
                                epilog="exit status: 0 fits, 1 does not fit, 2 bad input (text and --json alike)")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gpus", help="list the GPUs --gpu knows (memory as vLLM sees it, cc, class, source)")
    g.add_argument("--json", action="store_true", help="print JSON instead of the table")
    s = sub.add_parser("sweep-report", help="a concurrency sweep's table, knees and recommendation "
                       "(the JSON playbooks/sweep.yml writes); --png draws it",
                       epilog="exit status: 0 printed, 2 bad input")
    s.add_argument("sweep", help="the sweep JSON (reports/<inventory>/sweep/<host>-<time>.json)")
    s.add_argument("--png", help="write the plot (TTFT and TPOT percentiles against concurrency) to this file")
    s.add_argument("--ttft", type=float, help="judge the same measurements against this TTFT p95 target (s) "
                   "instead of the recorded one: a what-if, nothing is measured again")
    s.add_argument("--tpot", type=float, help="the same for the TPOT p95 target (s)")
    s.add_argument("--json", action="store_true", help="print the (re-judged) sweep JSON instead of the report")
    q = sub.add_parser("plan", help="plan one deployment",
                       epilog="exit status: 0 fits, 1 does not fit, 2 bad input (text and --json alike)")
    a = q.add_argument
    a("--input", help="JSON file with model, workload, gpus, engine (the Ansible filter's inputs); "
      "refused together with any flag below but --json")
    a("--json", action="store_true", help="print JSON instead of the table")
    m = q.add_argument_group("model")
    m.add_argument("--config", help="the model's config.json")
    m.add_argument("--name", help="HF repo id or path, for the report (default: model)")
    m.add_argument("--weight-format", choices=list(WEIGHT_FORMATS),
                   help="default: the checkpoint's own (its quantization_config, else its dtype)")
    m.add_argument("--checkpoint", help="the checkpoint's model.safetensors.index.json, the hub's tree listing "
                   "of the pinned revision (JSON), or a local snapshot directory: weights are then read, "
                   "not estimated")
    m.add_argument("--revision", help="the checkpoint's commit, for the report")
    m.add_argument("--weight-bytes", type=int, help="safetensors index metadata.total_size, bytes")
    m.add_argument("--params", type=_count,
                   help="parameter count, e.g. 32800000000 or 32.8e9 (when the checkpoint is unknown)")
    m.add_argument("--measured-weights-gib", type=float,
                   help="weights per GPU as the engine logged them ('Model loading took X GiB')")
    h = q.add_argument_group("GPUs")
    h.add_argument("--gpu", help=f"a GPU from `teamserve-plan gpus` (default {DEFAULT_GPU})")
    h.add_argument("--gpu-mib", type=int, help="any other GPU: nvidia-smi memory.total, MiB, with --compute-cap "
                   "(without it only a total that exactly one card of the table has, planned as that card)")
    h.add_argument("--gpu-reserved-mib", type=int,
                   help="the box's nvidia-smi memory.reserved, MiB (with --gpu, --gpu-mib or the default card): "
                   "the plan then uses memory.total - memory.reserved, what vLLM sees to within 1 MiB, "
                   "instead of the table's or the estimated total")
    h.add_argument("--gpu-name", help="with --gpu-mib: nvidia-smi's name, for the report and the advice")
    h.add_argument("--compute-cap", help='with --gpu-mib: compute capability, e.g. "8.9"')
    h.add_argument("--gpus", type=int, help="GPUs available (default 1)")
    e = q.add_argument_group("engine")
    e.add_argument("--tensor-parallel-size", type=int, help="default 1")
    e.add_argument("--gpu-memory-utilization", type=float, help="default 0.9")
    e.add_argument("--kv-cache-dtype", help="default auto")
    e.add_argument("--block-size", type=int, help="default 16")
    e.add_argument("--max-num-seqs", type=int, help="fix --max-num-seqs instead of planning it")
    e.add_argument("--max-num-batched-tokens", type=int, help="fix --max-num-batched-tokens instead of planning it")
    e.add_argument("--startup-log", help="a real vLLM start-up log whose numbers override estimates")
    e.add_argument("--untrusted-users", action="store_true",
                   help="users do not fully trust each other (prefix-cache advice)")
    w = q.add_argument_group("workload")
    w.add_argument("--concurrent", type=int, help="concurrent sequences (default 8)")
    w.add_argument("--users", type=int, help="headcount instead of --concurrent: concurrent = users x active fraction")
    w.add_argument("--active-fraction", type=float,
                   help=f"with --users: share generating at once (default {DEFAULT_ACTIVE_FRACTION}, an assumption)")
    w.add_argument("--avg-context", type=int, help="average tokens per sequence (default 4000)")
    w.add_argument("--max-context", type=int, help="longest request, tokens (default 32768)")
    w.add_argument("--ttft", type=float, help="p95 time-to-first-token target, s (default 1.0)")
    w.add_argument("--tpot", type=float, help="time-per-output-token target, s (default 0.05)")
    return p


def _pick(value: Any, default: Any) -> Any:
    """``value`` unless it is None."""
    return default if value is None else value


def _read_json(path: str, field: str) -> Any:
    """Parse the JSON file at ``path``; PlanError naming ``field`` if it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as err:
        raise PlanError(field, path, f"cannot read it ({err.strerror}); give a readable file") from err
    except ValueError as err:
        raise PlanError(field, path, f"is not JSON ({err}); give the file itself") from err


def _checkpoint(path: str, revision: str | None) -> dict[str, Any]:
    """``vllm_model.checkpoint`` from ``--checkpoint``: an index/tree file, or a local snapshot directory.

    Raises:
        PlanError: the path cannot be read, or holds no index and no ``*.safetensors``.
    """
    origin = "local directory"
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            data: dict[str, Any] = {"index": _read_json(index, "--checkpoint")}
        else:
            files = {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
                     if n.endswith(".safetensors")}
            data = {"files": files}
    else:
        try:
            with open(path, encoding="utf-8") as fh:
                data = read_checkpoint_file(fh.read())
        except OSError as err:
            raise PlanError("--checkpoint", path, f"cannot read it ({err.strerror}); give a readable file "
                            "or snapshot directory") from err
        origin = "hub listing" if "tree" in data else "local file"
    data["origin"] = origin
    if revision:
        data["revision"] = revision
    return data


def _inputs(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's four inputs ``{model, workload, gpus, engine}`` from ``--input`` or the flags.

    Raises:
        PlanError: --input with a plan flag, no --config, conflicting GPU flags, or unreadable files.
    """
    if args.input:
        given = [f"--{f.replace('_', '-')}" for f in PLAN_FLAGS if getattr(args, f) not in (None, False)]
        if given:
            raise PlanError("--input", args.input, f"is the whole input: drop {', '.join(given)} or put "
                            "them in its model/workload/gpus/engine")
        data = _read_json(args.input, "--input")
        if not isinstance(data, dict):
            raise PlanError("--input", type(data).__name__,
                            "give a JSON object with model, workload, gpus and engine")
        return {"model": data.get("model"), "workload": data.get("workload"), "gpus": data.get("gpus"),
                "engine": data.get("engine") or {}}
    if not args.config:
        raise PlanError("--config", None, "give the model's config.json (or --input)")
    config = _read_json(args.config, "--config")
    name = _pick(args.name, "model")
    model: dict[str, Any] = {"name": name, "served_model_name": name, "config": config}
    if args.weight_format:
        model["weight_format"] = args.weight_format
    if args.checkpoint:
        model["checkpoint"] = _checkpoint(args.checkpoint, args.revision)
    if args.weight_bytes is not None:
        model["weight_bytes"] = args.weight_bytes
    if args.params is not None:
        model["params"] = args.params
    count = _pick(args.gpus, 1)
    gpus: list[dict[str, Any]]
    if args.gpu is not None:
        clash = [f for f, v in (("--gpu-mib", args.gpu_mib), ("--gpu-name", args.gpu_name),
                                ("--compute-cap", args.compute_cap)) if v is not None]
        if clash:
            raise PlanError("--gpu", args.gpu, f"names the card already: drop {', '.join(clash)}, or drop "
                            "--gpu and describe another card with --gpu-mib and --compute-cap")
        gpus = [gpu_row(gpu_by_key(args.gpu), i) for i in range(count)]
    elif args.gpu_mib is not None:
        same = [g for g in GPU_TABLE if g.nvidia_smi_mib == args.gpu_mib]
        if args.compute_cap is None and args.gpu_name is None and len(same) == 1:
            # The one card in the table with this memory.total: planned as that card, and the report names it.
            gpus = [gpu_row(same[0], i) for i in range(count)]
        elif args.compute_cap is None:
            raise PlanError("--compute-cap", None, 'give the card\'s compute capability with --gpu-mib, e.g. "8.9" '
                            "(nvidia-smi --query-gpu=compute_cap), or name a known card with --gpu")
        else:
            gpus = [{"index": i, "name": _pick(args.gpu_name, f"GPU ({args.gpu_mib:,} MiB)"),
                     "memory_total_mib": args.gpu_mib, "compute_cap": args.compute_cap, "driver_version": ""}
                    for i in range(count)]
    else:
        if args.gpu_name is not None or args.compute_cap is not None:
            raise PlanError("--gpu-mib", None, "--gpu-name and --compute-cap describe a card given by --gpu-mib; "
                            "give it, or use --gpu")
        gpus = [gpu_row(gpu_by_key(DEFAULT_GPU), i) for i in range(count)]
    if args.gpu_reserved_mib is not None:
        total = int(gpus[0]["memory_total_mib"])
        if not 0 <= args.gpu_reserved_mib < total:
            raise PlanError("--gpu-reserved-mib", args.gpu_reserved_mib,
                            f"give nvidia-smi's memory.reserved in MiB, >= 0 and below the card's memory.total "
                            f"({total}): `nvidia-smi --query-gpu=memory.total,memory.reserved --format=csv`")
        for row in gpus:
            row["memory_reserved_mib"] = args.gpu_reserved_mib
    engine: dict[str, Any] = {"gpu_memory_utilization": _pick(args.gpu_memory_utilization, 0.9),
                              "kv_cache_dtype": _pick(args.kv_cache_dtype, "auto"),
                              "tensor_parallel_size": _pick(args.tensor_parallel_size, 1),
                              "block_size": _pick(args.block_size, 16), "vllm_version": PINNED_VLLM,
                              "users_trust_each_other": not args.untrusted_users}
    if args.max_num_seqs is not None:
        engine["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        engine["max_num_batched_tokens"] = args.max_num_batched_tokens
    measured: dict[str, int] = {}
    if args.startup_log:
        try:
            with open(args.startup_log, encoding="utf-8") as fh:
                measured = measured_from_log(parse_startup_log(fh.read()))
        except OSError as err:
            raise PlanError("--startup-log", args.startup_log, f"cannot read it ({err.strerror})") from err
    if args.measured_weights_gib is not None:
        if not args.measured_weights_gib > 0:
            raise PlanError("--measured-weights-gib", args.measured_weights_gib,
                            "give the engine's logged weights per GPU in GiB, > 0")
        measured["weights_bytes"] = int(args.measured_weights_gib * GIB)
    if measured:
        engine["measured"] = measured
    workload: dict[str, Any] = {"avg_context_tokens": _pick(args.avg_context, 4000),
                                "max_context_tokens": _pick(args.max_context, 32768),
                                "ttft_p95_seconds": _pick(args.ttft, 1.0), "tpot_seconds": _pick(args.tpot, 0.05)}
    if args.users is not None:
        if args.concurrent is not None:
            raise PlanError("--users", args.users, "give --users (headcount) or --concurrent, not both")
        workload["users"] = args.users
        if args.active_fraction is not None:
            workload["active_fraction"] = args.active_fraction
    else:
        if args.active_fraction is not None:
            raise PlanError("--active-fraction", args.active_fraction, "applies to --users; give --users too")
        workload["concurrent_sequences"] = _pick(args.concurrent, 8)
    return {"model": model, "workload": workload, "gpus": gpus, "engine": engine}


def _sweep_report(args: argparse.Namespace) -> int:
    """``teamserve-plan sweep-report``: print (and with --png draw) a sweep, re-judged when targets are given."""
    try:
        with open(args.sweep, encoding="utf-8") as handle:
            document = json.load(handle)
        targets = dict(document["targets"])
        if args.ttft is not None or args.tpot is not None:
            targets.update({k: v for k, v in (("ttft_seconds", args.ttft), ("tpot_seconds", args.tpot))
                            if v is not None})
            document = {**document, "targets": targets,
                        **sweep.analyse(document["steps"], targets, document["plan"])}
        lines = sweep.report(document)
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"teamserve-plan: {args.sweep}: not a sweep this tool can read ({err!r}); give the JSON "
              "playbooks/sweep.yml wrote", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.png:
        from .sweep_plot import plot
        plot(document, args.png)
    print(json.dumps(document, indent=2, sort_keys=True) if args.json else "\n".join(lines))
    return EXIT_FITS


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 fits, 1 does not fit, 2 bad input; see the module docstring)."""
    args = _parser().parse_args(argv)
    if args.command == "gpus":
        if args.json:
            print(json.dumps([{"key": g.key, "names": list(g.names), "nvidia_smi_mib": g.nvidia_smi_mib,
                               "vllm_total_gib": round(g.total_bytes / GIB, 2), "measured": g.measured,
                               "source": g.source, "compute_cap": f"{g.compute_cap[0]}.{g.compute_cap[1]}",
                               "class": g.gpu_class} for g in GPU_TABLE], indent=2))
        else:
            print(format_table())
        return EXIT_FITS
    if args.command == "sweep-report":
        return _sweep_report(args)
    try:
        inputs = _inputs(args)
        result = plan(inputs["model"], inputs["workload"], inputs["gpus"], inputs["engine"])
    except PlanError as err:
        if args.json:
            print(json.dumps({"error": {"field": err.field, "value": err.value, "fix": err.fix,
                                        "message": str(err)}}, indent=2, default=str))
        print(f"teamserve-plan: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(result["table"])
    return EXIT_FITS if result["fits"] else EXIT_DOES_NOT_FIT


if __name__ == "__main__":
    sys.exit(main())

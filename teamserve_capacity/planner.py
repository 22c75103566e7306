"""From a model, a workload, the GPUs and engine settings to vLLM flags and a verdict.

The entry point is :func:`plan`; its inputs are the plain dicts the Ansible
``vllm`` role passes (see docs/contracts.md), so the filter plugin and the CLI
share every check and every number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .advice import advise
from .errors import PlanError
from .gpus import find_gpu, is_geforce, vllm_total
from .hardware import QUANT_METHOD_FLAG, QUANT_METHOD_FORMATS, WEIGHT_FORMATS, fp8_kv_support, parse_compute_cap
from .kv import KVLayout, cdiv, kv_layout
from .memory import GIB, MIB, Budget, Measured, estimate_budget
from .model import DTYPE_BYTES, ModelSpec, parse_config
from .registry import check_model, load_registry
from .weights import (
    ONLINE_FORMATS,
    Quant,
    checkpoint_total,
    estimate_from_params,
    estimate_weights,
    mxfp4_moe_backend,
    mxfp4_padding_bytes_per_rank,
    quant_from_config,
)

# The vLLM release whose accounting this module reproduces (the project's pin).
PINNED_VLLM = "0.32.0"
# Releases whose memory accounting was read and found the same as 0.32.0's for every path the planner
# models (request_memory, memory_profiling, profile_run and the sampler run, the CUDA-graph estimate and
# capture sizes, page sizes, KV-cache grouping, hybrid block alignment in "align" mode, max concurrency).
# What differs lies outside the model: 0.31.0's mamba_cache_mode "all" and GLM-5 tensor layout, 0.32.0's
# externally held weights; docs/vllm-versions.md lists the functions compared.
SUPPORTED_VLLM = ("0.31.0", "0.32.0")

# --kv-cache-dtype values modelled (vLLM 0.32 vllm/config/cache.py CacheDType).
KV_CACHE_DTYPES: dict[str, int | None] = {
    "auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)

# vLLM 0.32 engine/arg_utils.py: the OpenAI server batches 8192 tokens per step
# on GPUs with >= 70 GiB (2048 on smaller ones, which the planner overrides).
DEFAULT_BATCHED_TOKENS = 8192
# CUDA graphs are captured for batch sizes in multiples of 8 (vLLM
# compilation config cudagraph_capture_sizes), so max-num-seqs is rounded to 8.
SEQS_ROUNDING = 8
# Upper bound of the planned --max-num-seqs: vLLM 0.32's own default on GPUs
# with >= 70 GiB (engine/arg_utils.py, OpenAI server).
MAX_NUM_SEQS = 1024
# Queue cap: admit at most this many waiting requests per running slot before
# vLLM answers 503 (--max-num-queued-reqs), so a full server says so instead of
# queueing without bound. 4 is a judgement, not a vLLM default: a queued request
# waits behind at most about four requests per slot.
QUEUE_PER_SEQ = 4
# One user may hold at most this share of the batch (--max-num-seqs) in flight by default: with a quarter
# each, a user who floods the gateway leaves three quarters of the batch to the others, and four users at
# their cap fill it exactly, so the cap costs no throughput once the team is busy. A judgement, not a
# vLLM default; the gateway's per-user in-flight cap and the engine's n / prompts-per-call ceilings use it.
USER_SHARE_DIVISOR = 4


def user_inflight_share(max_num_seqs: int) -> int:
    """Default per-user in-flight cap, in requests: ``max(1, max_num_seqs // USER_SHARE_DIVISOR)``.

    Input: the engine's --max-num-seqs (sequences in one batch), an int >= 1 (callers validate it).
    Output: int >= 1. Rule and reason: :data:`USER_SHARE_DIVISOR`.
    """
    return max(1, int(max_num_seqs) // USER_SHARE_DIVISOR)


def user_fair_share(max_num_seqs: int) -> int:
    """A user's fair share of the batch, in engine sequences: ``max(1, user_inflight_share(seqs) // 2)``.

    Input: the engine's --max-num-seqs, an int >= 1. Output: int >= 1, at most half of max-num-seqs when
    max-num-seqs >= 2 (so never the whole batch, whatever the rounding).

    The engine runs with ``--scheduling-policy priority`` (vLLM's V1 scheduler takes waiting requests
    lowest ``priority`` first, ties by arrival, and preempts the highest value first when the KV cache
    runs out: vllm/v1/core/sched/scheduler.py, 0.32.0). The gateway gives a request priority 0 while its
    user has at most this many sequences in flight with it, and a larger value past it, so when the
    batch is full each user's first half of their in-flight cap goes ahead of anyone's second half: a
    user at their cap yields engine slots to a colleague within theirs. A judgement, like
    :data:`USER_SHARE_DIVISOR`; half the cap keeps a lone user's whole cap in the batch while nobody
    else waits (priority only orders waiting requests).
    """
    return max(1, user_inflight_share(max_num_seqs) // 2)


SECONDS_PER_DAY = 86_400


def user_tokens_per_day(max_num_seqs: int, tpot_seconds: float) -> int:
    """Default per-user daily token budget, in tokens (prompt + completion, per UTC day).

    Inputs: the engine's --max-num-seqs (an int >= 1) and the workload's TPOT target (seconds per output
    token, > 0; callers validate both). Output: ``int(user_fair_share(seqs) * 86,400 / tpot_seconds)``,
    the tokens the user's fair share of the batch generates in a whole day at the TPOT target.

    A ceiling against a runaway job, not a ration: someone working by hand never comes near it, a script
    looping at its fair share all day reaches it. An admin rations with a smaller ``tokens_per_day`` per
    user. A judgement, like :data:`USER_SHARE_DIVISOR`; the gateway counts the engine's own usage figures.
    """
    return int(user_fair_share(max_num_seqs) * SECONDS_PER_DAY / tpot_seconds)


# Share of a team generating at the same moment when a workload gives a
# headcount (vllm_workload.users) instead of concurrent sequences. A stated
# assumption, not a measurement: people read, think and type between
# requests, so "a team of ten produces far fewer than ten concurrent
# generations"; measure the real figure (the gateway's in-flight requests) and
# give concurrent_sequences once it is known.
DEFAULT_ACTIVE_FRACTION = 0.25


@dataclass(frozen=True)
class Workload:
    """What the team asks of the server.

    Attributes:
        concurrent_sequences: sequences generating at the same time.
        avg_context_tokens: average prompt + output tokens per sequence.
        max_context_tokens: the longest request allowed, tokens.
        ttft_p95_seconds: time-to-first-token target at the 95th percentile, s.
        tpot_seconds: time-per-output-token target, s.
        users: the headcount concurrent_sequences was derived from, or None.
        active_fraction: the share of users assumed generating at once, or None.
        assumption: how concurrent_sequences was derived from a headcount, or "".
    """

    concurrent_sequences: int
    avg_context_tokens: int
    max_context_tokens: int
    ttft_p95_seconds: float
    tpot_seconds: float
    users: int | None = None
    active_fraction: float | None = None
    assumption: str = ""


def _req(mapping: Mapping[str, Any], key: str, where: str) -> Any:
    """``mapping[key]``; PlanError naming ``where.key`` if it is missing or null."""
    if not isinstance(mapping, Mapping):
        raise PlanError(where, mapping, "must be a mapping (dict)")
    if key not in mapping or mapping[key] is None:
        raise PlanError(f"{where}.{key}", None, "is required")
    return mapping[key]


def _pos_int(value: Any, field: str, fix: str) -> int:
    """``value`` if it is an int >= 1 (not a bool); else PlanError(field, value, fix)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(field, value, fix)
    return value


def _pos_float(value: Any, field: str, fix: str) -> float:
    """``value`` as a float if it is a number > 0 (not a bool); else PlanError(field, value, fix)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanError(field, value, fix)
    return float(value)


def _concurrency(workload: Mapping[str, Any], w: str) -> tuple[int, int | None, float | None, str]:
    """Concurrent sequences, given directly or from a headcount: (sequences, users, fraction, assumption).

    ``concurrent_sequences`` as given; else ``users`` x ``active_fraction``
    (default :data:`DEFAULT_ACTIVE_FRACTION`), rounded up, at least 1.

    Raises:
        PlanError: both or neither given, or a bad headcount/fraction.
    """
    has_seqs = workload.get("concurrent_sequences") is not None
    has_users = workload.get("users") is not None
    if has_seqs and has_users:
        raise PlanError(f"{w}.users", workload["users"],
                        "give either users (headcount) or concurrent_sequences, not both")
    if not has_users:
        if workload.get("active_fraction") is not None:
            raise PlanError(f"{w}.active_fraction", workload["active_fraction"],
                            "applies to users (a headcount); drop it or give users instead of "
                            "concurrent_sequences")
        seqs = _pos_int(_req(workload, "concurrent_sequences", w), f"{w}.concurrent_sequences",
                        "give the number of sequences generating at once, a whole number >= 1 "
                        "(or users, the headcount)")
        return seqs, None, None, ""
    users = _pos_int(workload["users"], f"{w}.users", "give the team's headcount, a whole number >= 1")
    fraction = workload.get("active_fraction", DEFAULT_ACTIVE_FRACTION)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise PlanError(f"{w}.active_fraction", fraction,
                        "give the share of users generating at the same moment, 0 < x <= 1 (e.g. 0.25)")
    seqs = max(1, math.ceil(users * fraction - 1e-9))
    stated = "assumed" if workload.get("active_fraction") is None else "given"
    return seqs, users, float(fraction), (
        f"{users} users x {fraction:g} active at once ({stated}) = {seqs} concurrent sequences; a team of ten "
        "produces far fewer than ten concurrent generations: measure the gateway's in-flight requests and "
        "give concurrent_sequences when known")


def parse_workload(workload: Mapping[str, Any]) -> Workload:
    """Validate the ``vllm_workload`` dict.

    Raises:
        PlanError: a missing or non-positive field, or an average context
            longer than the maximum.
    """
    w = "vllm_workload"
    if not isinstance(workload, Mapping):
        raise PlanError(w, workload, "must be a mapping (dict)")
    seqs, users, fraction, assumption = _concurrency(workload, w)
    avg = _pos_int(_req(workload, "avg_context_tokens", w), f"{w}.avg_context_tokens",
                   "give the average prompt + output tokens per sequence, >= 1")
    mx = _pos_int(_req(workload, "max_context_tokens", w), f"{w}.max_context_tokens",
                  "give the longest request in tokens, >= 1")
    if avg > mx:
        raise PlanError(f"{w}.avg_context_tokens", avg,
                        f"cannot exceed max_context_tokens ({mx}); raise the maximum or lower the average")
    ttft = _pos_float(workload.get("ttft_p95_seconds", 1.0), f"{w}.ttft_p95_seconds",
                      "give the p95 time-to-first-token target in seconds, > 0 (e.g. 1.0)")
    tpot = _pos_float(workload.get("tpot_seconds", 0.05), f"{w}.tpot_seconds",
                      "give the time-per-output-token target in seconds, > 0 (e.g. 0.05)")
    return Workload(seqs, avg, mx, ttft, tpot, users, fraction, assumption)


def _weight_format(model: Mapping[str, Any], spec: ModelSpec) -> str:
    """The weight format the plan sizes: ``vllm_model.weight_format``, else the checkpoint's own.

    Raises:
        PlanError: an unknown format, a checkpoint quantisation the planner
            does not size, or a format that contradicts the checkpoint's
            ``quantization_config`` (vLLM loads what the checkpoint holds).
    """
    fmt = model.get("weight_format")
    if fmt is not None and fmt not in WEIGHT_FORMATS:
        raise PlanError("vllm_model.weight_format", fmt, "use one of " + ", ".join(WEIGHT_FORMATS))
    method = spec.quant_method
    if method is None:
        return str(fmt) if fmt is not None else ("fp16" if spec.dtype == "float16" else "bf16")
    if method not in QUANT_METHOD_FLAG:
        raise PlanError("vllm_model.config.quantization_config.quant_method", method,
                        "not a quantisation the planner sizes; known: " + ", ".join(QUANT_METHOD_FLAG)
                        + " (or give the measured weights: vllm_engine.measured.weights_bytes)")
    allowed = QUANT_METHOD_FORMATS[method]
    if fmt is None:
        return allowed[0]
    if fmt not in allowed:
        raise PlanError("vllm_model.weight_format", fmt,
                        f"the checkpoint is {method}-quantised (config.json quantization_config), which "
                        f"vLLM loads as it is: use weight_format {' or '.join(allowed)}, or the 16-bit "
                        "repository of the model")
    return str(fmt)


def _weights_total(model: Mapping[str, Any], spec: ModelSpec, fmt: str) -> tuple[int, str, str]:
    """All weights of the model in bytes as vLLM loads them, and where the number came from.

    In order: ``checkpoint`` (the safetensors index or files at the pinned
    revision, from the hub's listing or the local cache), ``weight_bytes`` (the
    index's metadata.total_size given by hand), ``params`` laid out by the
    config, else the config alone. A 16-bit checkpoint that vLLM quantises at
    load time (fp8, bitsandbytes) is scaled by the format's estimate over the
    16-bit one.

    Returns:
        (bytes, kind, source text): kind is checkpoint, given, params or estimated.
    Raises:
        PlanError: a malformed checkpoint, weight_bytes or params.
    """
    quant = quant_from_config(spec, fmt)
    est = estimate_weights(spec, quant)
    if quant is not None:
        split = (f"{est.quantised_params / 1e9:.2f} B params {est.method} + "
                 f"{(est.params - est.quantised_params) / 1e9:.2f} B 16-bit")
    else:
        split = f"{est.params / 1e9:.2f} B params x 2 bytes"
    online = spec.quant_method is None and fmt in ONLINE_FORMATS
    if model.get("checkpoint") is not None or model.get("weight_bytes") is not None:
        if model.get("checkpoint") is not None:
            total, source, kind = (*checkpoint_total(model["checkpoint"]), "checkpoint")
        else:
            total = _pos_int(model["weight_bytes"], "vllm_model.weight_bytes",
                             "give the safetensors index metadata.total_size in bytes, > 0")
            source, kind = "given: vllm_model.weight_bytes", "given"
        if online:
            ratio = est.total_bytes / estimate_weights(spec, None).total_bytes
            return (int(total * ratio), kind,
                    f"{source} x {ratio:.3f} (vLLM quantises the 16-bit checkpoint to {fmt} when it loads it)")
        return total, kind, source
    if model.get("params") is not None:
        params = _pos_int(model["params"], "vllm_model.params",
                          "give the parameter count as a whole number, e.g. 8030261248")
        return (estimate_from_params(spec, quant, params), "params",
                f"params {params / 1e9:.2f} B in config.json's layout ({split})")
    return est.total_bytes, "estimated", f"estimated from config.json: {split}"


def _max_batched_tokens(tpot_seconds: float, seqs: int) -> int:
    """--max-num-batched-tokens: 8192, halved for tight TPOT targets.

    8192 is vLLM 0.32's OpenAI-server default on >= 70 GiB GPUs
    (engine/arg_utils.py). The planner always passes the flag, and picks it
    from the latency target only, not from the GPU's size: a memory-dependent
    choice made a larger GPU plan fewer sliding-window sequences (more tokens
    in flight per request), which the property tests caught. A prefill chunk
    shares each step with every decoding sequence, so a smaller chunk keeps
    time-per-output-token low at the cost of time-to-first-token (vLLM docs,
    "Optimization and tuning: chunked prefill"): targets below 50 ms halve it,
    below 25 ms quarter it; never below max-num-seqs.

    Args:
        tpot_seconds: the workload's time-per-output-token target, s.
        seqs: the concurrent sequences asked for.
    Returns:
        tokens per engine step.
    """
    base = DEFAULT_BATCHED_TOKENS
    if tpot_seconds < 0.025:
        base //= 4
    elif tpot_seconds < 0.05:
        base //= 2
    return max(base, seqs, 256)


def _engine_int(engine: Mapping[str, Any], key: str, fix: str) -> int | None:
    """``vllm_engine[key]`` as an int >= 1, or None when not given."""
    value = engine.get(key)
    return None if value is None else _pos_int(value, f"vllm_engine.{key}", fix)


def _reserved_mib(value: Any, total_mib: int, index: int) -> int | None:
    """A GPU row's ``memory_reserved_mib`` (nvidia-smi ``memory.reserved``, MiB), or None when absent.

    Absent or null (a plan recorded before the nvidia_driver role read the field,
    a driver that prints ``[N/A]``): the caller falls back to the GPU table.

    Raises:
        PlanError: not a whole number, negative, or not below ``memory_total_mib``.
    """
    if value is None:
        return None
    field = f"nvidia_driver_gpus[{index}].memory_reserved_mib"
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlanError(field, value, "give memory.reserved in MiB as nvidia-smi reports it (nounits), a whole "
                        "number >= 0, or leave it out to use the GPU table's total")
    if value >= total_mib:
        raise PlanError(field, value, f"must be below memory_total_mib ({total_mib}); give both from the same "
                        "`nvidia-smi --query-gpu=memory.total,memory.reserved` line")
    return value


def _gpus(gpus: Sequence[Mapping[str, Any]], tp: int) -> tuple[int, str, tuple[int, int], list[str], bool]:
    """The smallest usable memory (bytes, source) and compute capability of the GPUs one model copy uses.

    Returns:
        (total bytes vLLM sees per GPU, its source, compute capability, nvidia-smi names, any GeForce).
    Raises:
        PlanError: no GPU rows, fewer than ``tp``, a row without memory/compute capability, or a bad
            ``memory_reserved_mib``.
    """
    if not isinstance(gpus, Sequence) or isinstance(gpus, (str, bytes)) or not gpus:
        raise PlanError("nvidia_driver_gpus", gpus,
                        "need at least one GPU row from nvidia-smi; is the NVIDIA driver loaded?")
    if len(gpus) < tp:
        raise PlanError("vllm_engine.tensor_parallel_size", tp,
                        f"only {len(gpus)} GPU(s) reported; lower tensor_parallel_size or add GPUs")
    totals: list[tuple[int, str]] = []
    caps, names = [], []
    for i, g in enumerate(list(gpus)[:tp]):
        mib = _pos_int(_req(g, "memory_total_mib", f"nvidia_driver_gpus[{i}]"),
                       f"nvidia_driver_gpus[{i}].memory_total_mib",
                       "give memory.total in MiB as nvidia-smi reports it (nounits), > 0")
        caps.append(parse_compute_cap(_req(g, "compute_cap", f"nvidia_driver_gpus[{i}]"),
                                      f"nvidia_driver_gpus[{i}].compute_cap"))
        reserved = _reserved_mib(g.get("memory_reserved_mib"), mib, i)
        name = str(g.get("name") or f"GPU ({mib:,} MiB)")
        names.append(name)
        total, source, _ = vllm_total(name, mib, reserved)
        totals.append((total, source))
    total, source = min(totals)
    return total, source, min(caps), names, any(is_geforce(n) for n in names)


def plan(model: Mapping[str, Any], workload: Mapping[str, Any],
         gpus: Sequence[Mapping[str, Any]], engine: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Plan a vLLM deployment and say whether the workload fits.

    Args:
        model: ``{name, served_model_name, config, weight_format?, checkpoint?,
            weight_bytes?, params?}``; weight_format defaults to the
            checkpoint's own (its quantization_config, else its dtype);
            ``checkpoint`` is read by :func:`teamserve_capacity.weights.checkpoint_total`.
        workload: ``{concurrent_sequences | users [+ active_fraction],
            avg_context_tokens, max_context_tokens, ttft_p95_seconds, tpot_seconds}``.
        gpus: nvidia-smi rows ``{index, name, memory_total_mib, memory_reserved_mib?, compute_cap,
            driver_version}``; with ``memory_reserved_mib`` the memory vLLM sees is
            ``memory_total_mib - memory_reserved_mib`` on any card, without it a name in
            :data:`teamserve_capacity.gpus.GPU_TABLE` gets the table's figure.
        engine: ``{gpu_memory_utilization, kv_cache_dtype, tensor_parallel_size,
            block_size, vllm_version, max_num_seqs?, max_num_batched_tokens?,
            users_trust_each_other?, measured?}``; ``measured`` holds per-GPU
            bytes from a start-up log (:func:`teamserve_capacity.logs.measured_from_log`),
            e.g. ``weights_bytes`` from "Model loading took X GiB".
    Returns:
        ``{fits, verdict, levers, advice, table, numbers, flags, layers, admission,
        vllm_version, registry}`` (docs/contracts.md; ``vllm_version`` is the release the plan was made
        for, ``registry`` what its model registry says of the model: :func:`teamserve_capacity.registry.check_model`);
        every byte count is per GPU. ``advice`` is a list
        of ``{id, advice, reason}`` (:mod:`teamserve_capacity.advice`);
        ``admission`` is ``{user_max_inflight, user_fair_share, user_tokens_per_day}``: the default
        per-user in-flight cap (:func:`user_inflight_share`) and the share past which a user's requests
        lose priority (:func:`user_fair_share`), in engine sequences, and the default daily token budget
        per user (:func:`user_tokens_per_day`), in tokens.
    Raises:
        PlanError: any bad or unsupported input, before any number is produced.
    """
    engine = dict(engine or {})
    w = parse_workload(workload)
    name = str(_req(model, "name", "vllm_model"))
    spec = parse_config(_req(model, "config", "vllm_model"))
    fmt = _weight_format(model, spec)

    version = str(engine.get("vllm_version", PINNED_VLLM))
    if version.split(".")[:2] not in [v.split(".")[:2] for v in SUPPORTED_VLLM]:
        raise PlanError("vllm_engine.vllm_version", version,
                        f"the planner reproduces the memory accounting of vLLM {', '.join(SUPPORTED_VLLM)}; "
                        "pin one of those, or compare the new release's accounting with theirs first "
                        "(docs/vllm-versions.md)")
    util = engine.get("gpu_memory_utilization", 0.9)
    if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
        raise PlanError("vllm_engine.gpu_memory_utilization", util,
                        "use a fraction 0 < x <= 1, e.g. 0.90")
    tp = _pos_int(engine.get("tensor_parallel_size", 1), "vllm_engine.tensor_parallel_size",
                  "use the number of GPUs one model copy is split across, >= 1")
    block = engine.get("block_size", 16)
    if block not in BLOCK_SIZES:
        raise PlanError("vllm_engine.block_size", block, "use one of " + ", ".join(map(str, BLOCK_SIZES)))
    kv_dtype = engine.get("kv_cache_dtype", "auto")
    if kv_dtype not in KV_CACHE_DTYPES:
        raise PlanError("vllm_engine.kv_cache_dtype", kv_dtype,
                        "use one of " + ", ".join(KV_CACHE_DTYPES) + " (other vLLM cache dtypes are not modelled)")
    seqs_given = _engine_int(engine, "max_num_seqs", "give --max-num-seqs as a whole number >= 1, or leave "
                             "it to the plan (from vllm_workload.concurrent_sequences)")
    batched_given = _engine_int(engine, "max_num_batched_tokens", "give --max-num-batched-tokens as a whole "
                                "number >= 1, or leave it to the plan")
    trust = engine.get("users_trust_each_other", True)
    if not isinstance(trust, bool):
        raise PlanError("vllm_engine.users_trust_each_other", trust,
                        "use true or false (vllm_users_trust_each_other)")

    total_bytes, total_source, cap, gpu_names, geforce = _gpus(gpus, tp)
    min_cap, native_cap, online_flag = WEIGHT_FORMATS[fmt]
    cap_text = f"{cap[0]}.{cap[1]}"
    if cap < min_cap:
        raise PlanError("vllm_model.weight_format", fmt,
                        f"{fmt} weights need compute capability >= {min_cap[0]}.{min_cap[1]} "
                        f"in vLLM {version}; this GPU is {cap_text}; choose another format")
    kv_support = fp8_kv_support(cap)
    if KV_CACHE_DTYPES[kv_dtype] == 1 and kv_support == "unsupported":
        raise PlanError("vllm_engine.kv_cache_dtype", kv_dtype,
                        f"fp8 KV cache needs compute capability >= 8.0 with vLLM {version}; "
                        f"this GPU is {cap_text}; use auto")
    if spec.quant_method:
        # vLLM reads quantization_config itself and picks the fastest kernel
        # (e.g. awq_marlin); forcing --quantization awq would select the slow one.
        quantization = None
    elif online_flag is not None:
        quantization = online_flag
    elif fmt in ("bf16", "fp16"):
        quantization = None
    else:
        raise PlanError("vllm_model.weight_format", fmt,
                        f"{fmt} needs a pre-quantised checkpoint whose config.json has a "
                        "quantization_config; this config has none — pick the quantised repo, "
                        "or use bf16, fp8 or bitsandbytes (vLLM quantises those at load time)")
    # Whether the release can load this architecture at this quantisation, from its own registry.
    architectures = spec.raw.get("architectures") or [spec.architecture]
    registry_check = check_model(architectures if isinstance(architectures, list) else [architectures],
                                 spec.quant_method, quantization, version, load_registry(version))

    # vLLM's dtype "auto" serves float32 checkpoints in 16-bit ("Downcasting
    # torch.float32 to torch.bfloat16"), so KV and activations are 2 bytes.
    model_bytes = min(2, DTYPE_BYTES[spec.dtype])
    kv_bytes = KV_CACHE_DTYPES[kv_dtype] or model_bytes
    prefix_caching = True
    layout = kv_layout(spec, tensor_parallel_size=tp, kv_dtype_bytes=kv_bytes, block_size=block,
                       state_dtype_bytes=model_bytes, prefix_caching=prefix_caching)

    max_model_len = min(w.max_context_tokens, spec.max_model_len_limit)
    seqs_wanted = w.concurrent_sequences
    seqs_cap_guess = seqs_given or min(MAX_NUM_SEQS, max(SEQS_ROUNDING,
                                                         cdiv(seqs_wanted, SEQS_ROUNDING) * SEQS_ROUNDING))
    batched = batched_given or _max_batched_tokens(w.tpot_seconds, seqs_wanted)
    if batched_given is not None and batched_given < seqs_cap_guess:
        raise PlanError("vllm_engine.max_num_batched_tokens", batched_given,
                        f"vLLM needs at least --max-num-seqs ({seqs_cap_guess}) tokens per step; raise it "
                        "or lower max_num_seqs")
    in_flight = 2 * batched  # async scheduling: two batches in flight
    weights_total, weights_kind, weights_source = _weights_total(model, spec, fmt)
    if fmt == "mxfp4" and weights_kind in ("estimated", "params"):
        # A checkpoint's or a given size is the file's; the estimate adds what vLLM's kernel pads per rank.
        pad = mxfp4_padding_bytes_per_rank(spec, tp, cap)
        if pad:
            weights_total += pad * tp
            weights_source += (f"; + {pad / GIB:.2f} GiB per GPU that vLLM's {mxfp4_moe_backend(cap)} "
                               "MXFP4 kernel pads each rank's experts to")
    measured = Measured(**{k: v for k, v in dict(engine.get("measured") or {}).items()
                           if k in Measured.__dataclass_fields__})
    if measured.weights_bytes is not None:
        weights_source = "measured: the engine's start-up log (per GPU)"
    budget = estimate_budget(spec, total_bytes=total_bytes, total_source=total_source,
                             gpu_memory_utilization=float(util),
                             weights_bytes_total=weights_total, weights_source=weights_kind,
                             tensor_parallel_size=tp, max_num_batched_tokens=batched,
                             max_num_seqs=seqs_cap_guess, measured=measured)

    num_blocks = max(0, budget.kv_budget_bytes // layout.bytes_per_block)
    per_req_avg = layout.blocks_per_request(w.avg_context_tokens, in_flight)
    per_req_max = layout.blocks_per_request(max_model_len, in_flight)
    conc_avg = num_blocks // per_req_avg
    conc_max = num_blocks // per_req_max
    kv_tokens = layout.logged_kv_tokens(num_blocks, max_model_len, in_flight) if num_blocks else 0
    seqs_short = seqs_given is not None and seqs_given < seqs_wanted  # a fixed --max-num-seqs too low
    fits = conc_avg >= seqs_wanted and conc_max >= 1 and not seqs_short

    if seqs_given is not None:
        max_num_seqs = seqs_given
    else:
        max_num_seqs = max(1, min(seqs_cap_guess, conc_avg)) if conc_avg else seqs_cap_guess
    flags: dict[str, Any] = {
        "max-model-len": max_model_len,
        "max-num-seqs": max_num_seqs,
        "gpu-memory-utilization": float(util),
        "kv-cache-dtype": kv_dtype,
        "max-num-batched-tokens": max(batched, max_num_seqs),
        "enable-prefix-caching": True,
        "enable-chunked-prefill": True,
        "tensor-parallel-size": tp,
        "quantization": quantization,
        "max-num-queued-reqs": QUEUE_PER_SEQ * max_num_seqs,
        # The gateway sets each request's priority from its user's in-flight sequences
        # (user_fair_share); vLLM refuses a priority other than 0 under the default fcfs.
        "scheduling-policy": "priority",
    }
    if block != 16:
        flags["block-size"] = block

    gpu_model = find_gpu(gpu_names[0])
    numbers: dict[str, Any] = {
        "model": name,
        "served_model_name": str(model.get("served_model_name", name)),
        "architecture": spec.architecture,
        "weight_format": fmt,
        "checkpoint_quantization": spec.quant_method,
        "attention": spec.attention_type,
        "gpu": gpu_names[0],
        "gpu_count": tp,
        "gpu_class": gpu_model.gpu_class if gpu_model else ("geforce" if geforce else "unknown"),
        "compute_cap": cap_text,
        "fp8_kv_cache": kv_support,
        "gpu_total_gib": round(budget.total_bytes / GIB, 2),
        "requested_gib": round(budget.requested_bytes / GIB, 2),
        "weights_gib": round(budget.weights_bytes / GIB, 2),
        "weights_source": weights_source,
        "non_torch_gib": round(budget.non_torch_bytes / GIB, 2),
        "activation_peak_gib": round(budget.activation_bytes / GIB, 2),
        "cudagraph_gib": round(budget.cudagraph_bytes / GIB, 2),
        "kv_budget_gib": round(budget.kv_budget_bytes / GIB, 2),
        "kv_budget_bytes": budget.kv_budget_bytes,
        "sources": budget.sources,
        "kv_bytes_per_token": layout.kv_bytes_per_token,
        "kv_dtype_bytes": kv_bytes,
        "block_size": layout.block_size,
        "bytes_per_block": layout.bytes_per_block,
        "blocks": num_blocks,
        "kv_tokens": kv_tokens,
        "kv_block_tokens": num_blocks * layout.block_size,
        "blocks_per_seq_avg": per_req_avg,
        "blocks_per_seq_max": per_req_max,
        "kv_per_seq_avg_mib": round(per_req_avg * layout.bytes_per_block / MIB, 1),
        "max_concurrency_avg": conc_avg,
        "max_concurrency_max": conc_max,
        "concurrent_sequences": seqs_wanted,
        "users": w.users,
        "active_fraction": w.active_fraction,
        "concurrency_assumption": w.assumption,
        "avg_context_tokens": w.avg_context_tokens,
        "max_model_len": max_model_len,
        "model_max_len": spec.max_model_len_limit,
    }
    layers = [
        {"kind": k.kind, "layers": k.layers, "kv_groups": k.groups,
         "bytes_per_token": k.bytes_per_token, "state_bytes_per_seq": k.state_bytes}
        for k in layout.kinds
    ]
    levers = [] if fits else _levers(spec, w, layout, budget, fmt, kv_bytes, kv_support, tp,
                                     num_blocks, in_flight, max_model_len, seqs_short)
    verdict = _verdict(fits, w, conc_avg, conc_max, max_model_len, budget, seqs_given if seqs_short else None)
    advice = advise(concurrent_sequences=seqs_wanted, gpu_names=gpu_names, geforce=geforce,
                    users_trust_each_other=trust, full_length_fit=conc_max, max_model_len=max_model_len,
                    fits=fits)
    from .report import format_table
    admission = {"user_max_inflight": user_inflight_share(flags["max-num-seqs"]),
                 "user_fair_share": user_fair_share(flags["max-num-seqs"]),
                 "user_tokens_per_day": user_tokens_per_day(flags["max-num-seqs"], w.tpot_seconds)}
    result = {"fits": fits, "verdict": verdict, "levers": levers, "advice": advice, "numbers": numbers,
              "vllm_version": version, "registry": registry_check,
              "flags": flags, "layers": layers, "admission": admission}
    result["table"] = format_table(result)
    return result


def _verdict(fits: bool, w: Workload, conc_avg: int, conc_max: int, max_len: int, budget: Budget,
             short_max_num_seqs: int | None) -> str:
    """One sentence: fits or not, with the sequences that fit at the average and maximum context.

    ``short_max_num_seqs``: a given --max-num-seqs below the concurrency asked for, else None.
    """
    if budget.kv_budget_bytes <= 0:
        taken = (budget.requested_bytes - budget.kv_budget_bytes) / GIB
        return (f"does not fit: the weights and overheads take {taken:.1f} "
                f"GiB of the {budget.requested_bytes / GIB:.1f} GiB vLLM may use; nothing is left for the KV cache")
    if fits:
        return (f"fits: {conc_avg} sequences at {w.avg_context_tokens:,} tokens "
                f"(need {w.concurrent_sequences}), {conc_max} at the {max_len:,}-token maximum")
    if conc_max < 1:
        return f"does not fit: not even one {max_len:,}-token request fits in the KV cache"
    if short_max_num_seqs is not None:
        return (f"does not fit: --max-num-seqs {short_max_num_seqs} runs fewer than the "
                f"{w.concurrent_sequences} concurrent sequences asked for")
    return (f"does not fit: {conc_avg} sequences at {w.avg_context_tokens:,} tokens, "
            f"{w.concurrent_sequences} requested")


def _levers(spec: ModelSpec, w: Workload, layout: KVLayout, budget: Budget, fmt: str, kv_bytes: int,
            kv_support: str, tp: int, num_blocks: int, in_flight: int, max_len: int,
            seqs_short: bool) -> list[str]:
    """What would make a plan that does not fit fit, one sentence each with its number.

    Args:
        spec, w, layout, budget: the model, the workload, its KV layout and the memory budget.
        fmt: the weight format; kv_bytes: bytes per KV element; kv_support: fp8 KV support of the GPU.
        tp: tensor-parallel size; num_blocks: KV blocks in the pool; in_flight: tokens in flight.
        max_len: --max-model-len, tokens; seqs_short: a given --max-num-seqs is below the concurrency.
    Returns:
        levers, most effective first: a max-num-seqs that runs the workload, a shorter average
        context (tokens), fewer sequences, a lower --max-model-len, fp8 KV (bytes per token), 4-bit
        weights (GiB freed: the AWQ layout of teamserve_capacity.weights, 16-bit embeddings and
        lm_head kept), a second GPU.
    """
    out: list[str] = []
    if seqs_short:
        out.append(f"raise vllm_engine.max_num_seqs to {w.concurrent_sequences} (or leave it to the plan)")
    if num_blocks:
        # Longest average context that serves the requested sequences.
        lo, hi = 1, w.avg_context_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if num_blocks // layout.blocks_per_request(mid, in_flight) >= w.concurrent_sequences:
                lo = mid
            else:
                hi = mid - 1
        if num_blocks // layout.blocks_per_request(lo, in_flight) >= w.concurrent_sequences:
            out.append(f"shorter context: an average of {lo:,} tokens serves "
                       f"{w.concurrent_sequences} sequences")
        fewer = num_blocks // layout.blocks_per_request(w.avg_context_tokens, in_flight)
        if fewer >= 1:
            out.append(f"fewer concurrent sequences: {fewer} fit at {w.avg_context_tokens:,} tokens")
        if num_blocks // layout.blocks_per_request(max_len, in_flight) < 1:
            longest = 0
            lo, hi = 1, max_len
            while lo <= hi:
                mid = (lo + hi) // 2
                if num_blocks >= layout.blocks_per_request(mid, in_flight):
                    longest, lo = mid, mid + 1
                else:
                    hi = mid - 1
            out.append(f"lower --max-model-len: at most {longest:,} tokens fit for one request")
    if kv_bytes > 1 and kv_support != "unsupported":
        note = "" if kv_support == "native" else " (emulated on this GPU: slower)"
        out.append(f"fp8 KV cache (--kv-cache-dtype fp8) halves KV bytes per token to "
                   f"{layout.kv_bytes_per_token // kv_bytes:,}{note}")
    if fmt in ("bf16", "fp16", "fp8"):
        current = estimate_weights(spec, quant_from_config(spec, fmt)).total_bytes
        four_bit = estimate_weights(spec, Quant("awq")).total_bytes
        freed = budget.weights_bytes * (1 - four_bit / current)
        out.append(f"4-bit weights (AWQ/GPTQ/NVFP4/MXFP4 checkpoint) free about {freed / GIB:.1f} GiB per GPU")
    out.append(f"a second GPU (--tensor-parallel-size {tp * 2}) halves the weights per GPU "
               f"and, for GQA models, the KV bytes per token")
    return out

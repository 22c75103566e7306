"""The deployment checklist's verdicts: one function per check, from the inputs the role gathered.

Each ``check_*`` function takes what Ansible measured on the box (bench results, ``/metrics`` text, the
engine log, HTTP answers, module results) and returns one record::

    {"id": int, "name": str, "status": "PASS" | "FAIL" | "SKIP", "summary": str,
     "measured": {...}, "target": {...}, "reason": str (SKIP only)}

Times are seconds, sizes tokens, unless a key says otherwise. The tasks only gather and report; every
threshold and verdict is here, so ``tests/unit/test_verify.py`` tests them with real captured inputs.

The ``/metrics`` and start-up log parsers are the project's shared ones in ``module_utils/`` (configured
in ansible.cfg ``module_utils``), which the modules on the box import too. ``teamserve_metric`` (one value
from a ``/metrics`` text) is here as well, for the upgrade's drain:

    {{ metrics.content | teamserve_metric('vllm:num_requests_running') }}
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from ansible import constants as C
from ansible.errors import AnsibleFilterError

Record = dict[str, Any]

NAMES = {
    1: "capacity arithmetic",
    2: "engine, model and flags at the pin",
    3: "TTFT and TPOT targets",
    4: "load test at 1x and 2x",
    5: "long prompt while others stream",
    6: "per-user rate limits",
    7: "cold start",
    8: "own evaluation set",
    9: "unreachable from outside the LAN",
}
QUEUE_HISTOGRAM = "vllm:request_queue_time_seconds"
# Interfaces whose addresses are not the host's own network presence (loopback, container bridges and
# their veth ends): an outside probe of them would leave the LAN for an unrelated network.
_INTERNAL_IFACES = re.compile(r"^(lo|docker\d*|br-.*|veth.*|virbr.*|cni.*|flannel.*|cali.*|tun.*|tap.*)$")


def shared(name: str) -> ModuleType:
    """Import ``<module_utils path>/<name>.py`` on the controller (modules get it through AnsiballZ).

    Looks in the directories of Ansible's ``module_utils`` setting (ansible.cfg). Raises
    AnsibleFilterError naming the setting when the file is not found.
    """
    key = f"ansible.module_utils.{name}"
    if key in sys.modules:
        return sys.modules[key]
    for directory in C.DEFAULT_MODULE_UTILS_PATH or []:
        spec = importlib.util.spec_from_file_location(key, f"{directory}/{name}.py")
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except FileNotFoundError:
            continue
        sys.modules[key] = module
        return module
    raise AnsibleFilterError(f"{name}.py is not in the module_utils paths {C.DEFAULT_MODULE_UTILS_PATH}; "
                             "run with the project's ansible.cfg (module_utils = module_utils)")


def teamserve_metric(text: Any, name: str) -> float | None:
    """Sum of every sample named ``name`` (all label sets) in a ``/metrics`` text, in the metric's own unit;
    None when absent. Raises AnsibleFilterError when ``text`` is not a string (the scrape returned nothing)."""
    if not isinstance(text, str):
        raise AnsibleFilterError(f"teamserve_metric: expected the /metrics text, got {type(text).__name__}")
    value: float | None = shared("teamserve_prometheus").value(text, name)
    return value


def teamserve_completion_body(prompt: Any, endpoint: str, model: str, params: Any = None) -> dict[str, Any]:
    """The JSON body of one request to ``endpoint``: ``prompt`` as a completion's ``prompt`` for
    /v1/completions (a model declared completions-only), else as the user message of a chat completion;
    ``params`` (temperature, max_tokens, tools, ...) are added as given (:func:`eval_parse` refuses tools
    for /v1/completions, which has no tool calling).

        {{ item.prompt | teamserve_completion_body(vllm_api_endpoint, vllm_model.served_model_name, {'max_tokens': 32}) }}
    """
    body: dict[str, Any] = {"model": str(model), **dict(params or {})}
    if endpoint == "/v1/completions":
        body["prompt"] = str(prompt)
    else:
        body["messages"] = [{"role": "user", "content": str(prompt)}]
    return body


def record(check_id: int, status: str, summary: str, **details: Any) -> Record:
    """A check's record: id, its name, PASS/FAIL/SKIP, a one-line summary, then ``details``."""
    return {"id": check_id, "name": NAMES[check_id], "status": status, "summary": " ".join(summary.split()),
            **details}


def skipped(check_id: int, summary: str, reason: str) -> Record:
    """A SKIP record; ``reason`` names the setting that skipped it."""
    return record(check_id, "SKIP", summary, reason=reason)


def failed(checks: Any, result: Any = None, task: Any = None, measured: Any = None) -> list[Record]:
    """FAIL records for checks whose gathering stopped with an error (a task failed).

    ``checks``: one id or a list of ids; ``result``: the failed task's result (``ansible_failed_result``);
    ``task``: the failed task (``ansible_failed_task``). The summary is the task's name and the last
    non-empty line of its message (a program's traceback ends with the error); a failed
    ``vllm bench serve`` container reports its exit status.
    """
    result = result if isinstance(result, Mapping) else {}
    name = str((task or {}).get("name") or "") if isinstance(task, Mapping) else ""
    lines = [line for line in str(result.get("msg") or "").splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "failed"
    if "vllm bench serve" in name and isinstance(result.get("status"), int):
        summary = f"vllm bench serve exited with status {result['status']}: {last}"
    else:
        summary = f"{name}: {last}" if name else last
    ids = checks if isinstance(checks, Sequence) and not isinstance(checks, str) else [checks]
    extra = {"measured": measured} if measured else {}
    return [record(int(i), "FAIL", summary[:300], **extra) for i in ids]


def _flag(argv: Sequence[Any], name: str) -> str | None:
    """The value of ``--name`` in an argv (``--name value`` or ``--name=value``); None when absent."""
    items = [str(a) for a in argv]
    for index, item in enumerate(items):
        if item == f"--{name}" and index + 1 < len(items):
            return items[index + 1]
        if item.startswith(f"--{name}="):
            return item.split("=", 1)[1]
    return None


def _unpinned(image: str) -> str:
    """``repo:tag@digest`` -> ``repo@digest``, the reference the vllm role runs the engine from."""
    name, _, digest = str(image).partition("@")
    repo = name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name
    return f"{repo}@{digest}" if digest else repo


def engine(container: Any) -> dict[str, Any]:
    """What the checks need from the running engine container (``docker_container_info``'s ``container``).

    Returns ``running`` (bool), ``started_at`` (Docker's RFC 3339 time), ``started_epoch`` (seconds), ``argv``,
    ``image``,    ``metrics_url`` (the published API port on the box, ``http://host:port/metrics``), ``hf_cache`` (host
    directory mounted as the HF cache, or None) and ``kv_cache_dtype`` (``--kv-cache-dtype``, vLLM's
    default ``auto``). Raises AnsibleFilterError when the container does not exist or publishes no port.
    """
    if not isinstance(container, Mapping) or not container:
        raise AnsibleFilterError("the engine container does not exist; converge site.yml first")
    argv = list((container.get("Config") or {}).get("Cmd") or [])
    port = _flag(argv, "port") or "8000"
    bindings = ((container.get("HostConfig") or {}).get("PortBindings") or {}).get(f"{port}/tcp") or []
    if not bindings:
        raise AnsibleFilterError(f"the engine container publishes no host port for its API port {port}")
    host = bindings[0].get("HostIp") or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    started = (container.get("State") or {}).get("StartedAt") or ""
    mounts = container.get("Mounts") or []
    hf_cache = next((m.get("Source") for m in mounts if m.get("Destination") == "/root/.cache/huggingface"), None)
    return {
        "running": bool((container.get("State") or {}).get("Running")),
        "started_at": started,
        "started_epoch": shared("teamserve_vllm_log").parse_docker_time(started) if started else None,
        "argv": argv,
        "image": (container.get("Config") or {}).get("Image"),
        "metrics_url": f"http://{host}:{bindings[0].get('HostPort')}/metrics",
        "hf_cache": hf_cache,
        "kv_cache_dtype": _flag(argv, "kv-cache-dtype") or "auto",
    }


# --- check 1 ---------------------------------------------------------------------------------------------

def check_capacity(plan: Any, engine_log: str | None, tolerance: float = 0.10) -> Record:
    """Check 1: the plan fits, and the KV cache the engine allocated matches the plan.

    ``plan``: the vllm role's ``vllm_plan`` (the capacity planner's dict: fits, verdict, levers, numbers).
    ``engine_log``: the engine's log since its start (its "GPU/CPU KV cache size: N tokens" line).
    ``tolerance``: largest relative difference between the logged and the planned KV tokens. The default
    0.10 comes from benchmarks/capacity/README.md: the planner's KV memory, derived from the GPU's total
    memory, utilisation and weights, is off by 0.69 % median and 8.2 % at most over 10 public logs, and KV
    tokens scale with it (from the logged KV memory the tokens are within 0.1 %).
    A CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE, not GPU memory, so the GPU plan's count does
    not apply: the logged cache must then hold the workload (concurrent sequences x average context).
    A log without the line (rotated away since the start) leaves the verdict to the plan.
    """
    if not isinstance(plan, Mapping) or "numbers" not in plan:
        return record(1, "FAIL", "no capacity plan (the vllm role could not compute one)")
    n = plan["numbers"]
    ok = bool(plan.get("fits"))
    planned = int(n.get("kv_tokens") or 0)
    need = int(n["concurrent_sequences"]) * int(n["avg_context_tokens"])
    kv = shared("teamserve_vllm_log").kv_cache_size(engine_log or "")
    error = None
    if kv is None:
        kv_text = "the engine log has no KV cache size line since its start (rotated away?): not compared"
    elif kv["device"] == "GPU":
        error = round((planned - kv["tokens"]) / kv["tokens"], 4) if kv["tokens"] else math.inf
        ok = ok and abs(error) <= tolerance
        kv_text = (f"engine's GPU KV cache {kv['tokens']:,} tokens, plan {planned:,} "
                   f"({100 * error:+.1f} %, tolerance {100 * tolerance:.0f} %)")
    else:
        ok = ok and kv["tokens"] >= need
        kv_text = (f"engine's {kv['device']} KV cache {kv['tokens']:,} tokens (sized by the {kv['device']} build, "
                   f"not the GPU plan) {'holds' if kv['tokens'] >= need else 'does NOT hold'} "
                   f"{n['concurrent_sequences']} x {n['avg_context_tokens']:,} = {need:,} tokens")
    return record(
        1, "PASS" if ok else "FAIL", f"{plan.get('verdict')}; {kv_text}",
        measured={
            "gpus": f"{n.get('gpu_count')} x {n.get('gpu')}",
            "kv_budget_gib": n.get("kv_budget_gib"),
            "kv_bytes_per_token": n.get("kv_bytes_per_token"),
            "max_concurrency_at_avg_context": n.get("max_concurrency_avg"),
            "max_concurrency_at_max_context": n.get("max_concurrency_max"),
            "plan_kv_tokens": planned,
            "engine_kv_cache": kv,
            "kv_tokens_error": error,
        },
        target={
            "concurrent_sequences": n.get("concurrent_sequences"),
            "avg_context_tokens": n.get("avg_context_tokens"),
            "max_context_tokens": n.get("max_model_len"),
            "kv_tokens_tolerance": tolerance,
        },
        levers=[] if plan.get("fits") else list(plan.get("levers") or []),
    )


# --- check 2 ---------------------------------------------------------------------------------------------

def check_engine(running: Any, argv: Any, image: str, served_model_name: str, vllm_version: Any,
                 models: Any) -> Record:
    """Check 2: the engine runs the planned argv from the pinned image and the gateway lists the model.

    ``running``: :func:`engine` of the running container. ``argv``: the planned ``vllm_argv`` (every flag
    already checked against the pinned vLLM's option snapshot when it was rendered). ``image``: the pin
    ``repo:tag@digest``. ``models``: the ``uri`` result of ``GET /v1/models`` through the gateway.
    """
    if argv is None:
        return record(2, "FAIL", "no planned argv to compare with (the vllm role could not compute the plan)")
    planned = [str(a) for a in argv]
    pinned = _unpinned(image)
    models = models if isinstance(models, Mapping) else {}
    body = models.get("json") if isinstance(models.get("json"), Mapping) else {}
    served = [m.get("id") for m in body.get("data") or [] if isinstance(m, Mapping)]
    is_running = bool(running.get("running"))
    argv_ok = running.get("argv") == planned
    image_ok = running.get("image") == pinned
    listed = served_model_name in served
    flags = sum(1 for a in planned if a.startswith("--"))
    return record(
        2, "PASS" if is_running and argv_ok and image_ok and listed else "FAIL",
        f"vLLM {vllm_version}: container {'running' if is_running else 'NOT running'}, "
        f"argv {'equals the plan' if argv_ok else 'DIFFERS from the plan'} ({flags} flags in the {vllm_version} "
        f"option snapshot), image {'pinned digest' if image_ok else 'NOT the pinned digest'}, /v1/models via "
        f"gateway (HTTP {models.get('status', 'none')}) {'lists' if listed else 'does NOT list'} '{served_model_name}'",
        measured={"running": is_running, "argv": running.get("argv"), "image": running.get("image"),
                  "gateway_models": served},
        target={"vllm_version": vllm_version, "argv": planned, "image": pinned,
                "served_model_name": served_model_name},
    )


# --- checks 3 and 4 ----------------------------------------------------------------------------------------

def bench_inputs(plan: Any, workload: Any, model: Any, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    """What ``vllm bench serve`` is run with: ``input_tokens``, ``concurrencies`` (1x and 2x), ``tokenizer``.

    ``input_tokens`` 0 means the workload's average context minus ``output_tokens``; either way capped so
    prompt plus output fit ``--max-model-len``. The tokenizer is read offline from the engine's HF cache: a
    repo pinned to a commit from its snapshot directory (huggingface_hub's cache layout
    hub/models--OWNER--NAME/snapshots/REVISION), a local path as it is. Raises AnsibleFilterError when no
    prompt fits.
    """
    max_len = int((plan or {}).get("flags", {}).get("max-model-len") or workload["max_context_tokens"])
    wanted = int(input_tokens) if int(input_tokens) > 0 else int(workload["avg_context_tokens"]) - int(output_tokens)
    tokens = min(wanted, max_len - int(output_tokens) - 1)
    if tokens < 1:
        raise AnsibleFilterError(
            f"teamserve_verify_bench_output_tokens={output_tokens} leaves no room for a prompt within the average "
            f"context ({workload['avg_context_tokens']}) and --max-model-len {max_len}; lower it or set "
            "teamserve_verify_bench_input_tokens")
    name, revision = str(model["name"]), str(model.get("revision") or "")
    tokenizer = name if name.startswith("/") or not revision else (
        f"/root/.cache/huggingface/hub/models--{name.replace('/', '--')}/snapshots/{revision}")
    concurrency = int(workload["concurrent_sequences"])
    return {"input_tokens": tokens, "output_tokens": int(output_tokens), "tokenizer": tokenizer,
            "concurrencies": [concurrency, 2 * concurrency]}


def queue(before: str, after: str, threshold_seconds: float | None = None) -> dict[str, Any]:
    """Requests that finished between two ``/metrics`` scrapes and how long they waited to be scheduled.

    From ``vllm:request_queue_time_seconds`` (vLLM 0.32 ``vllm/v1/metrics/loggers.py``: time in the WAITING
    phase, observed once per finished request). ``threshold_seconds`` is rounded up to a bucket bound
    (default the smallest; vLLM 0.32's start at 0.3 s). Returns ``requests``, ``queued`` (waited longer than
    the threshold), ``threshold_seconds`` (the bound used), ``waited_seconds_total``, ``mean_wait_seconds``.
    Raises AnsibleFilterError when the histogram is missing or its count went down (the engine restarted).
    """
    prom = shared("teamserve_prometheus")
    first, second = prom.histogram(before, QUEUE_HISTOGRAM), prom.histogram(after, QUEUE_HISTOGRAM)
    if not second["buckets"]:
        raise AnsibleFilterError(f"/metrics has no {QUEUE_HISTOGRAM} histogram")
    requests = second["count"] - first["count"]
    if requests < 0:
        raise AnsibleFilterError(f"{QUEUE_HISTOGRAM}_count went down ({first['count']} -> {second['count']}): "
                                 "the engine restarted between the two scrapes")
    finite = sorted(b for b in second["buckets"] if not math.isinf(b))
    if threshold_seconds is None:
        bound = finite[0] if finite else math.inf
    else:
        bound = next((b for b in finite if b >= float(threshold_seconds)), math.inf)
    admitted = second["buckets"].get(bound, 0.0) - first["buckets"].get(bound, 0.0)
    waited = second["sum"] - first["sum"]
    return {
        "requests": int(round(requests)),
        "queued": int(round(requests - admitted)),
        "threshold_seconds": None if math.isinf(bound) else bound,
        "waited_seconds_total": round(waited, 4),
        "mean_wait_seconds": round(waited / requests, 4) if requests else None,
    }


def _ms_to_s(result: Mapping[str, Any], key: str) -> float | None:
    value = result.get(key)
    return round(float(value) / 1000.0, 5) if isinstance(value, (int, float)) else None


def bench(result: Any) -> dict[str, Any]:
    """The numbers of a ``vllm bench serve --save-result`` JSON, in seconds.

    Keys of vLLM 0.32 ``vllm/benchmarks/serve.py``: ``completed``, ``failed``, ``num_prompts``,
    ``max_concurrency``, ``duration`` (s), ``request_throughput`` (req/s), ``output_throughput`` (tokens/s),
    ``median_/p50_/p95_/p99_<ttft|tpot|itl|e2el>_ms`` (converted to seconds) and up to three distinct
    ``errors``. Raises AnsibleFilterError when ``result`` is not such a JSON.
    """
    if not isinstance(result, Mapping) or "completed" not in result:
        raise AnsibleFilterError("not a vllm bench serve result (no 'completed' key)")
    summary: dict[str, Any] = {
        "completed": int(result.get("completed") or 0),
        "failed": int(result.get("failed") or 0),
        "num_prompts": result.get("num_prompts"),
        "max_concurrency": result.get("max_concurrency"),
        "duration_seconds": round(float(result.get("duration") or 0.0), 3),
        "request_throughput": round(float(result.get("request_throughput") or 0.0), 3),
        "output_throughput": round(float(result.get("output_throughput") or 0.0), 2),
        # requests/s that met every --goodput objective (the targets); None when none were given
        "request_goodput": None if result.get("request_goodput") is None
        else round(float(result["request_goodput"]), 3),
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        summary[f"{metric}_seconds"] = {"median": _ms_to_s(result, f"median_{metric}_ms"),
                                        **{p: _ms_to_s(result, f"{p}_{metric}_ms") for p in ("p50", "p95", "p99")}}
    errors: list[str] = []
    for error in result.get("errors") or []:
        text = str(error or "").strip()[:200]
        if text and text not in errors and len(errors) < 3:
            errors.append(text)
    summary["errors"] = errors
    return summary


def bench_run(concurrency: int, result: Any, metrics_before: str, metrics_after: str,
              threshold_seconds: float | None) -> dict[str, Any]:
    """One bench run as the report keeps it: ``concurrency``, ``bench`` (:func:`bench`), ``queue``
    (:func:`queue` between the scrapes around the run) and ``waiting_after`` (requests still waiting)."""
    return {"concurrency": int(concurrency), "bench": bench(result),
            "queue": queue(metrics_before, metrics_after, threshold_seconds),
            "waiting_after": shared("teamserve_prometheus").value(metrics_after, "vllm:num_requests_waiting")}


# Gauges sampled while a bench runs (vLLM 0.32 vllm/v1/metrics/loggers.py): KV cache used (a fraction
# 0..1 despite the name), requests waiting to be scheduled, requests running.
ENGINE_GAUGES = {"kv_cache_usage_peak": "vllm:kv_cache_usage_perc", "waiting_peak": "vllm:num_requests_waiting",
                 "running_peak": "vllm:num_requests_running"}


def engine_during(sampled: Any) -> dict[str, Any]:
    """What the engine's ``/metrics`` said while one bench ran, from ``bench_sampler.py``'s JSON.

    Returns the peaks of :data:`ENGINE_GAUGES` over the samples (None when no sample had them), and from the
    counters' difference between the scrapes before and after: ``prefix_cache_hit_rate`` (prompt tokens
    found in the prefix cache / prompt tokens looked up; None when none were looked up), ``preemptions``
    (sequences evicted to make room: a KV cache too small for the batch), ``samples``, ``scrape_errors`` and
    ``seconds`` (the bench's wall time). Raises AnsibleFilterError when ``sampled`` is not such a JSON.
    """
    if not isinstance(sampled, Mapping) or "samples" not in sampled or "before" not in sampled:
        raise AnsibleFilterError("not bench_sampler.py's output (no 'samples' and 'before')")
    prom = shared("teamserve_prometheus")
    samples = [s for s in sampled["samples"] if isinstance(s, Mapping)]
    out: dict[str, Any] = {}
    for key, name in ENGINE_GAUGES.items():
        values = [v for v in (prom.value(s["lines"], name) for s in samples if "lines" in s) if v is not None]
        out[key] = (round(max(values), 4) if key == "kv_cache_usage_peak" else int(max(values))) if values else None

    def delta(name: str) -> float | None:
        first, last = prom.value(sampled["before"], name), prom.value(sampled.get("after") or "", name)
        return None if first is None or last is None else last - first

    hits, queries = delta("vllm:prefix_cache_hits_total"), delta("vllm:prefix_cache_queries_total")
    preemptions = delta("vllm:num_preemptions_total")
    out.update({"prefix_cache_hit_rate": round(hits / queries, 4) if hits is not None and queries else None,
                "preemptions": None if preemptions is None else int(preemptions),
                "samples": sum(1 for s in samples if "lines" in s),
                "scrape_errors": sum(1 for s in samples if "error" in s),
                "seconds": sampled.get("seconds")})
    return out


def bench_step(concurrency: int, result: Any, sampled: Any, threshold_seconds: float | None) -> dict[str, Any]:
    """One bench run with the engine's view of it: :func:`bench_run` from the sampler's scrapes before and
    after, plus ``engine`` (:func:`engine_during`) and, from a ``--save-detailed`` result, ``input_lens``
    and ``output_lens`` (tokens per request)."""
    if not isinstance(sampled, Mapping) or "before" not in sampled:
        raise AnsibleFilterError("not bench_sampler.py's output (no 'before')")
    if not sampled.get("after"):
        raise AnsibleFilterError("the engine's /metrics did not answer after the bench: did the engine stop?")
    run = bench_run(concurrency, result, sampled["before"], sampled["after"], threshold_seconds)
    run["engine"] = engine_during(sampled)
    for key in ("input_lens", "output_lens"):
        if isinstance(result.get(key), list):
            run[key] = [int(v) for v in result[key]]
    return run


def check_targets(runs: Any, workload: Any) -> Record:
    """Check 3: TTFT p95 and TPOT p95 of the 1x run against ``vllm_workload``'s targets (seconds).

    Judged at p95, TPOT as well as TTFT: the target is what 19 in 20 requests must meet, and a median
    hides the slow streams people complain about. ``runs``: :func:`bench_run` results, 1x first.
    """
    if not runs:
        return record(3, "FAIL", "no bench run")
    run = runs[0]
    b = run["bench"]
    ttft, tpot = b["ttft_seconds"]["p95"], b["tpot_seconds"]["p95"]
    ttft_target, tpot_target = float(workload["ttft_p95_seconds"]), float(workload["tpot_seconds"])
    ok = (b["failed"] == 0 and b["completed"] > 0 and ttft is not None and tpot is not None
          and ttft <= ttft_target and tpot <= tpot_target)
    return record(
        3, "PASS" if ok else "FAIL",
        f"at {run['concurrency']} concurrent: TTFT p95 {ttft} s (target {ttft_target}), TPOT p95 {tpot} s "
        f"(target {tpot_target}), {b['completed']}/{b['num_prompts']} ok",
        measured={"concurrency": run["concurrency"], "ttft_p95_seconds": ttft, "tpot_p95_seconds": tpot,
                  "completed": b["completed"], "failed": b["failed"]},
        target={"ttft_p95_seconds": ttft_target, "tpot_p95_seconds": tpot_target, "failed": 0},
    )


def check_load(runs: Any, inputs: Any, workload: Any) -> Record:
    """Check 4: both runs (1x and 2x the expected concurrency) served every request.

    A batching server under twice the load should queue, not fail; the percentiles and how many requests
    queued in the engine are reported. ``runs``: :func:`bench_run` results; ``inputs``: :func:`bench_inputs`.
    """
    runs = list(runs or [])
    ok = len(runs) == 2 and all(r["bench"]["failed"] == 0 and r["bench"]["completed"] > 0 for r in runs)
    parts = []
    for r in runs:
        b, q = r["bench"], r["queue"]
        parts.append(
            f"{r['concurrency']} concurrent: TTFT p50/p95/p99 {b['ttft_seconds']['p50']}/{b['ttft_seconds']['p95']}/"
            f"{b['ttft_seconds']['p99']} s, TPOT p50/p95 {b['tpot_seconds']['p50']}/{b['tpot_seconds']['p95']} s, "
            f"{b['completed']}/{b['num_prompts']} ok, {q['queued']} of the {q['requests']} requests the engine "
            f"finished meanwhile queued > {q['threshold_seconds']} s")
    return record(
        4, "PASS" if ok else "FAIL", "; ".join(parts or ["no bench run"]) + " (target: every request served)",
        measured={"input_tokens": inputs["input_tokens"], "output_tokens": inputs["output_tokens"], "runs": runs},
        target={"failed": 0, "ttft_p95_seconds": float(workload["ttft_p95_seconds"]),
                "tpot_p95_seconds": float(workload["tpot_seconds"])},
    )


# --- check 5 ---------------------------------------------------------------------------------------------

def long_prompt_inputs(plan: Any, workload: Any, model: Any, streams: int, tokens: int) -> dict[str, Any]:
    """The long-prompt measurement's inputs: ``streams`` (0 = concurrent sequences - 1, at least 1),
    ``tokens`` (0 = ``--max-model-len`` - 8), ``max_len`` and ``vocab_size`` (token ids are drawn below it).

    Raises AnsibleFilterError when the model config has no vocab_size or the prompt does not fit.
    """
    max_len = int((plan or {}).get("flags", {}).get("max-model-len") or workload["max_context_tokens"])
    config = model.get("config") or {}
    vocab = int(config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size") or 0)
    tokens = int(tokens) if int(tokens) > 0 else max_len - 8
    if vocab <= 1:
        raise AnsibleFilterError("vllm_model.config has no vocab_size (needed to build a prompt of token ids)")
    if tokens >= max_len:
        raise AnsibleFilterError(f"teamserve_verify_long_prompt_tokens={tokens} must be below --max-model-len "
                                 f"{max_len}")
    return {"streams": int(streams) if int(streams) > 0 else max(int(workload["concurrent_sequences"]) - 1, 1),
            "tokens": tokens, "max_len": max_len, "vocab_size": vocab,
            "stream_max_tokens": min(1024, max_len - 64)}


def check_long_prompt(result: Any, max_stall_seconds: float) -> Record:
    """Check 5: others keep streaming while a near-maximum prompt is prefilled.

    ``result``: the ``teamserve_verify_long_prompt`` module's result (ITL of the other streams before and
    during the prefill, seconds). PASS when no other stream paused longer than ``max_stall_seconds`` and
    every stream kept going. With chunked prefill a pause is one batch; without it, the whole prefill.
    ``attempts`` in ``result`` (set by the task's ``until``) is the measurement judged, counted from 1.
    """
    r = {k: v for k, v in dict(result or {}).items() if k not in ("changed", "failed", "invocation")}
    longest = (r.get("during") or {}).get("max")
    ok = (longest is not None and float(longest) <= float(max_stall_seconds)
          and r.get("streams_alive_after") == r.get("streams"))
    before, during = r.get("before") or {}, r.get("during") or {}
    return record(
        5, "PASS" if ok else "FAIL",
        f"{r.get('streams')} others' ITL p50/p99 {before.get('p50')}/{before.get('p99')} s before, "
        f"{during.get('p50')}/{during.get('p99')} s during the {r.get('long_prompt_tokens')}-token prefill "
        f"({r.get('long_prompt_ttft_seconds')} s); longest pause {longest} s (target <= {max_stall_seconds} s), "
        f"{r.get('streams_alive_after')}/{r.get('streams')} streams kept going"
        + (f" (measurement {r['attempts']})" if int(r.get("attempts") or 1) > 1 else ""),
        measured=r, target={"max_stall_seconds": float(max_stall_seconds), "streams_alive_after": r.get("streams")},
    )


# --- check 6 ---------------------------------------------------------------------------------------------

def check_limits(limited_user: str, rate_limit: Any, limited: Any, other_user: str, other: Any) -> Record:
    """Check 6: one user's exhausted rate limit refuses them (429 with Retry-After), another user gets 200.

    ``limited``: the ``uri`` result of the requests sent as ``limited_user`` until a 429 (``attempts``,
    ``status``, ``retry_after``, ``content``); ``other``: the ``uri`` result of one request as
    ``other_user``. SKIP when ``limited_user`` is empty.
    """
    if not limited_user:
        return skipped(6, "no test user to exhaust; set teamserve_verify_limited_user (their key is refused for "
                          "one window)", "teamserve_verify_limited_user is empty")
    limited, other = dict(limited or {}), dict(other or {})
    status, attempts = limited.get("status"), limited.get("attempts", 1)
    retry_after = str(limited.get("retry_after") or "")
    try:
        code = (json.loads(limited.get("content") or "{}").get("error") or {}).get("code")
    except (ValueError, AttributeError):
        code = None
    if status != 429:
        return record(6, "FAIL", f"no 429 for {limited_user} after {attempts} requests (last HTTP {status}): the "
                                 "rate limit is not enforced",
                      measured={"limited_user": limited_user, "limited_status": status, "limited_requests": attempts},
                      target={"limited_status": 429, "rate_limit": rate_limit})
    ok = bool(retry_after) and other.get("status") == 200
    return record(
        6, "PASS" if ok else "FAIL",
        f"{limited_user} ({rate_limit['events']}/{rate_limit['window']}): HTTP {status} after {attempts} requests, "
        f"Retry-After {retry_after or 'MISSING'}; {other_user} then got HTTP {other.get('status', 'none')} "
        "(target 429 vs 200)",
        measured={"limited_user": limited_user, "limited_status": status, "limited_requests": attempts,
                  "retry_after": retry_after, "limited_error_code": code, "other_user": other_user,
                  "other_status": other.get("status")},
        target={"limited_status": 429, "other_status": 200, "rate_limit": rate_limit},
    )


# --- check 7 ---------------------------------------------------------------------------------------------

def check_cold_start(enabled: bool, result: Any) -> Record:
    """Check 7: a restart's time to /health is within the budget and no regression on the previous one.

    ``result``: the vllm role's ``vllm_cold_start_result`` (``seconds_to_health``, ``seconds_to_first_token``,
    ``budget_seconds``, ``regression``, ``verdict``, phases). SKIP when ``enabled`` is false.
    """
    if not enabled:
        return skipped(7, "not measured (teamserve_verify_cold_start is false); it restarts the engine",
                       "teamserve_verify_cold_start is false")
    cs = dict(result or {})
    if cs.get("seconds_to_health") is None:
        return record(7, "FAIL", "the engine restart was not measured", measured=cs)
    budget = float(cs.get("budget_seconds") or 0)
    ok = float(cs["seconds_to_health"]) <= budget and not cs.get("regression")
    return record(
        7, "PASS" if ok else "FAIL",
        f"{cs.get('verdict') or str(cs['seconds_to_health']) + ' s to /health'}; "
        f"{cs.get('seconds_to_first_token', '?')} s to the first token through the gateway (budget {budget:.0f} s)",
        measured=cs, target={"budget_seconds": budget, "regression": False},
    )


# --- check 8 ---------------------------------------------------------------------------------------------

def _prompt_lines(text: str, source: str, example: str) -> list[tuple[str, dict[str, Any]]]:
    """The JSON objects of a JSON Lines file that each carry a non-empty ``prompt``, with where each was.

    Blank lines and ``#`` lines are skipped. Raises AnsibleFilterError naming ``source``, the line and
    ``example`` (the expected shape) for invalid JSON or a missing/empty ``prompt``.
    """
    items: list[tuple[str, dict[str, Any]]] = []
    for number, line in enumerate(str(text).splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{source} line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise AnsibleFilterError(f"{where} is not JSON ({err.msg}); each line must be one object like "
                                     f"{example}") from err
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"].strip():
            raise AnsibleFilterError(f"{where}: 'prompt' must be a non-empty string, got {line.strip()[:80]!r}")
        items.append((where, item))
    return items


_TOOL_CHOICES = ("none", "auto", "required")


def _tool_request(where: str, item: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tools`` and ``tool_choice`` of one evaluation line, checked, as request fields (``{}`` without).

    ``tools``: a non-empty list of OpenAI function tools (``{"type": "function", "function": {"name": ...}}``);
    ``tool_choice`` (only with ``tools``): "none", "auto", "required" or ``{"type": "function", "function":
    {"name": <one of the tools>}}``. vLLM 0.31 and 0.32 answer any choice but "none" only when the engine
    runs with --enable-auto-tool-choice and --tool-call-parser (vllm/parser/parser_manager.py); a named
    function constrains the output to that tool's JSON schema, so it suits an evaluation set best.
    Raises AnsibleFilterError naming ``where``, the field and the expected shape.
    """
    if "tools" not in item:
        if "tool_choice" in item:
            raise AnsibleFilterError(f"{where}: 'tool_choice' needs 'tools' on the same line")
        return {}
    tools = item["tools"]
    shape = '[{"type": "function", "function": {"name": "...", "parameters": {...}}}]'
    if not isinstance(tools, list) or not tools or not all(
            isinstance(t, Mapping) and t.get("type") == "function" and isinstance(t.get("function"), Mapping)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"] for t in tools):
        raise AnsibleFilterError(f"{where}: 'tools' must be a non-empty list of function tools like {shape}, "
                                 f"got {json.dumps(tools)[:80]}")
    request: dict[str, Any] = {"tools": tools}
    if "tool_choice" in item:
        choice, names = item["tool_choice"], [t["function"]["name"] for t in tools]
        named = (choice.get("function") or {}).get("name") if isinstance(choice, Mapping) else None
        if not (choice in _TOOL_CHOICES or (isinstance(choice, Mapping) and choice.get("type") == "function"
                                             and named in names)):
            raise AnsibleFilterError(f"{where}: 'tool_choice' must be one of {', '.join(_TOOL_CHOICES)} or "
                                     f'{{"type": "function", "function": {{"name": one of {names}}}}}, '
                                     f"got {json.dumps(choice)[:80]}")
        request["tool_choice"] = choice
    return request


def eval_parse(text: str, source: str = "teamserve_verify_eval_file",
               endpoint: str = "/v1/chat/completions") -> list[dict[str, Any]]:
    """Parse an evaluation set: JSON Lines of ``{"prompt": str, "expected": str (optional), "tools": [...]
    (optional), "tool_choice": ... (optional)}`` (see :func:`_tool_request`), to be asked on ``endpoint``.

    Returns ``[{"prompt", "expected", "request"}]``, ``request`` being the extra request fields (tools) or
    ``{}``. Blank lines and ``#`` lines are skipped. Raises AnsibleFilterError naming the line and the
    expected shape for invalid JSON, a missing/empty ``prompt``, a non-string ``expected``, malformed
    tools, tools for /v1/completions (no tool calling there), a duplicated prompt, or an empty set.
    """
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for where, item in _prompt_lines(text, source, '{"prompt": "...", "expected": "..."}'):
        if "expected" in item and not isinstance(item["expected"], str):
            raise AnsibleFilterError(f"{where}: 'expected' must be a string when present, got "
                                     f"{type(item['expected']).__name__}")
        if item["prompt"] in seen:
            raise AnsibleFilterError(f"{where}: duplicated prompt {item['prompt'][:60]!r}; answers are keyed by prompt")
        seen.add(item["prompt"])
        request = _tool_request(where, item)
        if request and endpoint == "/v1/completions":
            raise AnsibleFilterError(f"{where} carries tools, but the model is served on /v1/completions (declared "
                                     "completions-only), which has no tool calling; remove 'tools' from that line")
        items.append({"prompt": item["prompt"], "expected": item.get("expected"), "request": request})
    if not items:
        raise AnsibleFilterError(f"{source} holds no prompts; add JSON lines like "
                                 '{"prompt": "What is 2+2?", "expected": "4"}')
    return items


def sweep_prompts(text: str, source: str = "teamserve_verify_sweep_prompts_file") -> str:
    """The admin's prompts as ``vllm bench serve --dataset-name custom`` reads them: one ``{"prompt": ...}``
    per line and nothing else (its pandas reader takes no comments or blank lines). Raises
    AnsibleFilterError naming the line for a bad one, or when there is no prompt."""
    lines = [json.dumps({"prompt": item["prompt"]}) for _, item in _prompt_lines(text, source, '{"prompt": "..."}')]
    if not lines:
        raise AnsibleFilterError(f"{source} holds no prompts; add JSON lines like "
                                 '{"prompt": "Summarise this contract: ..."}')
    return "\n".join(lines) + "\n"


def _tool_calls(message: Any) -> list[dict[str, Any]]:
    """``[{"name", "arguments"}]`` of a chat message's ``tool_calls``; ``arguments`` parsed from its JSON
    string (kept as the string when it is not JSON, which is itself a behaviour worth comparing)."""
    calls: list[dict[str, Any]] = []
    if not isinstance(message, Mapping):
        return calls
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            function = {}
        arguments = function.get("arguments")
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        calls.append({"name": function.get("name"), "arguments": arguments})
    return calls


def eval_answers(results: Any) -> list[dict[str, Any]]:
    """Answers from the looped ``uri`` results of the eval requests to /v1/chat/completions (the choice's
    ``message.content``) or, for a completions-only model, /v1/completions (the choice's ``text``).

    Returns ``[{"prompt", "expected", "answer", "prompt_tokens", "tool_calls"}]`` in order; ``prompt_tokens``
    is the response's ``usage.prompt_tokens`` (the prompt as the engine's chat template and tokenizer
    rendered it), None when the response has no usage; ``tool_calls`` is :func:`_tool_calls` of the message
    (``[]`` when it called none). Raises AnsibleFilterError naming the prompt and the HTTP status when a
    request did not answer 200 with a choice.
    """
    answers = []
    for result in results or []:
        item = result.get("item") or {}
        body = result.get("json") or {}
        choices = body.get("choices") if isinstance(body, Mapping) else None
        if result.get("status") != 200 or not choices:
            raise AnsibleFilterError(f"the eval request for prompt {str(item.get('prompt'))[:60]!r} got HTTP "
                                     f"{result.get('status')} {str(result.get('msg') or '')[:120]}".rstrip())
        usage = body.get("usage")
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
        message = choices[0].get("message") or {}
        answers.append({"prompt": item.get("prompt"), "expected": item.get("expected"),
                        "answer": message.get("content") or choices[0].get("text") or "",
                        "prompt_tokens": prompt_tokens, "tool_calls": _tool_calls(message)})
    return answers


def _normalise(answer: Any) -> str:
    return " ".join(str(answer if answer is not None else "").split())


def _calls(item: Mapping[str, Any]) -> str:
    """An answer's tool calls as one comparable string (arguments with sorted keys)."""
    return json.dumps(item.get("tool_calls") or [], sort_keys=True)


def agreement(current: Any, other: Any) -> dict[str, Any]:
    """Exact-match agreement of two answer lists keyed by prompt: an answer agrees when its text
    (whitespace collapsed) and its tool calls (name and arguments) are the same. Returns ``compared``,
    ``agreed``, ``rate`` (None when no prompt is in both) and up to five ``changed`` answers
    (``{"prompt", "before" (``other``'s), "after" (``current``'s)}``, each cut to 200 characters).

    Also ``prompt_tokens_changed``: up to five ``{"prompt", "before", "after"}`` whose prompt token counts
    (see :func:`eval_answers`) differ, and ``prompt_tokens_differ``, how many do: the same messages rendered
    to a different length means the chat template or the tokenizer changed (a new vLLM release's default
    template, a changed tokenizer file), which shifts answers for a reason the admin should know. Likewise
    ``tool_calls_changed`` / ``tool_calls_differ`` for prompts whose tool calls differ: a release that
    calls another function, with other arguments or no longer at all (answers without ``tool_calls``, kept
    by an older version of this filter, count as calling none).
    """
    calls_now = {item["prompt"]: _calls(item) for item in current or []}
    calls_then = {item["prompt"]: _calls(item) for item in other or []}

    def text(item: Mapping[str, Any], calls: str) -> str:
        # the tool calls first, so the 200-character cut below never hides them
        return " ".join(part for part in ("" if calls == "[]" else "tool_calls=" + calls, _normalise(item.get("answer"))) if part)

    mine = {item["prompt"]: text(item, calls_now[item["prompt"]]) for item in current or []}
    theirs = {item["prompt"]: text(item, calls_then[item["prompt"]]) for item in other or []}
    common = sorted(set(mine) & set(theirs))
    agreed = sum(1 for prompt in common if mine[prompt] == theirs[prompt])
    changed = [{"prompt": p[:120], "before": theirs[p][:200], "after": mine[p][:200]}
               for p in common if mine[p] != theirs[p]]
    tokens_now = {item["prompt"]: item.get("prompt_tokens") for item in current or []}
    tokens_then = {item["prompt"]: item.get("prompt_tokens") for item in other or []}
    rendered = [{"prompt": p[:120], "before": tokens_then[p], "after": tokens_now[p]} for p in common
                if isinstance(tokens_now[p], int) and isinstance(tokens_then[p], int) and tokens_now[p] != tokens_then[p]]
    called = [{"prompt": p[:120], "before": calls_then[p][:200], "after": calls_now[p][:200]} for p in common
              if calls_now[p] != calls_then[p]]
    return {"compared": len(common), "agreed": agreed, "rate": round(agreed / len(common), 4) if common else None,
            "changed": changed[:5], "prompt_tokens_differ": len(rendered), "prompt_tokens_changed": rendered[:5],
            "tool_calls_differ": len(called), "tool_calls_changed": called[:5]}


def check_eval(answers: Any, kv_cache_dtype: str, others: Any, min_agreement: float, answers_file: str) -> Record:
    """Check 8: the admin's evaluation set, compared with the answers stored for other KV-cache dtypes.

    ``answers``: :func:`eval_answers` of this run (None: no eval set, SKIP); ``others``: the stored
    documents of other dtypes (``{"kv_cache_dtype", "at", "answers"}``). PASS when every comparison agrees
    at least ``min_agreement`` (0..1). Matches with ``expected`` answers are reported, not judged.
    """
    if answers is None:
        return skipped(8, 'no evaluation set; set teamserve_verify_eval_file to a JSONL file of {"prompt", "expected"}',
                       "teamserve_verify_eval_file is empty")
    graded = [a for a in answers if a.get("expected") is not None]
    matched = sum(1 for a in graded if _normalise(a.get("answer")) == _normalise(a["expected"]))
    expected = {"with_expected": len(graded), "matched": matched,
                "rate": round(matched / len(graded), 4) if graded else None}
    comparisons = [{"kv_cache_dtype": d.get("kv_cache_dtype"), "at": d.get("at"),
                    **agreement(answers, d.get("answers") or [])}
                   for d in sorted(others or [], key=lambda d: str(d.get("kv_cache_dtype")))]
    low = [c for c in comparisons if c["rate"] is not None and c["rate"] < float(min_agreement)]
    compared = "; ".join(f"agreement with {c['kv_cache_dtype']}: {c['agreed']}/{c['compared']} (target >= "
                         f"{min_agreement})" for c in comparisons) or (
        "no answers for another KV-cache dtype yet (switch vllm_engine.kv_cache_dtype, converge, run verify again)")
    return record(
        8, "FAIL" if low else "PASS",
        f"{len(answers)} prompts answered at kv-cache-dtype {kv_cache_dtype}, {matched}/{len(graded)} match the "
        f"expected answer; {compared}",
        measured={"kv_cache_dtype": kv_cache_dtype, "prompts": len(answers), "answers_file": answers_file,
                  "expected_match": expected, "comparisons": comparisons},
        target={"min_agreement": float(min_agreement)},
    )


# --- check 9 ---------------------------------------------------------------------------------------------

def host_addresses(facts: Any) -> list[str]:
    """The host's own addresses from ``ansible_facts`` (network subset), for the outside probe.

    Every IPv4 address (primary and secondaries) and every global IPv6 address of each interface except
    loopback and container networks (docker*, br-*, veth*, ...), whose addresses are private to the host.
    Sorted, without duplicates.
    """
    addresses: set[str] = set()
    for name in (facts or {}).get("interfaces", []):
        if _INTERNAL_IFACES.match(name):
            continue
        iface = facts.get(name.replace("-", "_").replace(".", "_")) or facts.get(name) or {}
        ipv4 = iface.get("ipv4") or {}
        if ipv4.get("address"):
            addresses.add(ipv4["address"])
        for extra in iface.get("ipv4_secondaries") or []:
            if extra.get("address"):
                addresses.add(extra["address"])
        for six in iface.get("ipv6") or []:
            if six.get("scope") == "global" and six.get("address"):
                addresses.add(six["address"])
    return sorted(addresses)


def check_outside(outside_host: str, port: int, probes: Any) -> Record:
    """Check 9: from a host outside the LAN, no address of the box accepts a connection on the gateway port.

    ``probes``: the looped ``wait_for`` results, one per box address (``item``); ``wait_for`` returns
    ``state`` only when the port accepted. SKIP when ``outside_host`` is empty.
    """
    if not outside_host:
        return skipped(9, "no outside host; set teamserve_verify_outside_host to an inventory host outside the LAN",
                       "teamserve_verify_outside_host is empty")
    results = list(probes or [])
    probed = [p["item"] for p in results]
    connected = [p["item"] for p in results if "state" in p]
    ok = not connected and bool(probed)
    return record(
        9, "PASS" if ok else "FAIL",
        f"from {outside_host}: {len(probed)} address(es) x port {port}, {len(connected)} connected "
        f"{'(' + ', '.join(map(str, connected)) + ')' if connected else ''} (target 0)",
        measured={"outside_host": outside_host, "port": int(port), "probed": probed, "connected": connected,
                  "refused_or_timed_out": [a for a in probed if a not in connected]},
        target={"connected": []},
    )


# --- the report --------------------------------------------------------------------------------------------

def table(results: Any) -> list[str]:
    """Check records as aligned table lines, sorted by id; the last line counts PASS/FAIL/SKIP."""
    rows = sorted(results or [], key=lambda r: int(r["id"]))
    width = max([len(str(r["name"])) for r in rows] + [5])
    lines = [f"{'id':>2}  {'check':<{width}}  {'status':<6}  measured vs target",
             f"{'-' * 2}  {'-' * width}  {'-' * 6}  {'-' * 18}"]
    lines += [f"{r['id']:>2}  {r['name']:<{width}}  {r['status']:<6}  {r.get('summary', '')}" for r in rows]
    counts = {s: sum(1 for r in rows if r["status"] == s) for s in ("PASS", "FAIL", "SKIP")}
    lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return lines


def merge(results: Any, new: Any) -> list[Record]:
    """``results`` with ``new`` (one record or a list) added; a later record for an id replaces the earlier."""
    added = [new] if isinstance(new, Mapping) else list(new)
    ids = {r["id"] for r in added}
    return [r for r in results or [] if r["id"] not in ids] + added


# --- the capacity sweep (playbooks/sweep.yml) and the upgrade's gate ---------------------------------------

def _sweep() -> ModuleType:
    """teamserve_capacity.sweep, the sweep's arithmetic (the project's planner package, in the venv)."""
    try:
        from teamserve_capacity import sweep
    except ImportError as err:  # pragma: no cover - depends on the controller's venv
        raise AnsibleFilterError(f"the teamserve_capacity package is not importable on the controller ({err}); "
                                 "run `.venv/bin/pip install --no-deps -e .` in the repository") from err
    return sweep


def sweep_inputs(plan: Any, workload: Any, model: Any, settings: Any) -> dict[str, Any]:
    """What the sweep runs, from the plan and the role's settings (``teamserve_verify_sweep_*``, keys without
    the prefix): ``steps`` (concurrencies), ``bound``, ``targets`` (seconds, and where they came from),
    ``points`` (the plan's numbers the knee is compared with), ``input_tokens``/``output_tokens``,
    ``tokenizer`` and ``args`` (the ``vllm bench serve`` dataset arguments; ``plain_args`` too when a shared
    prefix is asked for: the same prompt length without it, for the prefix cache's A/B).

    ``bound`` 0 is the plan's ``--max-num-queued-reqs`` (the plan's ``--max-num-seqs`` when it sets no queue):
    that many requests fit in the engine's waiting queue even with nothing running, so no step reaches the
    point where the engine answers 503. Targets 0 are ``vllm_workload``'s. Raises AnsibleFilterError naming the setting when a value cannot work.
    """
    sweep = _sweep()
    s = dict(settings or {})
    points = sweep.plan_points(plan)
    output_tokens = int(s.get("output_tokens") or 0)
    base = bench_inputs(plan, workload, model, int(s.get("input_tokens") or 0), output_tokens)
    bound = int(s.get("bound") or 0) or points["max_num_queued_reqs"] or points["max_num_seqs"]
    given = [int(c) for c in s.get("concurrencies") or []]
    if any(c < 1 for c in given):
        raise AnsibleFilterError(f"teamserve_verify_sweep_concurrencies={given}: every step must be >= 1 request")
    steps = sorted(set(given)) if given else sweep.steps(points["concurrent_sequences"], points["max_num_seqs"], bound)
    targets = {"ttft_seconds": float(s.get("ttft_p95_seconds") or workload["ttft_p95_seconds"]),
               "tpot_seconds": float(s.get("tpot_seconds") or workload["tpot_seconds"])}
    source = ("teamserve_verify_sweep_* (a what-if)" if s.get("ttft_p95_seconds") or s.get("tpot_seconds")
              else "vllm_workload")
    prefix = int(s.get("shared_prefix_tokens") or 0)
    prompts_file = str(s.get("prompts_file") or "")
    if prompts_file:
        if prefix:
            raise AnsibleFilterError("teamserve_verify_sweep_shared_prefix_tokens applies to random prompts; with "
                                     "teamserve_verify_sweep_prompts_file the prompts are yours as they are: set one")
        args = ["--dataset-name=custom", f"--dataset-path={prompts_file}", f"--custom-output-len={output_tokens}"]
        if s.get("api_endpoint") == "/v1/completions":
            args.append("--skip-chat-template")  # a completions-only model has no chat template to apply
        dataset = "file"
    else:
        if prefix >= base["input_tokens"]:
            raise AnsibleFilterError(
                f"teamserve_verify_sweep_shared_prefix_tokens={prefix} leaves no random part in a "
                f"{base['input_tokens']}-token prompt; lower it below the prompt length")
        args = ["--dataset-name=random", f"--random-input-len={base['input_tokens'] - prefix}",
                f"--random-output-len={output_tokens}", "--random-range-ratio=0"]
        dataset = "random"
    plain = list(args)
    if prefix:
        args.append(f"--random-prefix-len={prefix}")
        plain[1] = f"--random-input-len={base['input_tokens']}"
    goodput = ["--goodput", f"ttft:{targets['ttft_seconds'] * 1000:g}", f"tpot:{targets['tpot_seconds'] * 1000:g}"]
    # one request before each step's measurement: the first after an idle engine is the slowest of a step
    # (1.28 s against 0.035 s at p95 on the testbed), which at small steps is the whole p95
    common = ["--ignore-eos", "--save-detailed", "--num-warmups=1"]
    return {"steps": steps, "bound": bound, "targets": targets, "targets_source": source, "points": points,
            "input_tokens": base["input_tokens"], "output_tokens": output_tokens, "tokenizer": base["tokenizer"],
            "dataset": dataset, "shared_prefix_tokens": prefix,
            "args": args + common + goodput, "plain_args": plain + common + goodput if prefix else None,
            "rounds": int(s.get("rounds") or 1), "min_prompts": int(s.get("min_prompts") or 1),
            "attempts": int(s.get("attempts") or 1)}


def sweep_step(run: Any) -> dict[str, Any]:
    """One :func:`bench_step` run as the sweep keeps it (flat, seconds and tokens; see teamserve_capacity.sweep)."""
    b, q, e = run["bench"], run["queue"], run.get("engine") or {}
    return {"concurrency": int(run["concurrency"]), "prompts": b["num_prompts"], "completed": b["completed"],
            "failed": b["failed"], "duration_seconds": b["duration_seconds"],
            **{f"{m}_seconds": b[f"{m}_seconds"] for m in ("ttft", "tpot", "itl", "e2el")},
            "request_throughput": b["request_throughput"], "output_throughput": b["output_throughput"],
            "request_goodput": b.get("request_goodput"), "queue_peak": e.get("waiting_peak"),
            "queued": q["queued"], "mean_queue_wait_seconds": q["mean_wait_seconds"],
            "kv_cache_usage_peak": e.get("kv_cache_usage_peak"), "running_peak": e.get("running_peak"),
            "prefix_cache_hit_rate": e.get("prefix_cache_hit_rate"), "preemptions": e.get("preemptions"),
            "samples": e.get("samples"), "errors": b["errors"], "attempt": int(run.get("attempt") or 1),
            "earlier": list(run.get("earlier") or []),
            "input_lens": run.get("input_lens") or [], "output_lens": run.get("output_lens") or []}


def sweep_summary(run: Any) -> dict[str, Any]:
    """A :func:`bench_step` run in a few numbers (a measurement a repeat replaced): concurrency, TTFT and
    TPOT p95 (s), completed and failed requests."""
    b = run["bench"]
    return {"concurrency": int(run["concurrency"]), "ttft_p95_seconds": b["ttft_seconds"]["p95"],
            "tpot_p95_seconds": b["tpot_seconds"]["p95"], "completed": b["completed"], "failed": b["failed"]}


def sweep_meets(run: Any, targets: Any) -> bool:
    """Whether one :func:`bench_step` run met both p95 ``targets`` with every request served."""
    met: bool = _sweep().meets(sweep_step(run), targets, "p95")
    return met


def sweep_stop(run: Any, inputs: Any) -> str:
    """Why the sweep stops after this :func:`bench_step` run, or "" to go on (teamserve_capacity.sweep.stop_after)."""
    reason: str = _sweep().stop_after(sweep_step(run), inputs["targets"], inputs["points"]["concurrent_sequences"],
                                      inputs["bound"])
    return reason


def sweep_document(runs: Any, inputs: Any, meta: Any, plain_run: Any = None) -> dict[str, Any]:
    """The sweep's JSON: ``meta`` (host, at, versions, pins, settings) + the steps, the targets, the plan's
    points, the knees, the recommendation, the context against the plan, the prefix cache's A/B (when
    ``plain_run`` is given: the same concurrency without the shared prefix) and the report lines."""
    sweep = _sweep()
    steps = [sweep_step(r) for r in runs or []]
    document: dict[str, Any] = {**dict(meta or {}), "steps": steps, "targets": dict(inputs["targets"]),
                                "targets_source": inputs["targets_source"], "plan": dict(inputs["points"]),
                                "settings": {k: inputs[k] for k in ("dataset", "input_tokens", "output_tokens",
                                                                    "shared_prefix_tokens", "bound", "rounds",
                                                                    "min_prompts", "attempts", "args")},
                                **sweep.analyse(steps, inputs["targets"], inputs["points"])}
    document["prefix_cache"] = None
    if plain_run:
        plain = sweep_step(plain_run)
        shared = next((s for s in steps if s["concurrency"] == plain["concurrency"]), None)
        if shared:
            document["prefix_cache"] = {**sweep.prefix_win(shared, plain), "plain_step": plain}
    document["report"] = sweep.report(document)
    return document


def sweep_history(document: Any) -> dict[str, Any]:
    """One line of the box's sweep history: the document without its per-request lists and report."""
    line = {k: v for k, v in dict(document).items() if k not in ("report", "table")}
    line["steps"] = [{k: v for k, v in s.items() if k not in ("input_lens", "output_lens")} for s in line["steps"]]
    if line.get("prefix_cache"):
        line["prefix_cache"] = {k: v for k, v in line["prefix_cache"].items() if k != "plain_step"}
    for percentile in list((line.get("knee") or {}).keys()):
        line["knee"][percentile] = {k: v for k, v in line["knee"][percentile].items() if k != "fitted"}
    return line


def sweep_baseline(history: Any, pins: Any) -> dict[str, Any] | None:
    """The newest full sweep in the box's history (JSON lines) made with ``pins`` (the box's recorded pins),
    with a p95 knee; None when there is none (the gate then has nothing to compare with)."""
    for text in reversed(str(history or "").splitlines()):
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if (line.get("kind") == "sweep" and line.get("pins") == pins
                and (line.get("knee") or {}).get("p95", {}).get("concurrency")):
            return dict(line)
    return None


def sweep_gate_steps(baseline: Any, margin: float) -> list[int]:
    """The gate's short sweep for a baseline sweep (teamserve_capacity.sweep.gate_steps on its p95 knee)."""
    steps: list[int] = _sweep().gate_steps(int(baseline["knee"]["p95"]["concurrency"]), float(margin))
    return steps


def sweep_gate(baseline: Any, runs: Any, margin: float) -> dict[str, Any]:
    """The upgrade's verdict: the new engine's p95 knee within ``margin`` of the baseline sweep's
    (teamserve_capacity.sweep.gate), judged against the baseline's own targets."""
    sweep = _sweep()
    result: dict[str, Any] = sweep.gate(int(baseline["knee"]["p95"]["concurrency"]), float(margin),
                                        [sweep_step(r) for r in runs or []], baseline["targets"])
    result["steps"] = [{k: v for k, v in sweep_step(r).items() if k not in ("input_lens", "output_lens")}
                       for r in runs or []]
    return result


class FilterModule:
    """Registers the checks as ``teamserve_verify_<function>`` filters."""

    def filters(self) -> dict[str, Any]:
        functions = (engine, failed, check_capacity, check_engine, bench_inputs, bench_run, check_targets,
                     check_load, long_prompt_inputs, check_long_prompt, check_limits, check_cold_start,
                     eval_parse, eval_answers, agreement, check_eval, host_addresses, check_outside, table, merge,
                     bench_step, sweep_prompts, sweep_inputs, sweep_summary, sweep_meets, sweep_stop, sweep_document, sweep_history, sweep_baseline,
                     sweep_gate_steps, sweep_gate)
        return {"teamserve_metric": teamserve_metric, "teamserve_completion_body": teamserve_completion_body,
                **{f"teamserve_verify_{f.__name__}": f for f in functions}}

"""What a load test runs and what it measured: ``vllm bench serve``'s inputs from the plan, its JSON result,
the engine's queue histogram and gauges between scrapes (checks 3, 4 and 5, the sweep and the upgrade's
load test). Times are seconds, sizes tokens.

    {{ plan | teamserve.core.verify_bench_inputs(workload, model, input_tokens, output_tokens) }}
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ansible.errors import AnsibleFilterError

from ansible_collections.teamserve.core.plugins.module_utils import prometheus

QUEUE_HISTOGRAM = "vllm:request_queue_time_seconds"


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
    first, second = prometheus.histogram(before, QUEUE_HISTOGRAM), prometheus.histogram(after, QUEUE_HISTOGRAM)
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
            "waiting_after": prometheus.value(metrics_after, "vllm:num_requests_waiting")}


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
    samples = [s for s in sampled["samples"] if isinstance(s, Mapping)]
    out: dict[str, Any] = {}
    for key, name in ENGINE_GAUGES.items():
        values = [v for v in (prometheus.value(s["lines"], name) for s in samples if "lines" in s) if v is not None]
        out[key] = (round(max(values), 4) if key == "kv_cache_usage_peak" else int(max(values))) if values else None

    def delta(name: str) -> float | None:
        first, last = prometheus.value(sampled["before"], name), prometheus.value(sampled.get("after") or "", name)
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


class FilterModule:
    """The bench's filters, as ``teamserve.core.verify_<function>``."""

    def filters(self) -> dict[str, Any]:
        functions = (bench_inputs, bench_run, bench_step, long_prompt_inputs)
        return {f"verify_{f.__name__}": f for f in functions}

#!/usr/bin/python
"""Ansible module: a near-maximum prompt sent while other requests stream; their inter-token latency."""

from __future__ import annotations

import itertools
import random
import threading
import time
from typing import Any

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.teamserve.core.plugins.module_utils.sse import STREAM_ERRORS, StreamError, events, open_stream

DOCUMENTATION = r"""
module: teamserve_verify_long_prompt
short_description: Measure other users' inter-token latency while a near-maximum prompt is prefilled
description:
  - Opens O(streams) streamed completions through the gateway, waits until each has produced
    O(warmup_events) chunks, records their chunk arrival times for O(baseline_seconds), then sends one
    prompt of O(long_prompt_tokens) tokens (random token ids, so the prefix cache cannot shorten its
    prefill) with C(max_tokens=1), and keeps recording for O(after_seconds) after its first token.
  - A stream that reaches O(stream_max_tokens) before the window ends is opened again at once, so a fast
    engine cannot finish the others before the long prompt arrives; gaps are measured within one
    response only, never across a reopen.
  - The prefill window is from sending the long prompt to its first token. Inter-token latency (ITL) of
    the other streams is reported before the window and during it (every gap between two chunks that
    overlaps the window), as p50/p99/max in seconds. With chunked prefill the others keep streaming;
    without it every stream stalls for the whole prefill (item 5 of the deployment checklist).
  - Python 3 standard library only, so it runs on the box itself. Read-only; never reports changed.
options:
  url:
    description: Base URL of the gateway (scheme://host:port); C(/v1/completions) is appended.
    type: str
    required: true
  api_key: {description: A user's bearer key for the gateway., type: str, required: true, no_log: true}
  model: {description: Served model name., type: str, required: true}
  ca_path: {description: CA bundle that signs the gateway's certificate (Caddy's internal root)., type: path}
  streams: {description: Number of concurrent streams that represent the other users., type: int, default: 4}
  stream_max_tokens:
    description: Tokens per stream request; one that finishes before the window ends is opened again.
    type: int
    default: 1024
  long_prompt_tokens:
    description: Prompt length of the long request in tokens (keep it below --max-model-len).
    type: int
    required: true
  vocab_size: {description: Vocabulary size of the model (token ids are drawn below it)., type: int, required: true}
  warmup_events: {description: Chunks each stream must have produced before the baseline starts., type: int, default: 4}
  baseline_seconds: {description: Seconds of ITL recorded before the long prompt is sent., type: float, default: 2.0}
  after_seconds: {description: Seconds recorded after the long prompt's first token., type: float, default: 1.0}
  timeout: {description: Overall bound in seconds; every request is abandoned after it., type: float, default: 300}
author: teamserve
"""

RETURN = r"""
streams: {description: Streams started., returned: always, type: int}
long_prompt_tokens: {description: Tokens in the long prompt., returned: always, type: int}
long_prompt_ttft_seconds:
  description: Seconds from sending the long prompt to its first token (its prefill).
  returned: success
  type: float
before:
  description: "ITL of the other streams before the long prompt: count, p50, p99, max (seconds)."
  returned: success
  type: dict
during:
  description: "ITL gaps overlapping the long prompt's prefill: count, p50, p99, max (seconds)."
  returned: success
  type: dict
streams_alive_after:
  description: Streams that produced a chunk after the long prompt's first token.
  returned: success
  type: int
streams_reopened:
  description: Times a stream reached its max_tokens within the window and was opened again.
  returned: success
  type: int
"""

def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) of ``values`` with linear interpolation between closest ranks.

    Same definition as numpy.percentile's default ("linear", Hyndman & Fan type 7), which
    ``vllm bench serve`` uses, so the numbers are comparable. Returns None for an empty list; raises
    ValueError when q is outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def split_gaps(streams: list[list[float]], window_start: float, window_end: float,
               baseline_start: float) -> tuple[list[float], list[float]]:
    """Split each stream's inter-chunk gaps (seconds) into "before" and "during" a window.

    ``streams`` holds chunk arrival times (seconds, monotonic clock, ascending) per stream. A gap (a, b)
    is "before" when baseline_start <= a and b <= window_start, and "during" when it overlaps
    (window_start, window_end): b > window_start and a < window_end. Returns (before, during).
    """
    before: list[float] = []
    during: list[float] = []
    for times in streams:
        for first, second in itertools.pairwise(times):
            if first >= baseline_start and second <= window_start:
                before.append(second - first)
            elif second > window_start and first < window_end:
                during.append(second - first)
    return before, during


def summarise(gaps: list[float]) -> dict[str, Any]:
    """count, p50, p99 and max of a list of gaps, in seconds rounded to 0.1 ms (None when empty)."""
    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 4)
    return {"count": len(gaps), "p50": rounded(percentile(gaps, 50)), "p99": rounded(percentile(gaps, 99)),
            "max": rounded(max(gaps)) if gaps else None}


def chunk_times(response: Any, stop: threading.Event | None, times: list[float]) -> None:
    """Append the arrival time (time.monotonic, seconds) of every SSE chunk carrying choices to ``times``."""
    for event in events(response, stop):
        if event.get("choices"):
            times.append(time.monotonic())


def run(params: dict[str, Any]) -> dict[str, Any]:
    """Run the measurement described in DOCUMENTATION; returns the RETURN fields.

    Raises RuntimeError (a stream failed or stalled), StreamError, OSError or http.client.HTTPException.
    """
    url = params["url"].rstrip("/") + "/v1/completions"

    def gateway_open(body: dict[str, Any]) -> tuple[Any, Any]:
        return open_stream(url, body, params["api_key"], params["ca_path"], params["timeout"])

    deadline = time.monotonic() + params["timeout"]
    stop = threading.Event()
    # per stream, one list of chunk arrival times per response (a finished stream is reopened)
    times: list[list[list[float]]] = [[] for _ in range(params["streams"])]
    errors: list[str] = []
    conns: list[Any] = []

    def stream(index: int) -> None:
        body = {"model": params["model"], "prompt": f"Stream {index}: tell a long story about the sea.",
                "max_tokens": params["stream_max_tokens"], "stream": True, "ignore_eos": True}
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                segment: list[float] = []
                times[index].append(segment)
                conn, response = gateway_open(body)
                conns.append(conn)
                chunk_times(response, stop, segment)
                if not segment and not stop.is_set():
                    raise StreamError("the stream ended without a token")
        except (*STREAM_ERRORS, StreamError) as exc:
            errors.append(f"stream {index}: {exc}")

    def warm(index: int) -> int:
        return max((len(segment) for segment in times[index]), default=0)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(params["streams"])]
    for thread in threads:
        thread.start()
    try:
        while min(warm(i) for i in range(params["streams"])) < params["warmup_events"]:
            if errors:
                raise RuntimeError("; ".join(errors))
            if time.monotonic() > deadline:
                raise RuntimeError(f"streams did not produce {params['warmup_events']} chunks within "
                                   f"{params['timeout']} s")
            time.sleep(0.05)
        baseline_start = time.monotonic()
        time.sleep(params["baseline_seconds"])

        rng = random.Random()
        low = min(100, max(1, params["vocab_size"] // 10))
        prompt = [rng.randrange(low, params["vocab_size"]) for _ in range(params["long_prompt_tokens"])]
        long_times: list[float] = []
        sent = time.monotonic()
        conn, response = gateway_open({"model": params["model"], "prompt": prompt, "max_tokens": 1,
                                       "stream": True})
        try:
            chunk_times(response, None, long_times)
        finally:
            conn.close()
        if not long_times:
            raise RuntimeError("the long prompt returned no token")
        first = long_times[0]
        time.sleep(params["after_seconds"])
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=max(1.0, deadline - time.monotonic()))
        for conn in conns:
            conn.close()
    if errors:
        raise RuntimeError("; ".join(errors))
    before, during = split_gaps([segment for segments in times for segment in segments], sent, first,
                                baseline_start)
    return {
        "streams": params["streams"],
        "long_prompt_tokens": params["long_prompt_tokens"],
        "long_prompt_ttft_seconds": round(first - sent, 4),
        "before": summarise(before),
        "during": summarise(during),
        "streams_alive_after": sum(1 for segments in times if any(t and t[-1] > first for t in segments)),
        "streams_reopened": sum(max(len(segments) - 1, 0) for segments in times),
    }


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "url": {"type": "str", "required": True},
            "api_key": {"type": "str", "required": True, "no_log": True},
            "model": {"type": "str", "required": True},
            "ca_path": {"type": "path"},
            "streams": {"type": "int", "default": 4},
            "stream_max_tokens": {"type": "int", "default": 1024},
            "long_prompt_tokens": {"type": "int", "required": True},
            "vocab_size": {"type": "int", "required": True},
            "warmup_events": {"type": "int", "default": 4},
            "baseline_seconds": {"type": "float", "default": 2.0},
            "after_seconds": {"type": "float", "default": 1.0},
            "timeout": {"type": "float", "default": 300},
        },
        supports_check_mode=True,
    )
    params = module.params
    for name in ("streams", "long_prompt_tokens", "vocab_size", "stream_max_tokens"):
        if params[name] < 1:
            module.fail_json(msg=f"{name} must be at least 1, got {params[name]}")
    if module.check_mode:
        module.exit_json(changed=False, skipped=True, msg="not measured in check mode")
    try:
        result = run(params)
    except (*STREAM_ERRORS, RuntimeError) as exc:
        module.fail_json(msg=f"long-prompt measurement failed: {exc}")
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()

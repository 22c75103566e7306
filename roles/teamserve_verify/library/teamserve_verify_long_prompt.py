#!/usr/bin/python
"""Ansible module: a near-maximum prompt sent while other requests stream; their inter-token latency."""

from __future__ import annotations

DOCUMENTATION = r"""
module: teamserve_verify_long_prompt
short_description: Measure other users' inter-token latency while a near-maximum prompt is prefilled
description:
  - Opens O(streams) streamed completions through the gateway, waits until each has produced
    O(warmup_events) chunks, records their chunk arrival times for O(baseline_seconds), then sends one
    prompt of O(long_prompt_tokens) tokens (random token ids, so the prefix cache cannot shorten its
    prefill) with C(max_tokens=1), and keeps recording for O(after_seconds) after its first token.
  - The prefill window is from sending the long prompt to its first token. Inter-token latency (ITL) of
    the other streams is reported before the window and during it (every gap between two chunks that
    overlaps the window), as p50/p99/max in seconds. With chunked prefill the others keep streaming;
    without it every stream stalls for the whole prefill (the seeds' checklist item 5).
  - Python 3 standard library only, so it runs on the box itself. Read-only; never reports changed.
options:
  url: {description: Base URL of the gateway (scheme://host:port); C(/v1/completions) is appended., type: str, required: true}
  api_key: {description: A user's bearer key for the gateway., type: str, required: true, no_log: true}
  model: {description: Served model name., type: str, required: true}
  ca_path: {description: CA bundle that signs the gateway's certificate (Caddy's internal root)., type: path}
  streams: {description: Number of concurrent streams that represent the other users., type: int, default: 4}
  stream_max_tokens: {description: Upper bound of tokens per stream (streams are closed early once measured)., type: int, default: 1024}
  long_prompt_tokens: {description: Prompt length of the long request in tokens (keep it below --max-model-len)., type: int, required: true}
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
long_prompt_ttft_seconds: {description: Seconds from sending the long prompt to its first token (its prefill)., returned: success, type: float}
before: {description: "ITL of the other streams before the long prompt: count, p50, p99, max (seconds).", returned: success, type: dict}
during: {description: "ITL gaps overlapping the long prompt's prefill: count, p50, p99, max (seconds).", returned: success, type: dict}
streams_alive_after: {description: Streams that produced a chunk after the long prompt's first token., returned: success, type: int}
"""

import http.client
import json
import random
import ssl
import threading
import time
import urllib.parse

from ansible.module_utils.basic import AnsibleModule


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
        for first, second in zip(times, times[1:]):
            if first >= baseline_start and second <= window_start:
                before.append(second - first)
            elif second > window_start and first < window_end:
                during.append(second - first)
    return before, during


def summarise(gaps: list[float]) -> dict:
    """count, p50, p99 and max of a list of gaps, in seconds rounded to 0.1 ms (None when empty)."""
    def rounded(value):
        return None if value is None else round(value, 4)
    return {"count": len(gaps), "p50": rounded(percentile(gaps, 50)), "p99": rounded(percentile(gaps, 99)),
            "max": rounded(max(gaps)) if gaps else None}


class Gateway:
    """POSTs streamed completions to ``<url>/v1/completions`` and yields SSE chunk arrival times."""

    def __init__(self, url: str, api_key: str, ca_path: str | None, timeout: float):
        parts = urllib.parse.urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.context = ssl.create_default_context(cafile=ca_path) if self.https else None

    def open(self, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send the request; raise RuntimeError with the status and body unless the gateway answers 200."""
        if self.https:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self.context)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        conn.request("POST", self.prefix + "/v1/completions", body=json.dumps(body),
                     headers={"Authorization": f"Bearer {self.api_key}", "Content-Type": "application/json",
                              "Accept": "text/event-stream"})
        response = conn.getresponse()
        if response.status != 200:
            text = response.read(400).decode("utf-8", "replace")
            conn.close()
            raise RuntimeError(f"gateway answered HTTP {response.status}: {text}")
        return conn, response


def chunk_times(response, stop: threading.Event | None, times: list[float]) -> None:
    """Append the arrival time (time.monotonic) of every SSE data chunk carrying choices to ``times``."""
    while stop is None or not stop.is_set():
        line = response.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        try:
            event = json.loads(payload)
        except ValueError:
            continue
        if event.get("choices"):
            times.append(time.monotonic())


def run(params: dict) -> dict:
    """Run the measurement described in DOCUMENTATION; returns the RETURN fields. Raises RuntimeError."""
    gateway = Gateway(params["url"], params["api_key"], params["ca_path"], params["timeout"])
    deadline = time.monotonic() + params["timeout"]
    stop = threading.Event()
    times: list[list[float]] = [[] for _ in range(params["streams"])]
    errors: list[str] = []
    conns = []

    def stream(index: int) -> None:
        body = {"model": params["model"], "prompt": f"Stream {index}: tell a long story about the sea.",
                "max_tokens": params["stream_max_tokens"], "stream": True, "ignore_eos": True}
        try:
            conn, response = gateway.open(body)
            conns.append(conn)
            chunk_times(response, stop, times[index])
        except (OSError, RuntimeError, http.client.HTTPException) as exc:
            errors.append(f"stream {index}: {exc}")

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(params["streams"])]
    for thread in threads:
        thread.start()
    try:
        while min((len(t) for t in times), default=params["warmup_events"]) < params["warmup_events"]:
            if errors:
                raise RuntimeError("; ".join(errors))
            if time.monotonic() > deadline:
                raise RuntimeError(f"streams did not produce {params['warmup_events']} chunks within {params['timeout']} s")
            time.sleep(0.05)
        baseline_start = time.monotonic()
        time.sleep(params["baseline_seconds"])

        rng = random.Random()
        low = min(100, max(1, params["vocab_size"] // 10))
        prompt = [rng.randrange(low, params["vocab_size"]) for _ in range(params["long_prompt_tokens"])]
        long_times: list[float] = []
        sent = time.monotonic()
        conn, response = gateway.open({"model": params["model"], "prompt": prompt, "max_tokens": 1,
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
    before, during = split_gaps(times, sent, first, baseline_start)
    return {
        "streams": params["streams"],
        "long_prompt_tokens": params["long_prompt_tokens"],
        "long_prompt_ttft_seconds": round(first - sent, 4),
        "before": summarise(before),
        "during": summarise(during),
        "streams_alive_after": sum(1 for t in times if t and t[-1] > first),
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
    except (OSError, RuntimeError, http.client.HTTPException) as exc:
        module.fail_json(msg=f"long-prompt measurement failed: {exc}")
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()

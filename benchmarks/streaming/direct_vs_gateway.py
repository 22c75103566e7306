#!/usr/bin/env python3
"""The same streamed completion from the engine directly and through the gateway, read by the same client.

Runs ON the box (standard library only), so the client sits at the same place for both paths and the
only difference is Caddy. For each content chunk it records when it arrived and reports, per run: the
time to the first chunk (s), the whole stream (s), the longest gap between chunks (s), the gap p99 (s)
and the share of chunks that arrived in the last 0.25 s (about 0.25 s / duration for an even stream,
near 1 for a burst). A benchmark, not a test: bounded to --runs pairs of --tokens tokens each.

Keys are read from files (root-only), never from argv:
  python3 direct_vs_gateway.py --engine-key-file /root/engine.key --user-key-file /root/user.key
"""
from __future__ import annotations

import argparse
import http.client
import json
import pathlib
import ssl
import time
import urllib.parse
from typing import Any


def stream(url: str, key: str, model: str, tokens: int, context: ssl.SSLContext | None, timeout: float) -> dict[str, Any]:
    """One streamed chat completion; returns arrival times (s since the request was sent) of content chunks."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(host, parts.port, context=context, timeout=timeout)
    else:
        conn = http.client.HTTPConnection(host, parts.port, timeout=timeout)
    body = json.dumps({"model": model, "stream": True, "max_tokens": tokens, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "Count."}]})
    start = time.monotonic()
    conn.request("POST", parts.path.rstrip("/") + "/v1/chat/completions", body=body,
                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    response = conn.getresponse()
    arrivals: list[float] = []
    while True:
        line = response.readline()
        if not line or line.strip() == b"data: [DONE]":
            break
        if line.startswith(b"data: "):
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                arrivals.append(time.monotonic() - start)
    conn.close()
    return {"status": response.status, "arrivals": arrivals}


def summary(arrivals: list[float]) -> dict[str, Any]:
    """First chunk, duration, longest gap, gap p99 (seconds) and the share of chunks in the last 0.25 s."""
    if not arrivals:
        return {"chunks": 0}
    gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:], strict=False)) or [0.0]
    end = arrivals[-1]
    return {"chunks": len(arrivals), "first_chunk_s": round(arrivals[0], 3), "whole_s": round(end, 3),
            "longest_gap_s": round(gaps[-1], 3), "gap_p99_s": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 4),
            "share_last_0_25_s": round(sum(1 for t in arrivals if t >= end - 0.25) / len(arrivals), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-url", default="http://127.0.0.1:8000")
    parser.add_argument("--gateway-url", default="https://127.0.0.1:8443")
    parser.add_argument("--engine-key-file", type=pathlib.Path, required=True)
    parser.add_argument("--user-key-file", type=pathlib.Path, required=True)
    parser.add_argument("--ca", default="", help="CA file for the gateway's certificate ('' = the system's)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    context = ssl.create_default_context(cafile=args.ca or None)
    paths = {"engine": (args.engine_url, args.engine_key_file.read_text().strip()),
             "gateway": (args.gateway_url, args.user_key_file.read_text().strip())}
    rows = []
    for run in range(1, args.runs + 1):
        for name, (url, key) in paths.items():
            result = stream(url, key, args.model, args.tokens, context, args.timeout)
            rows.append({"run": run, "path": name, "status": result["status"], **summary(result["arrivals"])})
            print(json.dumps(rows[-1]))


if __name__ == "__main__":
    main()

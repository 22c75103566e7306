#!/usr/bin/env python3
"""Gateway overhead benchmark (a script, not a test): streamed chat completions at several concurrency
levels against one or more OpenAI-compatible base URLs, side by side.

Usage (standard library only, so it also runs inside a test box):

    bench_gateway.py --target direct=http://127.0.0.1:8000/v1,KEY \
                     --target caddy=https://localhost:8443/v1,KEY --cafile root.crt \
                     [--target litellm=http://127.0.0.1:4000/v1,KEY] \
                     --model tiny --concurrency 1 16 64 --max-tokens 32

For each target and concurrency level it starts that many streams at once and reports, over all streams:
time to first token (TTFT, from sending the request to the first chunk with content; p50 and p99, in ms)
and decode rate (content chunks after the first / time between first and last chunk, tokens/s per
stream, median). Percentiles are nearest-rank. Output: a Markdown table on stdout.
Only point it at servers you run yourself (loopback or your own test boxes): it is a load generator.
"""
from __future__ import annotations

import argparse
import http.client
import json
import ssl
import statistics
import threading
import time
import urllib.parse


def nearest_rank(values: list[float], pct: float) -> float:
    """The pct-th percentile (0 < pct <= 100) by the nearest-rank method; raises ValueError on no values."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))  # ceil(n * pct / 100)
    return ordered[int(rank) - 1]


def one_stream(base_url: str, key: str, model: str, max_tokens: int, context: ssl.SSLContext | None) -> dict:
    """Run one streamed chat completion. Returns {"status", "ttft_s", "tokens", "decode_s"} (seconds)."""
    url = urllib.parse.urlsplit(base_url)
    conn_cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    kwargs = {"context": context} if url.scheme == "https" else {}
    conn = conn_cls(url.hostname, url.port, timeout=600, **kwargs)
    body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Count slowly."}]})
    start = time.perf_counter()
    conn.request("POST", url.path.rstrip("/") + "/chat/completions", body=body,
                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        response.read()
        conn.close()
        return {"status": response.status, "ttft_s": None, "tokens": 0, "decode_s": 0.0}
    first = last = None
    tokens = 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choices = json.loads(line[6:]).get("choices") or []
        if choices and choices[0].get("delta", {}).get("content"):
            now = time.perf_counter()
            first = first or now
            last = now
            tokens += 1
    conn.close()
    return {"status": 200, "ttft_s": (first - start) if first else None, "tokens": tokens,
            "decode_s": (last - first) if first else 0.0}


def run_level(base_url: str, key: str, model: str, max_tokens: int, concurrency: int,
              context: ssl.SSLContext | None) -> list[dict]:
    """Start `concurrency` streams together (a barrier) and wait for all; returns their results."""
    results: list[dict] = []
    lock = threading.Lock()
    barrier = threading.Barrier(concurrency)

    def worker() -> None:
        barrier.wait()
        try:
            result = one_stream(base_url, key, model, max_tokens, context)
        except OSError as err:
            result = {"status": f"error: {err}", "ttft_s": None, "tokens": 0, "decode_s": 0.0}
        with lock:
            results.append(result)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", required=True, help="name=base_url,key")
    parser.add_argument("--cafile", help="CA bundle for https targets (e.g. Caddy's internal root)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()
    context = ssl.create_default_context(cafile=args.cafile) if args.cafile else None
    print("| target | streams | ok | TTFT p50 ms | TTFT p99 ms | decode tok/s per stream (median) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for level in args.concurrency:
        for spec in args.target:
            name, rest = spec.split("=", 1)
            base_url, key = rest.rsplit(",", 1)
            results = run_level(base_url, key, args.model, args.max_tokens, level, context)
            ok = [r for r in results if r["status"] == 200 and r["ttft_s"] is not None]
            ttfts = [r["ttft_s"] * 1000 for r in ok]
            rates = [(r["tokens"] - 1) / r["decode_s"] for r in ok if r["decode_s"] > 0]
            p50 = f"{nearest_rank(ttfts, 50):.1f}" if ttfts else "-"
            p99 = f"{nearest_rank(ttfts, 99):.1f}" if ttfts else "-"
            rate = f"{statistics.median(rates):.1f}" if rates else "-"
            print(f"| {name} | {level} | {len(ok)}/{len(results)} | {p50} | {p99} | {rate} |", flush=True)


if __name__ == "__main__":
    main()

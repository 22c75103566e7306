#!/usr/bin/env python3
"""Chunk arrival through the gateway: the official openai SDK and curl, side by side on the same stream.

A user reported 1,000-token streams that, through the SDK, sometimes arrived in one burst at the end while
curl streamed evenly. This measures, for each client and run, when every streamed chunk arrived:

* ``first_s``  seconds from the request to the first content chunk (TTFT as the client sees it);
* ``gap_p50_s``/``gap_p99_s``/``gap_max_s``  seconds between consecutive content chunks;
* ``last_250ms_share``  the share of chunks that arrived in the last 0.25 s of the stream (about
  0.25 / total seconds when chunks arrive evenly; near 1 for a burst).

Inputs (flags): ``--url`` the gateway's base URL (``https://host:8443``), ``--key-file`` a file holding a
user's key (never argv), ``--ca`` the gateway's CA bundle, ``--model``, ``--tokens`` (output tokens per
stream), ``--runs`` (per client, alternated). Output: one JSON object per run on stdout, then a Markdown
summary. A benchmark, not a test: nothing asserts on its numbers. Runs are bounded by ``--runs`` and
each request by ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import tempfile
import time
from typing import Any

import httpx2 as httpx  # the HTTP client openai 3.x is built on
import openai

PROMPT = "Write a long story about a lighthouse keeper. Do not stop early."


def summary(client: str, sent: float, arrivals: list[float]) -> dict[str, Any]:
    """Timing figures (seconds) of one stream from its request time and its chunks' arrival times."""
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    end = arrivals[-1] if arrivals else sent
    quantiles = statistics.quantiles(gaps, n=100) if len(gaps) >= 2 else [0.0] * 99
    return {"client": client, "chunks": len(arrivals), "first_s": round(arrivals[0] - sent, 3) if arrivals else None,
            "total_s": round(end - sent, 3), "gap_p50_s": round(quantiles[49], 4), "gap_p99_s": round(quantiles[98], 4),
            "gap_max_s": round(max(gaps, default=0.0), 4),
            "last_250ms_share": round(sum(1 for t in arrivals if t >= end - 0.25) / max(len(arrivals), 1), 3)}


def sdk_stream(args: argparse.Namespace, key: str) -> dict[str, Any]:
    """One streamed chat completion through the openai SDK (its default HTTP client settings)."""
    client = openai.OpenAI(base_url=args.url + "/v1", api_key=key, max_retries=0, timeout=args.timeout,
                           http_client=httpx.Client(verify=args.ca))
    sent, arrivals = time.monotonic(), []
    stream = client.chat.completions.create(model=args.model, stream=True, max_tokens=args.tokens,
                                            messages=[{"role": "user", "content": PROMPT}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    return summary("openai SDK", sent, arrivals)


def curl_stream(args: argparse.Namespace, key_file: pathlib.Path) -> dict[str, Any]:
    """The same request with curl -N (no buffering), its header read from a 0600 file (not argv)."""
    body = json.dumps({"model": args.model, "stream": True, "max_tokens": args.tokens,
                       "messages": [{"role": "user", "content": PROMPT}]})
    with tempfile.NamedTemporaryFile("w", suffix=".hdr") as header:
        header.write(f"Authorization: Bearer {key_file.read_text().strip()}\n")
        header.flush()
        sent, arrivals = time.monotonic(), []
        with subprocess.Popen(["curl", "-sS", "-N", "--max-time", str(args.timeout), "--cacert", args.ca,
                               "-H", f"@{header.name}", "-H", "Content-Type: application/json", "-d", body,
                               args.url + "/v1/chat/completions"], stdout=subprocess.PIPE, text=True) as curl:
            assert curl.stdout is not None
            for line in curl.stdout:
                if line.startswith("data: {") and '"content":"' in line.replace(": ", ":"):
                    arrivals.append(time.monotonic())
    return summary("curl -N", sent, arrivals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="https://10.231.0.10:8443")
    parser.add_argument("--key-file", type=pathlib.Path, required=True)
    parser.add_argument("--ca", default="/var/cache/teamserve-testbed/caddy-root.crt")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=180)
    args = parser.parse_args()
    key = args.key_file.read_text().strip()
    results = []
    for _ in range(args.runs):
        for run in (lambda: sdk_stream(args, key), lambda: curl_stream(args, args.key_file)):
            results.append(run())
            print(json.dumps(results[-1]), flush=True)
    print("\n| client | chunks | first chunk (s) | gap p50 / p99 / max (s) | share in the last 0.25 s |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['client']} | {r['chunks']} | {r['first_s']} | {r['gap_p50_s']} / {r['gap_p99_s']} / "
              f"{r['gap_max_s']} | {r['last_250ms_share']} |")


if __name__ == "__main__":
    main()

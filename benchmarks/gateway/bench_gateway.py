#!/usr/bin/env python3
"""Gateway overhead benchmark (a script, not a test): streamed chat completions at several concurrency
levels against OpenAI-compatible base URLs, side by side in one run.

Usage (standard library only, so it also runs inside a test box or its network namespace):

    bench_gateway.py --target direct=http://127.0.0.1:8000/v1,ENGINE_KEY \
                     --target caddy=https://localhost:8443/v1,KEY_A,KEY_B --cafile caddy-root.crt \
                     --target litellm=https://localhost:4000/v1,KEY_A,KEY_B --cafile litellm.crt \
                     --model tiny --concurrency 1 16 64 --max-tokens 64 --rounds 3 --per-minute 190

The first target is the baseline the "added" columns are computed against (the engine itself).
Several keys after a URL are used round-robin, so one user's rate limit is not what is measured.

Method: a discarded warm-up burst of ``--warmup`` streams against every target, then for each
concurrency level ``--rounds`` rounds; each round runs every target once (its order rotated each round, so no target is
always first after the engine has been idle), a burst of N streams released together by a barrier,
each stream on its own new connection (TCP + TLS handshake included: what a client without
keep-alive sees). Per stream: time to first token (TTFT: from before connecting to the first chunk
with content, seconds) and decode rate ((completion tokens - 1) / (last - first content chunk),
tokens/s: the inverse of vLLM's benchmark "TPOT"; completion tokens from the usage the server reports
with ``stream_options.include_usage``). Reported per target and level, over the streams of all rounds
pooled: TTFT p50 and p99 (nearest rank), the median per-stream decode rate, and the aggregate rate (all
completion tokens of a burst / the burst's wall time, median over rounds). Answers other than 200
(429, 503: a limiter or a full server) are counted, not timed. ``--per-minute`` keeps each target under
the users' rate limits by pausing between bursts.
Only point it at servers you run yourself (loopback or your own test boxes): it is a load generator.
"""
from __future__ import annotations

import argparse
import http.client
import json
import ssl
import statistics
import sys
import threading
import time
import urllib.parse


def nearest_rank(values: list[float], pct: float) -> float:
    """The pct-th percentile (0 < pct <= 100) of ``values`` by the nearest-rank method.

    Nearest rank: the smallest value with at least pct % of the values at or below it (rank
    ceil(n * pct / 100)); no interpolation, so p99 of fewer than 100 values is the maximum.
    Raises ValueError when ``values`` is empty or pct is outside (0, 100].
    """
    if not values:
        raise ValueError("no values")
    if not 0 < pct <= 100:
        raise ValueError(f"percentile {pct} is outside (0, 100]")
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * pct // 100))  # ceil(n * pct / 100)
    return ordered[int(rank) - 1]


def parse_target(spec: str) -> tuple[str, str, list[str]]:
    """Split ``name=base_url,key[,key...]`` into (name, base_url, keys).

    A key written ``@path`` stands for the comma-separated keys in the file at ``path`` (so keys need
    not appear on a command line, which other local users can read). Raises ValueError when the name,
    the URL (http or https) or every key is missing; OSError when a key file cannot be read.
    """
    name, sep, rest = spec.partition("=")
    url, *items = rest.split(",")
    keys: list[str] = []
    for item in items:
        if item.startswith("@"):
            with open(item[1:], encoding="utf-8") as handle:
                keys += handle.read().strip().split(",")
        else:
            keys.append(item)
    keys = [k.strip() for k in keys if k.strip()]
    if not sep or not name or urllib.parse.urlsplit(url).scheme not in ("http", "https") or not keys:
        raise ValueError(f"--target {spec.split(',')[0]},...: expected name=http(s)://host:port/v1,KEY[,KEY...]")
    return name, url, keys


def one_stream(base_url: str, key: str, model: str, max_tokens: int, context: ssl.SSLContext | None,
               extra_body: dict | None = None) -> dict:
    """Run one streamed chat completion on a new connection.

    Returns {"status": the HTTP status (int), "200 + error <code> in the stream" (an error event after
    the 200, as vLLM sends when its queue is full) or "error: ..." (no HTTP answer); "ttft_s": seconds
    or None; "tokens": completion tokens (from the usage the server reports; content chunks if it
    reports none); "first_s"/"last_s": perf_counter() of the first/last content chunk or None}.
    """
    url = urllib.parse.urlsplit(base_url)
    if url.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(url.hostname or "", url.port, timeout=600,
                                                                       context=context)
    else:
        conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=600)
    # include_usage: the last chunk carries completion_tokens. A busy engine merges several tokens into
    # one chunk, so counting chunks would undercount.
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Count slowly."}], **(extra_body or {})}
    start = time.perf_counter()
    first = last = None
    tokens = chunks = 0
    stream_error = None
    try:
        conn.request("POST", url.path.rstrip("/") + "/chat/completions", body=json.dumps(body),
                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            response.read()
            return {"status": response.status, "ttft_s": None, "tokens": 0, "first_s": None, "last_s": None}
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("error"):  # vLLM rejects some requests after a 200 has gone out (queue full)
                stream_error = (event["error"] or {}).get("code") or "?"
            choices = event.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
            usage = event.get("usage") or {}
            if usage.get("completion_tokens"):
                tokens = int(usage["completion_tokens"])
    except (OSError, http.client.HTTPException, ValueError) as err:
        return {"status": f"error: {type(err).__name__}: {err}", "ttft_s": None, "tokens": tokens or chunks,
                "first_s": first, "last_s": last}
    finally:
        conn.close()
    if stream_error is not None:
        return {"status": f"200 + error {stream_error} in the stream", "ttft_s": None, "tokens": tokens or chunks,
                "first_s": first, "last_s": last}
    return {"status": 200, "ttft_s": (first - start) if first else None, "tokens": tokens or chunks,
            "first_s": first, "last_s": last}


def run_burst(base_url: str, keys: list[str], model: str, max_tokens: int, concurrency: int,
              context: ssl.SSLContext | None, extra_body: dict | None = None) -> dict:
    """Release ``concurrency`` streams together (a barrier) and wait for all of them.

    Keys are assigned round-robin. Returns {"streams": [one_stream results], "wall_s": seconds from
    the release to the last stream's end}.
    """
    results: list[dict] = []
    lock = threading.Lock()
    barrier = threading.Barrier(concurrency + 1)

    def worker(key: str) -> None:
        barrier.wait()
        result = one_stream(base_url, key, model, max_tokens, context, extra_body)
        with lock:
            results.append(result)

    threads = [threading.Thread(target=worker, args=(keys[i % len(keys)],), daemon=True)
               for i in range(concurrency)]
    for thread in threads:
        thread.start()
    barrier.wait()
    released = time.perf_counter()
    for thread in threads:
        thread.join(timeout=900)
    return {"streams": results, "wall_s": time.perf_counter() - released}


class Pacer:
    """Keeps a target's requests within ``per_minute`` over any sliding 60 s, by waiting BETWEEN bursts.

    The gateways limit each user (Caddy: a sliding window; LiteLLM: requests per minute): a benchmark that
    ran into those limits would measure 429s, and would spend the budget other users of the shared
    testbed need. ``per_minute`` 0 = no pacing.
    """

    def __init__(self, per_minute: int, clock=time.monotonic, sleep=time.sleep) -> None:
        self.per_minute, self.clock, self.sleep = per_minute, clock, sleep
        self.sent: list[tuple[float, int]] = []

    def wait_for(self, count: int) -> float:
        """Sleep until ``count`` more requests fit; return the seconds waited. Raises ValueError if they
        never can (count > per_minute)."""
        if not self.per_minute:
            return 0.0
        if count > self.per_minute:
            raise ValueError(f"a burst of {count} exceeds the budget of {self.per_minute} requests per minute")
        waited = 0.0
        while True:
            now = self.clock()
            self.sent = [(t, n) for t, n in self.sent if now - t < 60]
            if sum(n for _, n in self.sent) + count <= self.per_minute:
                self.sent.append((now, count))
                return waited
            pause = 60 - (now - self.sent[0][0]) + 0.05
            self.sleep(pause)
            waited += pause


def summarise(bursts: list[dict]) -> dict:
    """Pool the streams of several bursts of one target at one level.

    Returns {"total": streams started, "ok": streams answered 200 with content, "refused": {status: count}
    for other answers, "ttft_p50_ms", "ttft_p99_ms" (nearest rank, ms), "decode_tps" (median per-stream
    tokens/s), "aggregate_tps" (median over bursts of completion tokens / burst wall time)}; a value is None
    when no stream of that kind exists.
    """
    streams = [s for b in bursts for s in b["streams"]]
    ok = [s for s in streams if s["status"] == 200 and s["ttft_s"] is not None]
    refused: dict[str, int] = {}
    for s in streams:
        if not (s["status"] == 200 and s["ttft_s"] is not None):
            label = str(s["status"]) if s["status"] != 200 else "200 without content"
            refused[label] = refused.get(label, 0) + 1
    ttfts = [s["ttft_s"] * 1000 for s in ok]
    rates = [(s["tokens"] - 1) / (s["last_s"] - s["first_s"]) for s in ok if s["last_s"] > s["first_s"]]
    aggregates = [sum(s["tokens"] for s in b["streams"]) / b["wall_s"] for b in bursts if b["wall_s"] > 0]
    return {
        "total": len(streams), "ok": len(ok), "refused": refused,
        "ttft_p50_ms": nearest_rank(ttfts, 50) if ttfts else None,
        "ttft_p99_ms": nearest_rank(ttfts, 99) if ttfts else None,
        "decode_tps": statistics.median(rates) if rates else None,
        "aggregate_tps": statistics.median(aggregates) if aggregates else None,
    }


def markdown_table(summaries: dict[int, dict[str, dict]], baseline: str) -> str:
    """Render {level: {target: summarise()}} as a Markdown table; "added" = target minus ``baseline``.
    p50 columns to 0.1 ms (the gateway's own cost is a fraction of a millisecond), p99 to 1 ms."""
    def num(value: float | None, fmt: str = "{:.0f}") -> str:
        return "-" if value is None else fmt.format(value)

    def added(value: float | None, base: float | None, fmt: str = "{:+.0f}") -> str:
        return "-" if value is None or base is None else fmt.format(value - base)

    lines = ["| streams | target | answered 200 | TTFT p50 ms | TTFT p99 ms | added p50 ms | added p99 ms "
             "| decode tok/s per stream (median) | tok/s all streams |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for level, by_target in summaries.items():
        base = by_target[baseline]
        for name, s in by_target.items():
            refused = ", ".join(f"{n}× {code}" for code, n in sorted(s["refused"].items()))
            answered = f"{s['ok']}/{s['total']}" + (f" ({refused})" if refused else "")
            is_base = name == baseline
            lines.append(
                f"| {level} | {name} | {answered} | {num(s['ttft_p50_ms'], '{:.1f}')} | {num(s['ttft_p99_ms'])} "
                f"| {'—' if is_base else added(s['ttft_p50_ms'], base['ttft_p50_ms'], '{:+.1f}')} "
                f"| {'—' if is_base else added(s['ttft_p99_ms'], base['ttft_p99_ms'])} "
                f"| {num(s['decode_tps'], '{:.1f}')} | {num(s['aggregate_tps'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; prints the Markdown table on stdout, progress on stderr."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", required=True, help="name=base_url,key[,key...]")
    parser.add_argument("--cafile", action="append", default=[],
                        help="CA certificate(s) trusted for https targets (repeatable)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3, help="bursts per target and level (pooled)")
    parser.add_argument("--warmup", type=int, default=4, help="streams per target before the first level (discarded)")
    parser.add_argument("--pause", type=float, default=1.0, help="seconds between bursts (the engine drains)")
    parser.add_argument("--extra-body", default="{}", help='JSON merged into each request, e.g. {"ignore_eos": true}')
    parser.add_argument("--per-minute", type=int, default=0,
                        help="at most this many requests per target in any 60 s (pauses between bursts; 0 = off)")
    parser.add_argument("--json", help="also write every stream's raw result to this file")
    args = parser.parse_args(argv)
    try:
        targets = [parse_target(spec) for spec in args.target]
        extra_body = json.loads(args.extra_body)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    context = None
    if args.cafile:
        context = ssl.create_default_context(cafile=args.cafile[0])
        for extra in args.cafile[1:]:
            context.load_verify_locations(cafile=extra)
    if args.per_minute and max(args.concurrency) > args.per_minute:
        parser.error(f"--concurrency {max(args.concurrency)} exceeds --per-minute {args.per_minute}")
    pacers = {t[0]: Pacer(args.per_minute) for t in targets}
    raw: dict[int, dict[str, list[dict]]] = {}
    # Warm-up, discarded: lazy initialisation (LiteLLM's first requests take seconds), first connections.
    for name, url, keys in targets:
        print(f"[bench] warm-up against {name}", file=sys.stderr, flush=True)
        pacers[name].wait_for(args.warmup)
        run_burst(url, keys, args.model, args.max_tokens, args.warmup, context, extra_body)
    for level in args.concurrency:
        raw[level] = {t[0]: [] for t in targets}
        for round_no in range(args.rounds):
            shift = round_no % len(targets)
            for name, url, keys in targets[shift:] + targets[:shift]:
                time.sleep(args.pause)
                waited = pacers[name].wait_for(level)
                if waited:
                    print(f"[bench] waited {waited:.0f} s for {name}'s rate budget", file=sys.stderr, flush=True)
                burst = run_burst(url, keys, args.model, args.max_tokens, level, context, extra_body)
                raw[level][name].append(burst)
                if all(str(st["status"]).startswith("error:") for st in burst["streams"]):
                    print(f"[bench] every stream to {name} failed without an HTTP answer "
                          f"({burst['streams'][0]['status']}): is the server down or restarting? Not a "
                          "result; rerun when it is up.", file=sys.stderr, flush=True)
                    return 1
                s = summarise([burst])
                print(f"[bench] {level} streams, round {round_no + 1}, {name}: {s['ok']}/{s['total']} ok, "
                      f"TTFT p50 {s['ttft_p50_ms'] or 0:.0f} ms, wall {burst['wall_s']:.2f} s",
                      file=sys.stderr, flush=True)
    summaries = {level: {name: summarise(bursts) for name, bursts in by_target.items()}
                 for level, by_target in raw.items()}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "target"},
                       "targets": [t[0] for t in targets], "raw": raw, "summaries": summaries}, out, indent=1)
    print(markdown_table(summaries, targets[0][0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

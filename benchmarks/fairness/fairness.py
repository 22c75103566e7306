#!/usr/bin/env python3
"""One colleague's flood against another's time to first token, through the testbed box's gateway.

Against the box `molecule converge -s default` provisions (real vLLM CPU engine, Caddy gateway), from the
controller. Per round: the victim sends --samples short streamed chat requests one after the other alone
(baseline), then again while the flooder holds --flood-factor x their in-flight cap of long streams open
(all sent at once; refused ones are not retried). Prints, per round and pooled: the victim's TTFT p50 /
p95 / max (seconds, from sending the request to its first content token) with and without the flood,
the refusals per user by error code, and the most engine sequences the flooder had admitted at once (the
gateway's own count, the access log's `in_flight`). A benchmark, not a test: nothing is asserted. Every
loop is bounded in count and time; traffic goes only to the testbed box.

Keys come from the testbed's vault (ansible-vault, the testbed's password file), never from argv:

    .venv/bin/python benchmarks/fairness/fairness.py --rounds 3 --json /tmp/fairness.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import threading
import time
from typing import Any

import httpx2 as httpx  # the HTTP client openai 3.x is built on (requirements.txt)
import yaml

REPO = pathlib.Path(__file__).resolve().parents[2]
CACHE = pathlib.Path(os.environ.get("TESTBED_CACHE", "/var/cache/teamserve-testbed"))
GATEWAY = "https://10.231.0.10:8443"  # the testbed box on its LAN (caddy_tls_mode internal)
CA = CACHE / "caddy-root.crt"  # the box's internal CA root, fetched by the caddy role
BOX = "teamserve-box"  # its container, for the access log


def testbed_keys() -> dict[str, str]:
    """The users' keys from the testbed inventory's vault (name -> key)."""
    out = subprocess.run([str(REPO / ".venv/bin/ansible-vault"), "view", "--vault-password-file",
                          str(CACHE / "vault-pass"),
                          str(REPO / "inventories/testbed/group_vars/teamserve/caddy_keys.vault.yml")],
                         check=True, capture_output=True, text=True).stdout
    return yaml.safe_load(out)["caddy_user_keys"]


def user_caps() -> dict[str, int]:
    """Each testbed user's in-flight cap: their own max_inflight, else the box's default from the gateway
    (the plan's admission.user_max_inflight, read back from the rendered Caddyfile's key map)."""
    caddyfile = subprocess.run(["docker", "exec", BOX, "cat", "/etc/caddy/Caddyfile"], check=True,
                               capture_output=True, text=True).stdout
    caps = {}
    for line in caddyfile.splitlines():
        fields = line.split()
        # <sha256> name expires cap, then the tier, lane and token budgets (columns the map may gain)
        if len(fields) >= 4 and len(fields[0]) == 64 and fields[3].isdigit():
            caps[fields[1]] = int(fields[3])
    if not caps:
        raise SystemExit(f"no key-map rows (<sha256> name expires cap ...) in {BOX}'s /etc/caddy/Caddyfile")
    return caps


PHASES = {"connection.connect_tcp.complete": "tcp", "connection.start_tls.complete": "tls",
          "http11.send_request_body.complete": "sent", "http11.receive_response_headers.complete": "headers"}


def ttft(key: str, tokens: int, timeout: float, gaps: list[float] | None = None,
         phases: dict[str, float] | None = None, client: httpx.Client | None = None) -> float | str:
    """Seconds to the first content token of one streamed chat request, or "<status> <code>". With
    `gaps`, the stream's mean seconds per output token after the first (its TPOT: one engine step, as
    one stream sees it; chunks arrive in bursts, so single gaps say nothing) is appended to it. With
    `phases`, the seconds from the start to each step the client saw (PHASES' values: TCP connected, TLS
    done, request sent, response headers in; httpcore's `trace` extension) are written into it; a request
    on a kept connection has no TCP or TLS step. With `client`, its connections are reused, as an SDK
    client's are; without, each request opens its own."""
    body = {"model": "tiny", "stream": True, "max_tokens": tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count."}]}
    start = time.monotonic()

    def trace(event: str, _info: dict[str, Any]) -> None:
        if phases is not None and event in PHASES:
            phases[PHASES[event]] = time.monotonic() - start

    with contextlib.ExitStack() as stack:
        if client is None:
            client = stack.enter_context(httpx.Client(verify=str(CA), timeout=timeout))
        response = stack.enter_context(client.stream("POST", f"{GATEWAY}/v1/chat/completions", json=body,
                                                     headers={"Authorization": f"Bearer {key}"},
                                                     extensions={"trace": trace}))
        if response.status_code != 200:
            response.read()
            return f"{response.status_code} {response.json()['error']['code']}"
        first: float | None = None
        last, chunks = 0.0, 0
        for line in response.iter_lines():
            if (first is None or gaps is not None) and line.startswith("data: {"):
                choices = json.loads(line.removeprefix("data: ")).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    last, chunks = time.monotonic() - start, chunks + 1
                    if first is None:
                        first = last
        if gaps is not None and first is not None and chunks > 1:
            gaps.append((last - first) / (chunks - 1))
        return first if first is not None else "no token"


def summary(values: list[float | str]) -> dict[str, Any]:
    """p50 / p95 / max of the float values (seconds), and the refusals (non-floats) counted by code."""
    times = sorted(v for v in values if isinstance(v, float))
    refused: dict[str, int] = {}
    for v in values:
        if not isinstance(v, float):
            refused[v] = refused.get(v, 0) + 1
    if not times:
        return {"n": 0, "refused": refused}
    p95 = statistics.quantiles(times, n=20, method="inclusive")[18] if len(times) > 1 else times[0]
    return {"n": len(times), "p50": statistics.median(times), "p95": p95, "max": times[-1], "refused": refused}


def max_in_flight(user: str, since: float) -> int:
    """The most engine sequences `user` had admitted at once since `since` (epoch s): the largest
    `in_flight` the gateway logged for their requests."""
    log = subprocess.run(["docker", "exec", BOX, "cat", "/var/log/caddy/access.log"], check=True,
                         capture_output=True, text=True).stdout
    seen = [int(e["in_flight"]) for e in map(json.loads, log.splitlines())
            if e.get("user") == user and e["ts"] >= since and str(e.get("in_flight", "")).isdigit()]
    return max(seen, default=0)


def victim_phase(key: str, args: argparse.Namespace, steps: list[dict[str, float]] | None = None) -> list[float | str]:
    """The victim's --samples short requests, one after the other, each ttft()'s result: on one kept
    connection, as an SDK client sends them, or each on its own with --connect-per-request. With `steps`
    (one dict per request), each request's phases are written into its dict."""
    with contextlib.ExitStack() as stack:
        client = None if args.connect_per_request else \
            stack.enter_context(httpx.Client(verify=str(CA), timeout=args.timeout))
        return [ttft(key, args.short_tokens, args.timeout, phases=steps[i] if steps else None, client=client)
                for i in range(args.samples)]


def one_round(keys: dict[str, str], args: argparse.Namespace, cap: int) -> dict[str, Any]:
    """Baseline, then the flood; returns the victim's summaries, the flood's outcomes and admitted cost."""
    baseline = victim_phase(keys[args.victim], args)
    since = time.time() - 1
    outcomes: list[float | str] = []
    gaps: list[float] = []
    lock = threading.Lock()

    def flood_stream() -> None:
        mine: list[float] = []
        try:
            result = ttft(keys[args.flooder], args.long_tokens, args.timeout, mine)
        except httpx.HTTPError as err:
            result = f"error {type(err).__name__}"
        with lock:
            outcomes.append("200" if isinstance(result, float) else result)
            gaps.extend(mine)

    flood = [threading.Thread(target=flood_stream, daemon=True) for _ in range(args.flood_factor * cap)]
    for thread in flood:
        thread.start()
    time.sleep(args.settle)  # the admitted streams are generating
    steps: list[dict[str, float]] = [{} for _ in range(args.samples)]
    during = victim_phase(keys[args.victim], args, steps)
    for thread in flood:
        thread.join(timeout=args.timeout)
    flood_refused: dict[str, int] = {}
    for outcome in outcomes:
        if outcome != "200":
            flood_refused[str(outcome)] = flood_refused.get(str(outcome), 0) + 1
    base, loaded = summary(baseline), summary(during)
    # The goal: the victim never refused, and their p95 within +10 % of the baseline's or within one
    # engine step (the flood streams' median TPOT), whichever is larger.
    step = statistics.median(gaps) if gaps else 0.0
    allowed = max(0.10 * base.get("p95", 0.0), step)
    met = bool(base["n"] and loaded["n"]) and not loaded["refused"] and not base["refused"] and \
        loaded["p95"] <= base["p95"] + allowed
    # Where the slowest answer during the flood spent its time (seconds from its start).
    slowest = max(range(args.samples), key=lambda i: during[i] if isinstance(during[i], float) else -1.0)
    return {"baseline": base, "during": loaded,
            "slowest": {**steps[slowest], "first_token": during[slowest]},
            "flood": {"sent": len(flood), "served": outcomes.count("200"), "refused": flood_refused,
                      "max_in_flight": max_in_flight(args.flooder, since), "cap": cap, "engine_step": step},
            "goal": {"allowed_increase": allowed, "met": met}}


def fmt(s: dict[str, Any]) -> str:
    if not s["n"]:
        return f"no answers; refused {s['refused']}"
    return (f"p50 {s['p50']:.3f} s, p95 {s['p95']:.3f} s, max {s['max']:.3f} s over {s['n']}"
            + (f"; refused {s['refused']}" if s["refused"] else "; 0 refused"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--victim", default="alice", help="the user whose TTFT is measured")
    parser.add_argument("--flooder", default="bob", help="the user who floods (the box's default cap)")
    parser.add_argument("--flood-factor", type=int, default=5, help="flood streams per unit of the flooder's cap")
    parser.add_argument("--samples", type=int, default=10, help="victim requests per phase")
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=1500, help="tokens per flood stream")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds between the flood and the measurement")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request at most")
    parser.add_argument("--json", type=pathlib.Path, help="write every round's figures here")
    parser.add_argument("--connect-per-request", action="store_true",
                        help="the victim opens a new connection (TCP, TLS) for each request instead of keeping one")
    args = parser.parse_args()
    keys = testbed_keys()
    cap = user_caps()[args.flooder]
    rounds = []
    for number in range(1, args.rounds + 1):
        result = one_round(keys, args, cap)
        rounds.append(result)
        flood = result["flood"]
        print(f"round {number}: {args.victim} alone: {fmt(result['baseline'])}")
        print(f"round {number}: {args.victim} during {args.flooder}'s flood: {fmt(result['during'])}")
        print(f"round {number}: {args.flooder} sent {flood['sent']} (cap {cap}), served {flood['served']}, "
              f"refused {flood['refused']}, at most {flood['max_in_flight']} sequences admitted at once; "
              f"engine step {flood['engine_step']:.3f} s")
        print(f"round {number}: {args.victim}'s slowest during the flood (s from its start): "
              + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in result["slowest"].items()))
        print(f"round {number}: goal (0 refused, p95 within +{result['goal']['allowed_increase']:.3f} s of "
              f"the baseline) {'met' if result['goal']['met'] else 'NOT met'}")
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()

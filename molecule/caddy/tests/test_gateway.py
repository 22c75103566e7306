"""Behaviour of the caddy role's gateway, seen from a client on the controller (molecule/caddy).

The gateway runs in the box ``caddydev-box``; behind it, on the box's loopback, a test double of an
OpenAI-compatible engine (tests/gateway/fake_openai_upstream.py) that only accepts the engine key.
Clients use the official ``openai`` SDK over TLS, trusting the internal CA root the role fetched.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import socket
import ssl
import time
import urllib.parse
import uuid

import httpx2 as httpx  # the HTTP library openai 3.x is built on (its http_client type)
import openai
import pytest
from conftest import SCENARIO, access_log_entry, run_converge


def client(base_url: str, ca_file: str, key: str) -> openai.OpenAI:
    """An OpenAI SDK client for one user; no retries so 429/503 reach the test."""
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0,
                         http_client=httpx.Client(verify=ca_file, timeout=30))


def raw(base_url: str, ca_file: str, path: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(base_url.removesuffix("/v1") + path, headers=headers, verify=ca_file, timeout=10)


def assert_openai_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and "type" in error and "param" in error


def engine_stats(host) -> dict:
    return json.loads(host.check_output("python3 -c \"import urllib.request;"
                                        "print(urllib.request.urlopen('http://127.0.0.1:8000/fixture/stats').read().decode())\""))


def test_service_hardened(host):
    unit = host.run("systemctl show caddy -p User -p NoNewPrivileges -p ProtectSystem -p CapabilityBoundingSet "
                    "-p ActiveState").stdout
    assert "User=caddy" in unit and "NoNewPrivileges=yes" in unit and "ProtectSystem=strict" in unit
    assert "CapabilityBoundingSet=cap_net_bind_service\n" in unit and "ActiveState=active" in unit
    assert "http.handlers.rate_limit" in host.check_output("/usr/local/bin/caddy list-modules")


def test_keys_readable_by_root_and_caddy_only(host):
    for path in ("/etc/caddy/Caddyfile", "/etc/caddy/Caddyfile.last-good"):
        f = host.file(path)
        assert (f.user, f.group, f.mode) == ("root", "caddy", 0o640), path
    assert host.run("runuser -u nobody -- cat /etc/caddy/Caddyfile").rc != 0
    # Caddy writes every config it loads to $XDG_CONFIG_HOME/caddy/autosave.json unless told not to.
    assert "persist_config off" in host.file("/etc/caddy/Caddyfile").content_string
    assert host.check_output("find /var/lib/caddy -name autosave.json") == ""


def test_caddyfile_holds_key_hashes_not_keys(host, keys):
    """Users are matched by their key's SHA-256: neither the live Caddyfile nor the last good copy holds a
    user's key, so reading them gives nobody access."""
    live = host.file("/etc/caddy/Caddyfile").content_string
    last_good = host.file("/etc/caddy/Caddyfile.last-good").content_string
    for name, key in keys.items():
        assert key not in live and key not in last_good, f"{name}'s key is written in the Caddyfile"
        assert f"\t\t{hashlib.sha256(key.encode()).hexdigest()} {name} " in live, name


def test_a_caddyfile_the_role_did_not_write_was_kept(host):
    """prepare.yml left an admin's Caddyfile; the role copied it aside once before writing its own."""
    kept = host.file("/etc/caddy/Caddyfile.before-teamserve")
    assert kept.exists and "An admin's own Caddyfile" in kept.content_string
    assert "# The teamserve gateway" in host.file("/etc/caddy/Caddyfile").content_string
    assert not host.file("/etc/systemd/system/caddy.service.before-teamserve").exists  # none was there


def test_admin_api_not_on_tcp(host):
    assert not host.socket("tcp://127.0.0.1:2019").is_listening
    sock = host.file("/run/caddy/admin.sock")
    assert sock.is_socket and sock.user == "caddy" and sock.mode == 0o600


@pytest.mark.parametrize("key", [None, "not-a-key-0123456789abcdefghijklmnop", "dave"])
def test_missing_or_unknown_key_gets_openai_401(base_url, ca_file, key):
    assert_openai_error(raw(base_url, ca_file, "/v1/models", key), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError) as err:
        client(base_url, ca_file, key or "x" * 40).models.list()
    assert err.value.code == "invalid_api_key"


def test_health_without_key(base_url, ca_file):
    assert raw(base_url, ca_file, "/health").status_code == 200


@pytest.mark.parametrize("path", ["/metrics", "/invocations", "/docs", "/openapi.json", "/v1/load_lora_adapter",
                                  "/reset_prefix_cache", "/v1/responses/resp_0123", "/V1/Load_Lora_Adapter"])
def test_engine_routes_outside_the_list_are_not_found(base_url, ca_file, keys, path):
    """Only the listed user endpoints are proxied: the engine's own routes get the gateway's 404 (GET here;
    the gateway answers before it looks at the method)."""
    assert_openai_error(raw(base_url, ca_file, path, keys["bob"]), 404, "not_found")


def test_engine_key_injected_user_key_never_reaches_engine(host, base_url, ca_file, keys, gateway_vars):
    # The double answers 401 unless it gets the engine's key; 200 here proves the gateway swapped keys.
    assert [m.id for m in client(base_url, ca_file, keys["bob"]).models.list()] == ["fixture"]
    seen = engine_stats(host)["authorization_sha256"]
    engine_key = gateway_vars["caddy_upstream_api_key"]
    assert hashlib.sha256(f"Bearer {engine_key}".encode()).hexdigest() in seen
    for key in list(keys.values()) + list(gateway_vars["caddy_user_keys"].values()):
        assert hashlib.sha256(f"Bearer {key}".encode()).hexdigest() not in seen


def test_stream_arrives_incrementally(base_url, ca_file, keys, gateway_vars):
    delay = float(gateway_vars["fixture_token_delay_s"])
    stream = client(base_url, ca_file, keys["bob"]).chat.completions.create(
        model="fixture", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=10)
    arrivals = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
    assert len(arrivals) == 10
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    # Buffered output would arrive in one burst at the end: most gaps ~0. Unbuffered: each ~delay.
    assert sorted(gaps)[len(gaps) // 2] > delay * 0.5, gaps
    assert arrivals[-1] - arrivals[0] > delay * 9 * 0.7


def test_a_connection_the_engine_closes_as_idle_never_costs_a_request(host, base_url, ca_file, keys):
    """vLLM's server closes a keep-alive connection idle for 5 s; a request the gateway wrote into it just
    then got 502 engine_unavailable (a POST is not retried). The test double closes the connection of a
    request marked X-Fixture-Idle-Close when the next request arrives on it, unanswered, as an engine whose
    idle timeout has run out. The gateway keeps an idle connection 2 s, so the next request, 3 s later,
    goes on a connection of its own and is answered (Caddy's default, 2 min, answers it 502)."""
    before = engine_stats(host)["closed_as_idle"]
    for mark, idle in (({"X-Fixture-Idle-Close": "1"}, 3), ({}, 0)):
        reply = httpx.post(base_url + "/chat/completions", verify=ca_file, timeout=30,
                           headers={"Authorization": f"Bearer {keys['bob']}", **mark},
                           json={"model": "fixture", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 200, reply.text
        time.sleep(idle)
    assert engine_stats(host)["closed_as_idle"] == before


def test_rate_limit_per_user(base_url, ca_file, keys):
    alice = client(base_url, ca_file, keys["alice"])
    statuses = []
    for _ in range(5):  # alice: 3 per minute
        try:
            alice.models.list()
            statuses.append(200)
        except openai.RateLimitError as err:
            statuses.append(429)
            assert err.code == "rate_limit_exceeded"
            retry_after = int(err.response.headers["retry-after"])
            assert 1 <= retry_after <= 60
    assert statuses.count(200) <= 3 and statuses.count(429) >= 2  # 3 per minute, also across re-runs
    # Another user is not affected by alice's exhaustion: neither bob (another limit, another zone) nor
    # grace, who has the same limit and so shares alice's zone, with a window of her own.
    assert client(base_url, ca_file, keys["bob"]).models.list().data[0].id == "fixture"
    assert client(base_url, ca_file, keys["grace"]).models.list().data[0].id == "fixture"
    assert_openai_error(raw(base_url, ca_file, "/v1/models", keys["alice"]), 429, "rate_limit_exceeded")


def test_caps_are_derived_from_the_plan(host, gateway_vars):
    """The gateway's caps come from vllm_plan (the inventory types none of them)."""
    flags = gateway_vars["vllm_plan"]["flags"]
    caddyfile = host.file("/etc/caddy/Caddyfile").content_string
    cap = flags["max-num-seqs"] + flags["max-num-queued-reqs"]
    assert f"unhealthy_request_count {cap}\n" in caddyfile
    assert f"max_size {flags['max-model-len'] * 32 + 1024 * 1024}\n" in caddyfile
    # One rate-limit zone per distinct limit (alice and grace share one), not one per user.
    assert caddyfile.count("zone rate_3_per_1m {") == 1 and caddyfile.count("zone rate_1000_per_1m {") == 1
    assert caddyfile.count("\t\t\tzone ") == 2


def test_each_user_sees_their_own_limits_and_the_gateways_state(base_url, ca_file, keys):
    """GET /v1/me answers the caller's own cap, rate limit, lane and key expiry - never anyone else's - and
    the gateway's state, with the Retry-After a drain tells everyone; it needs a key. Every proxied answer
    carries the caller's engine sequences in flight with it and their cap."""
    me = raw(base_url, ca_file, "/v1/me", keys["bob"])
    assert me.status_code == 200 and me.headers["content-type"].startswith("application/json"), me.text
    assert me.headers["cache-control"] == "no-store"
    mine = me.json()
    tokens = mine.pop("tokens")
    assert mine == {"object": "teamserve.me", "user": "bob", "lane": "interactive",
                    "max_in_flight_sequences": 8, "rate_limit": {"events": 1000, "window": "1m"},
                    "key_expires_at": 0, "gateway": {"state": "serving", "retry_after_seconds": None}}
    midnight = (int(time.time()) // 86400 + 1) * 86400  # the next 00:00 UTC
    assert tokens["per_day"] == 0 and tokens["used_today"] >= 0 and tokens["resets_at"] in (midnight, midnight + 86400)
    assert tokens["per_minute"] == 0 and tokens["used_last_minute"] >= 0
    assert raw(base_url, ca_file, "/v1/me", keys["grace"]).json()["rate_limit"] == {"events": 3, "window": "1m"}
    assert_openai_error(raw(base_url, ca_file, "/v1/me"), 401, "invalid_api_key")
    answer = httpx.post(base_url + "/chat/completions", verify=ca_file, timeout=30,
                        headers={"Authorization": f"Bearer {keys['bob']}"},
                        json={"model": "fixture", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert answer.status_code == 200, answer.text
    assert (answer.headers["x-teamserve-in-flight"], answer.headers["x-teamserve-in-flight-limit"]) == ("1", "8")
    state = run_converge({"caddy_state": "draining", "caddy_maintenance_retry_after": 42},
                         playbook=SCENARIO / "state.yml")
    try:
        assert state.returncode == 0, state.stdout[-3000:]
        assert raw(base_url, ca_file, "/v1/me", keys["bob"]).json()["gateway"] == {
            "state": "draining", "retry_after_seconds": 42}
    finally:
        run_converge({"caddy_state": "serving"}, playbook=SCENARIO / "state.yml")
    assert raw(base_url, ca_file, "/v1/me", keys["bob"]).json()["gateway"]["state"] == "serving"


def chat_as(base_url: str, ca_file: str, key: str, max_tokens: int, request_id: str = "", **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **({"X-Request-Id": request_id} if request_id else {})}
    return httpx.post(base_url + "/chat/completions", verify=ca_file, timeout=30, headers=headers,
                      json={"model": "fixture", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "Hi"}],
                            **extra})


def test_a_user_past_their_daily_token_budget_is_refused_until_midnight_utc(host, base_url, ca_file, keys):
    """hana's budget is 30 tokens a day. Each answer tells her her tokens today (the engine's usage, a
    stream's included: the gateway asks the engine for it and keeps the usage chunk from her); at 33 she
    gets 429 token_budget_exceeded naming the budget and the reset, with Retry-After until 00:00 UTC, while
    bob is served; /v1/me shows it; the ledger file holds it."""
    first = chat_as(base_url, ca_file, keys["hana"], 10)  # 1 prompt + 10 completion tokens
    assert first.status_code == 200 and first.headers["x-teamserve-tokens-per-day"] == "30", first.text
    before = int(first.headers["x-teamserve-tokens-today"])
    stream = chat_as(base_url, ca_file, keys["hana"], 10, stream=True)
    assert stream.status_code == 200 and int(stream.headers["x-teamserve-tokens-today"]) == before + 11
    events = [line for line in stream.text.splitlines() if line.startswith("data: {")]
    assert len(events) == 10 and '"usage"' not in stream.text, stream.text  # no usage chunk he did not ask for
    asked = chat_as(base_url, ca_file, keys["hana"], 10, stream=True, stream_options={"include_usage": True})
    assert '"choices": [], "usage"' in asked.text and int(asked.headers["x-teamserve-tokens-today"]) == before + 22
    refused_id = str(uuid.uuid4())
    refused = chat_as(base_url, ca_file, keys["hana"], 1, refused_id)
    assert_openai_error(refused, 429, "token_budget_exceeded")
    message = refused.json()["error"]["message"]
    assert f"used {before + 33} of its 30 tokens" in message and "T00:00:00Z" in message, message
    midnight = (int(time.time()) // 86400 + 1) * 86400
    assert 0 < int(refused.headers["retry-after"]) <= midnight - int(time.time()) + 2
    assert chat_as(base_url, ca_file, keys["bob"], 1).status_code == 200  # others are served
    me = raw(base_url, ca_file, "/v1/me", keys["hana"]).json()["tokens"]
    assert {k: me[k] for k in ("per_day", "used_today", "resets_at")} == {"per_day": 30, "used_today": before + 33,
                                                                         "resets_at": midnight}
    entry = access_log_entry(host, refused_id)
    assert (entry["user"], entry["status"], entry["refused"]) == ("hana", 429, "token_budget_exceeded")
    # The day's counts are kept for a restart (tests/test_users.py restarts the gateway last and asks again).
    deadline = time.monotonic() + 10  # written within a second of a change
    while json.loads(host.file("/var/lib/caddy/teamserve-tokens.json").content_string or "{}").get(
            "tokens", {}).get("hana") != before + 33:
        assert time.monotonic() < deadline, host.file("/var/lib/caddy/teamserve-tokens.json").content_string
        time.sleep(0.5)
    assert host.file("/var/lib/caddy/teamserve-tokens.json").mode == 0o600


def test_a_user_past_their_per_minute_token_budget_waits_for_the_minute_to_slide(host, base_url, ca_file, keys):
    """ines may use 25 tokens in any 60 s. Her answers say how many her last minute used; once two answers
    of 13 tokens (26) are in it she gets 429 tokens_per_minute_exceeded naming both figures, with
    Retry-After no longer than the minute, while bob is served; /v1/me shows the same figures."""
    first = chat_as(base_url, ca_file, keys["ines"], 12)  # 1 prompt + 12 completion tokens
    assert first.status_code == 200 and first.headers["x-teamserve-tokens-per-minute"] == "25", first.text
    assert first.headers["x-teamserve-tokens-last-minute"] == "0"
    second = chat_as(base_url, ca_file, keys["ines"], 12)
    assert second.status_code == 200 and second.headers["x-teamserve-tokens-last-minute"] == "13", second.text
    refused_id = str(uuid.uuid4())
    refused = chat_as(base_url, ca_file, keys["ines"], 1, refused_id)
    assert_openai_error(refused, 429, "tokens_per_minute_exceeded")
    message = refused.json()["error"]["message"]
    assert "used 26 tokens in the last minute" in message and "25 tokens per minute" in message, message
    assert 0 < int(refused.headers["retry-after"]) <= 60
    assert chat_as(base_url, ca_file, keys["bob"], 1).status_code == 200  # others are served
    me = raw(base_url, ca_file, "/v1/me", keys["ines"]).json()["tokens"]
    assert (me["per_minute"], me["used_last_minute"], me["per_day"]) == (25, 26, 0), me
    entry = access_log_entry(host, refused_id)
    assert (entry["user"], entry["status"], entry["refused"]) == ("ines", 429, "tokens_per_minute_exceeded")


def test_server_full_gets_503_with_retry_after(base_url, ca_file, keys, gateway_vars):
    flags = gateway_vars["vllm_plan"]["flags"]
    cap = flags["max-num-seqs"] + flags["max-num-queued-reqs"]  # derived: the batch + the engine's queue
    caps = {u["name"]: u["max_inflight"] for u in gateway_vars["caddy_users"] if "max_inflight" in u}
    holders = ["bob"] * caps["bob"] + ["erin"] * caps["erin"]  # each user within their own cap
    assert len(holders) == cap

    def long_stream(name: str) -> int:
        stream = client(base_url, ca_file, keys[name]).chat.completions.create(
            model="fixture", messages=[], stream=True, max_tokens=25)
        return sum(1 for _ in stream)

    with concurrent.futures.ThreadPoolExecutor(cap) as pool:
        running = [pool.submit(long_stream, name) for name in holders]
        time.sleep(1.5)
        response = httpx.post(f"{base_url}/chat/completions", verify=ca_file, timeout=10,
                              headers={"Authorization": f"Bearer {keys['dave']}"},
                              json={"model": "fixture", "messages": [], "max_tokens": 1})
        assert_openai_error(response, 503, "server_full")
        assert response.headers["retry-after"] == str(gateway_vars["caddy_server_full_retry_after"])
        assert [f.result(timeout=30) for f in running] == [25] * cap  # every stream ran to the end


def test_flood_from_one_user_is_capped_and_others_are_not_refused(base_url, ca_file, keys, gateway_vars):
    """dave starts 10x his in-flight cap of long streams while bob and erin stream: dave gets the
    concurrency 429 beyond his cap (derived: max(1, max-num-seqs // 4)); bob and erin are never refused."""
    per_user = max(1, gateway_vars["vllm_plan"]["flags"]["max-num-seqs"] // 4)
    flood = 10 * per_user
    tokens = 40  # 8 s per stream at the double's 0.2 s per token: every flood request starts while the first run

    def stream(name: str) -> tuple[str, int | str]:
        try:
            chunks = client(base_url, ca_file, keys[name]).chat.completions.create(
                model="fixture", messages=[], stream=True, max_tokens=tokens)
            return name, sum(1 for _ in chunks)
        except openai.RateLimitError as err:
            assert err.response.headers["retry-after"] == "1"
            return name, str(err.code)

    with concurrent.futures.ThreadPoolExecutor(flood + 4) as pool:
        others = [pool.submit(stream, name) for name in ("bob", "erin", "bob", "erin")]
        time.sleep(0.5)
        flooder = []
        for _ in range(flood):  # bounded: 10x the cap, no retries
            flooder.append(pool.submit(stream, "dave"))
            time.sleep(0.05)
        dave = [f.result(timeout=60)[1] for f in flooder]
        rest = [f.result(timeout=60) for f in others]
    assert dave.count(tokens) == per_user, dave
    assert dave.count("concurrency_limit_exceeded") == flood - per_user, dave
    assert rest == [("bob", tokens), ("erin", tokens)] * 2, rest


def test_concurrency_429_body(base_url, ca_file, keys, gateway_vars):
    """The per-user cap's refusal is an OpenAI error with its own code and a Retry-After."""
    per_user = max(1, gateway_vars["vllm_plan"]["flags"]["max-num-seqs"] // 4)
    url = f"{base_url}/chat/completions"
    body = {"model": "fixture", "messages": [], "stream": True, "max_tokens": 20}
    headers = {"Authorization": f"Bearer {keys['dave']}"}
    with httpx.Client(verify=ca_file, timeout=30) as http:
        streams = [http.stream("POST", url, json=body, headers=headers) for _ in range(per_user)]
        opened = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in opened] == [200] * per_user
            refused = httpx.post(url, verify=ca_file, timeout=10, headers=headers, json=body)
            assert_openai_error(refused, 429, "concurrency_limit_exceeded")
            assert refused.headers["retry-after"] == "1" and refused.json()["error"]["type"] == "requests"
        finally:
            for s in streams:
                s.__exit__(None, None, None)  # hang up: the slots are released
    for _ in range(20):  # the gateway notices the hang-ups within moments
        ok = httpx.post(url, verify=ca_file, timeout=30, headers=headers,
                        json={"model": "fixture", "messages": [], "max_tokens": 1})
        if ok.status_code == 200:
            break
        time.sleep(0.25)
    assert ok.status_code == 200


def test_body_over_the_limit_gets_openai_413(base_url, ca_file, keys, gateway_vars):
    limit = gateway_vars["vllm_plan"]["flags"]["max-model-len"] * 32 + 1024 * 1024
    headers = {"Authorization": f"Bearer {keys['bob']}", "Content-Type": "application/json"}
    over = b'{"model":"fixture","max_tokens":1,"messages":[{"role":"user","content":"' + b"a" * limit + b'"}]}'
    response = httpx.post(f"{base_url}/chat/completions", verify=ca_file, timeout=30, headers=headers, content=over)
    assert_openai_error(response, 413, "request_too_large")
    under = b'{"model":"fixture","max_tokens":1,"messages":[{"role":"user","content":"' + b"a" * (limit // 2) + b'"}]}'
    response = httpx.post(f"{base_url}/chat/completions", verify=ca_file, timeout=30, headers=headers, content=under)
    assert response.status_code == 200


def test_engine_queue_full_becomes_server_full_with_retry_after(base_url, ca_file, keys, gateway_vars):
    """The engine's own 503 (its queue is at --max-num-queued-reqs) has no Retry-After; the gateway answers
    it as its own server_full, so clients get one shape and a wait time either way."""
    with pytest.raises(openai.InternalServerError) as err:
        client(base_url, ca_file, keys["bob"]).chat.completions.create(
            model="fixture-busy", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert err.value.status_code == 503 and err.value.code == "server_full"
    assert err.value.response.headers["retry-after"] == str(gateway_vars["caddy_server_full_retry_after"])


def test_client_disconnect_stops_generation_and_is_logged_with_the_user(host, base_url, ca_file, keys):
    before = engine_stats(host)["streams_aborted"]
    request_id = str(uuid.uuid4())
    with httpx.Client(verify=ca_file, timeout=10) as http, http.stream("POST", f"{base_url}/chat/completions",
                     headers={"Authorization": f"Bearer {keys['bob']}", "X-Request-Id": request_id},
                     json={"model": "fixture", "messages": [], "stream": True, "max_tokens": 200}) as r:
        next(r.iter_lines())
    for _ in range(20):
        if engine_stats(host)["streams_aborted"] > before:
            break
        time.sleep(0.5)
    assert engine_stats(host)["streams_aborted"] > before
    # Per-user accounting from the access log counts the stream the client hung up on.
    assert access_log_entry(host, request_id)["user"] == "bob"


def test_access_log_has_users_and_no_keys(host, base_url, ca_file, keys, gateway_vars):
    for name in ("alice", "bob", "dave"):  # alice may be over her limit: a 429 is logged with her name too
        raw(base_url, ca_file, "/v1/models", keys[name])
    # Keys sent the way other SDKs send them (Anthropic's x-api-key, Azure's api-key) or in a cookie.
    # The gateway authenticates only the bearer key, but these headers must not reach the log either.
    for header in ("x-api-key", "api-key", "cookie", "x-auth-token"):
        httpx.get(base_url + "/models", verify=ca_file, timeout=10,
                  headers={"Authorization": f"Bearer {keys['bob']}", header: keys["erin"]})
    # ... or in the query string: the log keeps the path only.
    httpx.get(base_url + "/models", verify=ca_file, timeout=10, params={"api_key": keys["erin"]},
              headers={"Authorization": f"Bearer {keys['bob']}"})
    log = host.file("/var/log/caddy/access.log")
    assert log.user == "caddy" and log.mode == 0o640
    lines = [json.loads(line) for line in log.content_string.splitlines() if line.strip()]
    users = {entry.get("user") for entry in lines}
    assert {"alice", "bob", "dave"} <= users
    for entry in lines:
        # Of the request's headers only the allowlisted ones are kept, as fields of their own.
        assert "headers" not in entry["request"] and "?" not in entry["request"]["uri"], entry["request"]
        assert {"status", "size", "duration"} <= entry.keys()
    text = log.content_string + host.check_output("journalctl -u caddy --no-pager -o cat")
    secrets = list(keys.values()) + list(gateway_vars["caddy_user_keys"].values())
    for secret in secrets + [gateway_vars["caddy_upstream_api_key"]]:
        assert secret not in text


def test_stream_survives_a_graceful_reload(host, base_url, ca_file, keys):
    """A config reload (what every key change does) must not cut a generation in progress."""
    pid = host.check_output("systemctl show caddy -p MainPID --value")
    stream = client(base_url, ca_file, keys["bob"]).chat.completions.create(
        model="fixture", messages=[], stream=True, max_tokens=15)
    chunks = iter(stream)
    next(chunks)
    assert host.run("systemctl reload caddy").rc == 0
    assert 1 + sum(1 for _ in chunks) == 15
    assert host.check_output("systemctl show caddy -p MainPID --value") == pid


def test_a_body_sent_slower_than_the_read_timeout_frees_its_slot(host, base_url, ca_file, keys):
    """caddy_read_body_timeout (3 s here): a client trickling its body cannot hold a slot. The gateway's
    handler gives up at the timeout (its access-log line, written when the handler returns, appears while
    the client is still sending), and the same user is served right after."""
    url = urllib.parse.urlsplit(base_url)
    request_id = str(uuid.uuid4())
    body = json.dumps({"model": "fixture", "messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 2}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {url.hostname}\r\nAuthorization: Bearer {keys['bob']}\r\n"
            f"X-Request-Id: {request_id}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    context = ssl.create_default_context(cafile=ca_file)
    entry: dict = {}
    with socket.create_connection((url.hostname, url.port), timeout=10) as plain, \
            context.wrap_socket(plain, server_hostname=url.hostname) as tls:
        tls.sendall(head.encode())
        started, sent = time.monotonic(), 0
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            logged = pool.submit(access_log_entry, host, request_id, 20)  # bounded: 20 s
            while sent < len(body) and not logged.done() and time.monotonic() - started < 30:
                try:
                    tls.sendall(body[sent:sent + 4])
                except OSError:
                    break
                sent += 4
                time.sleep(0.5)
            entry = logged.result()
    assert sent < len(body), "the whole body was sent before the gateway gave up on it"
    assert entry["duration"] < 3 + 2, entry["duration"]  # seconds, from the request's start
    # The client's delay, said as such: not the engine's 502.
    assert (entry["status"], entry.get("refused"), entry.get("user")) == (408, "request_timeout", "bob"), entry
    reply = client(base_url, ca_file, keys["bob"]).chat.completions.create(model="fixture", messages=[], max_tokens=2)
    assert reply.choices[0].message.content


def tls_connection(base_url: str, ca_file: str) -> ssl.SSLSocket:
    """A raw TLS connection to the gateway (10 s socket timeout), for requests no HTTP client sends."""
    url = urllib.parse.urlsplit(base_url)
    plain = socket.create_connection((url.hostname, url.port), timeout=10)
    return ssl.create_default_context(cafile=ca_file).wrap_socket(plain, server_hostname=url.hostname)


def test_a_body_cut_short_is_the_clients_400_not_the_engines_502(host, base_url, ca_file, keys):
    """A client whose connection ends before the bytes its Content-Length announced: the gateway's own
    400 request_body_incomplete with the user in the log; the engine is not blamed and bob's slot is free."""
    request_id = str(uuid.uuid4())
    body = json.dumps({"model": "fixture", "messages": [{"role": "user", "content": "x" * 400}]}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {urllib.parse.urlsplit(base_url).hostname}\r\n"
            f"Authorization: Bearer {keys['bob']}\r\nX-Request-Id: {request_id}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    answer = b""
    with tls_connection(base_url, ca_file) as tls:
        tls.sendall(head.encode() + body[:len(body) // 2])
        # End the sending side only (TCP FIN; ssl's own shutdown() would drop the TLS session) and read.
        socket.socket.shutdown(tls, socket.SHUT_WR)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (chunk := tls.recv(65536)):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 400 "), answer[:500]
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_body_incomplete"
    entry = access_log_entry(host, request_id, 20)
    assert (entry["status"], entry.get("refused"), entry.get("user")) == (400, "request_body_incomplete", "bob"), entry
    reply = client(base_url, ca_file, keys["bob"]).chat.completions.create(model="fixture", messages=[], max_tokens=2)
    assert reply.choices[0].message.content


def test_a_client_gone_before_the_answer_is_logged_as_such(host, base_url, ca_file, keys):
    """A client that hangs up while the engine is still generating a non-streamed answer (here 5 s): the
    access log's status is 499 (client closed request; reverse_proxy writes it), not a 502, with no
    refusal, and bob's slot is freed."""
    request_id = str(uuid.uuid4())
    body = json.dumps({"model": "fixture-wait", "messages": [], "max_tokens": 25}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {urllib.parse.urlsplit(base_url).hostname}\r\n"
            f"Authorization: Bearer {keys['bob']}\r\nX-Request-Id: {request_id}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    with tls_connection(base_url, ca_file) as tls:
        tls.sendall(head.encode() + body)
        time.sleep(1)
    entry = access_log_entry(host, request_id, 20)
    assert (entry["status"], entry.get("refused"), entry.get("user")) == (499, None, "bob"), entry
    assert entry["duration"] < 4, entry["duration"]  # seconds: ended when the client left, not with the answer
    reply = client(base_url, ca_file, keys["bob"]).chat.completions.create(model="fixture", messages=[], max_tokens=2)
    assert reply.choices[0].message.content


def test_a_stream_longer_than_the_read_timeouts_is_not_cut(base_url, ca_file, keys):
    """25 tokens at 0.2 s each: about 5 s, longer than the 3 s body timeout; no write timeout cuts it."""
    started = time.monotonic()
    chunks = client(base_url, ca_file, keys["erin"]).chat.completions.create(
        model="fixture", messages=[], stream=True, max_tokens=25)
    tokens = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    assert tokens == 25 and time.monotonic() - started > 4

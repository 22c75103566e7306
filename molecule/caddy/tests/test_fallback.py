"""caddy_overload_policy: fallback, on the running gateway: while the engine is down, while the gateway is
full and while it drains, a secondary OpenAI-compatible upstream (a second test double on the box's
loopback, standing in for a hosted endpoint) answers instead of a 502/503, with its own key and within the
user's in-flight cap; its answers name its own model and the access log marks them. The module switches
the gateway to the fallback policy with the caddy role (as an admin would, in the inventory) and puts the
Caddyfile it had back at the end, byte for byte."""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import time
import uuid

import httpx2 as httpx  # the HTTP library openai 3.x is built on
import pytest
from conftest import SCENARIO, VARS, access_log_entry, run_converge
from test_gateway import client, engine_stats

DEAD_UPSTREAM = "127.0.0.1:8009"  # nothing listens there on the box
FALLBACK = {"caddy_overload_policy": "fallback", "caddy_fallback_url": f"http://{VARS['fixture_fallback_listen']}/v1",
            "caddy_fallback_api_key": VARS["fixture_fallback_api_key"]}


def converge(keys: dict, extra: dict) -> None:
    """The caddy role on the box with the scenario's inventory, the keys in force now (side_effect.yml
    rotated, revoked and issued some) and `extra` over it."""
    users = {"caddy_user_keys": {name: key for name, key in keys.items() if name in {u["name"] for u in VARS["caddy_users"]}}}
    run = run_converge(dict(users, **extra))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert VARS["fixture_fallback_api_key"] not in run.stdout + run.stderr


def fallback_stats(host) -> dict:
    return json.loads(host.check_output(
        "python3 -c \"import urllib.request;print(urllib.request.urlopen("
        f"'http://{VARS['fixture_fallback_listen']}/fixture/stats').read().decode())\""))


def ask(base_url: str, ca_file: str, key: str, request_id: str = "") -> str:
    """A streamed chat completion (sent with X-Request-Id: request_id when given); returns the model named
    in its chunks."""
    headers = {"X-Request-Id": request_id} if request_id else None
    stream = client(base_url, ca_file, key).chat.completions.create(
        model="fixture", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=3,
        extra_headers=headers)
    return {chunk.model for chunk in stream}.pop()


def asked(host, base_url: str, ca_file: str, key: str) -> tuple[str, dict]:
    """ask(), and the access log's entry for that request."""
    request_id = str(uuid.uuid4())
    model = ask(base_url, ca_file, key, request_id)
    return model, access_log_entry(host, request_id)


@pytest.fixture(scope="module")
def fallback_gateway(host, keys):
    """The gateway under the fallback policy; afterwards the Caddyfile it had (with frank, whom
    side_effect.yml added and the inventory does not list) is put back and reloaded."""
    before = host.check_output("sha256sum /etc/caddy/Caddyfile")
    host.check_output("cp -p /etc/caddy/Caddyfile /root/Caddyfile.before-fallback")
    converge(keys, FALLBACK)
    yield
    host.check_output("cp -p /root/Caddyfile.before-fallback /etc/caddy/Caddyfile && systemctl reload caddy")
    assert host.check_output("sha256sum /etc/caddy/Caddyfile") == before


def test_engine_up_answers_itself(fallback_gateway, host, base_url, ca_file, keys):
    model, entry = asked(host, base_url, ca_file, keys["bob"])
    assert model == "fixture"
    assert entry["user"] == "bob" and "upstream" not in entry


def test_gateway_full_the_fallback_answers(fallback_gateway, host, base_url, ca_file, keys):
    flags = VARS["vllm_plan"]["flags"]
    cap = flags["max-num-seqs"] + flags["max-num-queued-reqs"]
    caps = {u["name"]: u["max_inflight"] for u in VARS["caddy_users"] if "max_inflight" in u}
    holders = ["bob"] * caps["bob"] + ["erin"] * caps["erin"]
    assert len(holders) == cap

    def long_stream(name: str) -> str:
        stream = client(base_url, ca_file, keys[name]).chat.completions.create(
            model="fixture", messages=[], stream=True, max_tokens=100)  # 20 s at the double's 0.2 s a token
        return {chunk.model for chunk in stream}.pop()

    with concurrent.futures.ThreadPoolExecutor(cap) as pool:
        running = [pool.submit(long_stream, name) for name in holders]
        deadline = time.monotonic() + 15  # bounded: until the engine double holds every stream
        while engine_stats(host)["in_flight"] < cap and time.monotonic() < deadline:
            time.sleep(0.3)
        assert engine_stats(host)["in_flight"] == cap
        assert ask(base_url, ca_file, keys["dave"]) == VARS["fixture_fallback_model"]
        assert [f.result(timeout=60) for f in running] == ["fixture"] * cap


def test_engine_down_the_fallback_answers_with_its_own_key(fallback_gateway, host, base_url, ca_file, keys):
    """The engine not answering (the gateway pointed at a port nothing listens on; stopping the engine
    double would change the PID tests/test_users.py checks)."""
    converge(keys, dict(FALLBACK, caddy_upstream=DEAD_UPSTREAM))
    model, entry = asked(host, base_url, ca_file, keys["bob"])
    assert model == VARS["fixture_fallback_model"]
    assert entry["user"] == "bob" and entry["upstream"] == "fallback"
    seen = fallback_stats(host)["authorization_sha256"]
    assert hashlib.sha256(f"Bearer {VARS['fixture_fallback_api_key']}".encode()).hexdigest() in seen
    assert hashlib.sha256(f"Bearer {keys['bob']}".encode()).hexdigest() not in seen  # the user's key stays
    # /health still tells a balancer that this box's engine is down.
    assert httpx.get(base_url.removesuffix("/v1") + "/health", verify=ca_file, timeout=10).status_code == 502


def test_fallback_keeps_the_user_in_flight_cap(fallback_gateway, base_url, ca_file, keys):
    """With the engine still not answering, erin (cap 4) gets the concurrency 429 beyond her cap on the
    fallback too."""
    erin_cap = next(u["max_inflight"] for u in VARS["caddy_users"] if u["name"] == "erin")

    def stream() -> str:
        with httpx.Client(verify=ca_file, timeout=30) as http, http.stream(
                "POST", f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {keys['erin']}"},
                json={"model": "fixture", "messages": [], "stream": True, "max_tokens": 25}) as response:
            if response.status_code != 200:
                response.read()
                return response.json()["error"]["code"]
            return "200" if sum(1 for _ in response.iter_lines()) else "empty"

    with concurrent.futures.ThreadPoolExecutor(erin_cap + 2) as pool:
        results = sorted(pool.map(lambda _: stream(), range(erin_cap + 2)))
    assert results == ["200"] * erin_cap + ["concurrency_limit_exceeded"] * 2, results


def set_state(state: str) -> None:
    """The caddy role's `state` entry point, as the drain runs it."""
    run = run_converge({"caddy_state": state, "caddy_maintenance_retry_after": 42}, playbook=SCENARIO / "state.yml")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]


def test_draining_the_fallback_answers(fallback_gateway, host, base_url, ca_file, keys):
    """Maintenance is a flag file: the Caddyfile and Caddy's process stay as they are (no reload), the
    fallback answers API requests and /health says 503 with the Retry-After written into the file; back to
    serving, the engine answers again."""
    converge(keys, FALLBACK)  # the engine answering again (the tests above pointed the gateway elsewhere)
    caddyfile = host.check_output("sha256sum /etc/caddy/Caddyfile")
    caddy_pid = host.check_output("systemctl show -p MainPID --value caddy")
    health = base_url.removesuffix("/v1") + "/health"
    set_state("maintenance")
    try:
        model, entry = asked(host, base_url, ca_file, keys["bob"])
        assert model == VARS["fixture_fallback_model"]
        assert entry["user"] == "bob" and entry["upstream"] == "fallback"
        answer = httpx.get(health, verify=ca_file, timeout=10)
        assert (answer.status_code, answer.headers.get("retry-after")) == (503, "42")
    finally:
        set_state("serving")
    assert httpx.get(health, verify=ca_file, timeout=10).status_code == 200
    model, entry = asked(host, base_url, ca_file, keys["bob"])
    assert model == "fixture" and "upstream" not in entry
    assert host.check_output("sha256sum /etc/caddy/Caddyfile") == caddyfile
    assert host.check_output("systemctl show -p MainPID --value caddy") == caddy_pid

"""Several boxes behind one front gateway (playbooks/front.yml, converged by site.yml): the front
(teamserve-front) balances over teamserve-box (the REAL vLLM CPU engine, model `tiny`) and teamserve-box-b
(a test double of the engine behind the real caddy role, answering every request as model `fixture-b`; it
lists `tiny` and `fixture-b`). Which box answered is told by each box's access log (entries of the person the
front named, via teamserve-front, or of the front's own user on a box that lists no persons) and by the
answer's `model`.

Traffic goes only to the testbed's containers; every loop is bounded in count and time.
"""
from __future__ import annotations

import json
import re
import threading
import time

import httpx2 as httpx  # the HTTP client openai 3.x is built on
import openai
import pytest
import testinfra
import yaml
from conftest import CACHE, GATEWAY_CA, GROUP_VARS, engine_cmd, prometheus_query

testinfra_hosts = ["ansible://teamserve-front"]

FRONT = "https://10.231.0.30:8443"
FRONT_CA = str(CACHE / "front-caddy-root.crt")
BOX_A = testinfra.get_host("docker://teamserve-box")
BOX_B = testinfra.get_host("docker://teamserve-box-b")
FRONT_BOX = testinfra.get_host("docker://teamserve-front")
FRONT_VARS = yaml.safe_load((GROUP_VARS.parent / "teamserve_gateway" / "main.yml").read_text())
BOX_B_ENTRY = FRONT_VARS["teamserve_front_extra_upstreams"][0]


def from_front(line: str) -> bool:
    """An access-log line of a request the front sent: named for its person (via teamserve-front), or as the
    front itself on a box that lists no persons (teamserve-box-b)."""
    return '"via":"teamserve-front"' in line or '"user":"teamserve-front"' in line


def served(box) -> int:
    """Requests the front sent this box so far: its access log's entries from the front (from_front)."""
    out = box.check_output("cat /var/log/caddy/access.log")
    return sum(1 for line in out.splitlines() if from_front(line) and "/v1/chat/completions" in line)


def box_a_batch() -> int:
    """teamserve-box's --max-num-seqs as deployed (its plan's batch: the front's cap for it)."""
    cmd = engine_cmd(BOX_A)
    return int(cmd[cmd.index("--max-num-seqs") + 1])


def refused(box) -> int:
    """Requests of the front this box answered 503 so far (its access log, as served())."""
    out = box.check_output("cat /var/log/caddy/access.log")
    return sum(1 for line in out.splitlines() if from_front(line)
               and "/v1/chat/completions" in line and '"status":503' in line)


def front_in_flight() -> dict[str, int]:
    """The requests the front counts in flight per box address (host:port), as its capacity policy reads
    them: Caddy's admin API, /reverse_proxy/upstreams, on the front's admin socket."""
    out = FRONT_BOX.check_output(
        "curl -sS --max-time 5 --unix-socket /run/caddy/admin.sock http://localhost/reverse_proxy/upstreams")
    return {upstream["address"]: int(upstream["num_requests"]) for upstream in json.loads(out)}


def wait_until_the_front_is_idle(timeout: float = 15.0) -> float:
    """Wait until the front counts no request in flight on any box, polling every 0.1 s for at most
    `timeout` seconds. Returns the seconds waited; fails the test after `timeout`.

    A client that hangs up on a stream is still counted until the front has torn its request to the box
    down; a burst sent in that window is balanced against those streams (the capacity policy)."""
    start = time.monotonic()
    while (counts := front_in_flight()) and any(counts.values()):
        if time.monotonic() - start > timeout:
            pytest.fail(f"the front still counts requests in flight after {timeout} s: {counts}")
        time.sleep(0.1)
    return time.monotonic() - start


def ask(key: str, model: str = "tiny", max_tokens: int = 4, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """One chat request through the front, with `headers` added: (status, the answer's model or the error code)."""
    body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.Client(verify=FRONT_CA, timeout=60) as client:
        response = client.post(f"{FRONT}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}", **(headers or {})})
    data = response.json()
    return response.status_code, data.get("model") or (data.get("error") or {}).get("code", "?")


def test_the_front_has_the_firewall(host):
    """The front runs the firewall role: its table drops by default and opens only the gateway's port to
    the LAN and SSH to the admins (the LAN reaching the front: test_site.py)."""
    table = host.check_output("nft list table inet teamserve")
    assert "policy drop;" in table
    assert "ip saddr @gateway_v4 tcp dport 8443 accept" in table
    assert re.search(r"set gateway_v4 \{[^}]*elements = \{ 10\.231\.0\.0/24 \}", table), table
    assert host.service("nftables").is_enabled


def front_total(host, expr: str) -> float:
    return sum(float(r["value"][1]) for r in prometheus_query(host, expr))


def test_the_front_counts_the_teams_usage_and_watches_its_boxes(host, keys):
    """The front runs the monitoring role without an engine: a request through it is counted there for its
    user, with the tokens the engine counted; each box's health is the front's own checks, named by box;
    the box alert is loaded; and none of the monitoring ports answers from the LAN."""
    tokens = 'teamserve_gateway_tokens_total{user="alice",kind="completion"}'
    requests = 'teamserve_gateway_requests_total{user="alice",code="200"}'
    tokens_before, requests_before = front_total(host, tokens), front_total(host, requests)
    body = {"model": "fixture-b", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.Client(verify=FRONT_CA, timeout=60) as client:
        answer = client.post(f"{FRONT}/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {keys['alice']}"})
    assert answer.status_code == 200, answer.text[:300]
    completion = answer.json()["usage"]["completion_tokens"]
    assert completion > 0
    deadline = time.monotonic() + 60  # mtail reads the front's log, Prometheus scrapes it every 5 s
    while front_total(host, requests) < requests_before + 1 or front_total(host, tokens) < tokens_before + completion:
        assert time.monotonic() < deadline, f"the front's Prometheus holds {prometheus_query(host, requests)}, {prometheus_query(host, tokens)}"
        time.sleep(2)
    assert front_total(host, tokens) == tokens_before + completion
    up = {r["metric"]["job"]: r["value"][1] for r in prometheus_query(host, "up")}
    assert up == dict.fromkeys(("caddy", "node", "mtail", "prometheus", "alertmanager"), "1")  # no engine here
    deadline = time.monotonic() + 60
    while len(health := prometheus_query(host, "caddy_reverse_proxy_upstreams_healthy * on (upstream) group_left (box) "
                                          "max by (upstream, box) (teamserve_front_box_info)")) < 2:
        assert time.monotonic() < deadline, prometheus_query(host, "caddy_reverse_proxy_upstreams_healthy")
        time.sleep(2)
    assert {r["metric"]["box"]: r["value"][1] for r in health} == {"teamserve-box": "1", "teamserve-box-b": "1"}
    rules = json.loads(host.check_output("curl -sf http://127.0.0.1:9090/api/v1/rules"))["data"]["groups"]
    box_alert = [r for g in rules for r in g["rules"] if r["name"] == "TeamserveBoxUnhealthy"]
    assert box_alert and box_alert[0]["health"] == "ok", box_alert
    lan = testinfra.get_host("docker://teamserve-lan-client")
    for port in (9090, 9093, 9100, 3903):
        assert lan.run("curl -s --max-time 3 -o /dev/null http://10.231.0.30:%s/", str(port)).rc != 0, port


def test_models_lists_what_the_fleet_serves(keys):
    """Boxes serve different models: the front answers /v1/models with every one, from the boxes' plans."""
    client = openai.OpenAI(base_url=f"{FRONT}/v1", api_key=keys["alice"],
                           http_client=httpx.Client(verify=FRONT_CA, timeout=30))
    assert sorted(m.id for m in client.models.list()) == ["fixture-b", "tiny"]


def test_burst_is_spread_over_both_boxes(keys):
    """12 requests for `tiny`, 6 at a time: both boxes answer some, by their access logs and their answers."""
    before = served(BOX_A), served(BOX_B)
    results: list[tuple[int, str]] = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(2):
            outcome = ask(keys["alice"])
            with lock:
                results.append(outcome)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    after = served(BOX_A), served(BOX_B)
    print(f"burst of 12: teamserve-box {after[0] - before[0]}, teamserve-box-b {after[1] - before[1]}")
    assert [status for status, _ in results] == [200] * 12, results
    assert after[0] - before[0] > 0 and after[1] - before[1] > 0
    assert (after[0] - before[0]) + (after[1] - before[1]) == 12
    assert {model for _, model in results} == {"tiny", "fixture-b"}


def test_a_model_only_one_box_serves_goes_to_that_box(keys):
    """`fixture-b` is listed by teamserve-box-b only: the request's model field routes it there."""
    before = served(BOX_A), served(BOX_B)
    assert [ask(keys["alice"], "fixture-b") for _ in range(4)] == [(200, "fixture-b")] * 4
    assert (served(BOX_A) - before[0], served(BOX_B) - before[1]) == (0, 4)


def last_entry(box, request_id: str) -> dict:
    """The box's access-log entry of the request sent with X-Request-Id: request_id (the front passes the
    header on)."""
    out = box.check_output("cat /var/log/caddy/access.log")
    entries = [json.loads(line) for line in out.splitlines() if request_id in line]
    found = [e for e in entries if e.get("request_id") == request_id]
    assert found, f"no entry for {request_id} on the box"
    return found[-1]


def test_the_box_sees_the_person_not_the_front(keys):
    """A request through the front reaches the engine's box as its person: the box's log names bob (via
    teamserve-front), counted and prioritised as bob; a client's own X-Teamserve-Person, to the
    front or to the box directly, names nobody; and the client sees one set of X-Teamserve-* headers, the
    front's. teamserve-box-b lists no persons, so the requests go until one is answered by teamserve-box
    (model `tiny`), at most 8."""
    tag = f"person-{time.time_ns()}"
    with httpx.Client(verify=FRONT_CA, timeout=60) as client:
        for n in range(8):
            answer = client.post(f"{FRONT}/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
                headers={"Authorization": f"Bearer {keys['bob']}", "X-Teamserve-Person": "alice",
                         "X-Request-Id": f"{tag}-{n}"})
            assert answer.status_code == 200, answer.text[:300]
            if answer.json()["model"] == "tiny":
                break
        else:
            pytest.fail("8 requests for tiny through the front, none answered by teamserve-box")
    assert len(answer.headers.get_list("X-Teamserve-In-Flight")) == 1, answer.headers
    assert len(answer.headers.get_list("X-Teamserve-In-Flight-Limit")) == 1, answer.headers
    entry = last_entry(BOX_A, f"{tag}-{n}")
    # bob's own count and priority at the box (his cap, his fair share), not the front's
    assert (entry.get("user"), entry.get("via")) == ("bob", "teamserve-front") and "priority" in entry, entry
    # To the box directly (the testbed's controller may reach it), a client's header names nobody.
    with httpx.Client(verify=str(GATEWAY_CA), timeout=60) as client:
        answer = client.post("https://10.231.0.10:8443/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
            headers={"Authorization": f"Bearer {keys['bob']}", "X-Teamserve-Person": "alice",
                     "X-Request-Id": f"{tag}-direct"})
    assert answer.status_code == 200, answer.text[:300]
    entry = last_entry(BOX_A, f"{tag}-direct")
    assert (entry.get("user"), entry.get("via")) == ("bob", ""), entry


def burst(key: str, count: int, headers: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """`count` one-token requests for `tiny` sent at the same time, with `headers` added; their (status, model
    or error code)."""
    results: list[tuple[int, str]] = []
    lock = threading.Lock()

    def one() -> None:
        outcome = ask(key, max_tokens=1, headers=headers)
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_one_users_cap_holds_across_both_boxes(keys):
    """bob's in-flight cap at the front is a quarter of the fleet's capacity (the sum of the boxes'
    batches). With that many slow streams open on teamserve-box-b, his next request is refused with 429
    although teamserve-box is idle: the cap is his across the fleet, not per box. alice is still served."""
    cap = max(1, (box_a_batch() + BOX_B_ENTRY["max_inflight"]) // 4)
    assert cap <= BOX_B_ENTRY["max_inflight"]
    opened = threading.Semaphore(0)
    release = threading.Event()
    streams: list[str] = []

    def hold() -> None:
        # The test double sends a token every 0.1 s: 1,500 tokens outlast the test.
        body = {"model": "fixture-b", "stream": True, "max_tokens": 1500,
                "messages": [{"role": "user", "content": "Count."}]}
        try:
            with httpx.Client(verify=FRONT_CA, timeout=60) as client, client.stream(
                    "POST", f"{FRONT}/v1/chat/completions", json=body,
                    headers={"Authorization": f"Bearer {keys['bob']}"}) as response:
                streams.append(str(response.status_code))
                if response.status_code == 200:
                    opened.release()
                    release.wait(60)
        finally:
            opened.release()

    threads = [threading.Thread(target=hold) for _ in range(cap)]
    try:
        for thread in threads:
            thread.start()
            assert opened.acquire(timeout=30)
        assert streams == ["200"] * cap, streams
        refused = [ask(keys["bob"]) for _ in range(2)]
        others = ask(keys["alice"], max_tokens=1)
    finally:
        release.set()
        for thread in threads:
            thread.join(60)
        # The next test starts from an idle fleet: the front may still be tearing bob's streams down.
        settled = wait_until_the_front_is_idle()
    print(f"bob's cap {cap}: {cap} streams on teamserve-box-b, then {refused}; alice {others}; "
          f"the front counted none in flight {settled:.2f} s after his clients left")
    assert refused == [(429, "concurrency_limit_exceeded")] * 2
    assert others[0] == 200


def test_a_box_going_down_moves_its_traffic_to_the_other(keys):
    """Bursts of 6 at once reach both boxes. teamserve-box-b's engine stops: after the health window every
    request of every burst is answered by teamserve-box with 200; the seconds until then are printed. Then
    the engine starts again and teamserve-box-b is back in the pool."""
    wait_until_the_front_is_idle()  # both boxes have room: a burst of 6 reaches each
    assert "fixture-b" in {model for _, model in burst(keys["alice"], 6)}  # box-b takes part
    logged = len(BOX_B.check_output("cat /var/log/caddy/access.log").splitlines())
    BOX_B.check_output("systemctl stop fake-openai-upstream")
    start = time.monotonic()
    rounds: list[tuple[float, list[tuple[int, str]]]] = []
    try:
        for _ in range(15):  # at most 15 bursts, about 30 s
            rounds.append((time.monotonic() - start, burst(keys["alice"], 6)))
            if len(rounds) >= 3 and all(r == [(200, "tiny")] * 6 for _, r in rounds[-3:]):
                break
            time.sleep(1)
    finally:
        BOX_B.check_output("systemctl start fake-openai-upstream")
    failed = [(round(t, 1), outcome) for t, r in rounds for outcome in r if outcome[0] != 200]
    moved = failed[-1][0] if failed else 0.0
    print(f"box-b down: {len(failed)} of {6 * len(rounds)} answers failed, the last {moved} s after the stop: {failed}")
    assert len(rounds) >= 3 and all(r == [(200, "tiny")] * 6 for _, r in rounds[-3:]), rounds
    assert all(status in (502, 503) for _, (status, _) in failed), failed  # the gateway's errors, never a hang
    # Back: the active health check finds box-b again (caddy_upstream_health_interval, 2 s on the testbed).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ask(keys["alice"], "fixture-b")[0] == 200:
            break
        time.sleep(1)
    else:
        pytest.fail("teamserve-box-b did not come back into the front's pool within 30 s")
    # A 502 the client got is box-b's own: its access log says why, for the admin (the dial refused).
    entries = [json.loads(line) for line in BOX_B.check_output("cat /var/log/caddy/access.log").splitlines()[logged:]]
    reasons = [e.get("upstream_error") for e in entries if e["status"] == 502]
    assert len(reasons) >= sum(1 for _, (status, _) in failed if status == 502), (reasons, failed)
    assert all(reason and "connect" in reason for reason in reasons), reasons


def test_a_full_box_moves_traffic_without_being_ejected(keys):
    """Bursts of requests for `tiny` marked X-Fixture-Busy: teamserve-box-b's engine (the test double) answers
    those it gets with vLLM's queue-full 503, and the front sends each of them on to teamserve-box, so every
    client gets 200 from `tiny`. A box's 503 is about one request, not its health: teamserve-box-b stays in
    the pool: requests for the model only it serves, sent within caddy_upstream_fail_duration (10 s) of its
    refusals, reach it."""
    size = min(4, box_a_batch())  # teamserve-box takes every request of a burst: at most its batch
    assert size >= 2, "teamserve-box's batch is too small to share a burst"
    before = refused(BOX_B)
    rounds: list[list[tuple[int, str]]] = []
    for _ in range(5):  # at most 5 bursts: until teamserve-box-b has refused 2 requests
        rounds.append(burst(keys["alice"], size, headers={"X-Fixture-Busy": "1"}))
        last_refusals = time.monotonic()
        if refused(BOX_B) - before >= 2:
            break
    refusals = refused(BOX_B) - before
    print(f"bursts of {size} marked busy: {len(rounds)}, refused by teamserve-box-b and moved: {refusals}")
    assert all(r == [(200, "tiny")] * size for r in rounds), rounds
    assert refusals >= 1, "no marked request reached teamserve-box-b: nothing was moved"
    served_before = served(BOX_B)
    assert time.monotonic() - last_refusals < 5  # well within the 10 s an ejection would last
    # Only teamserve-box-b serves fixture-b: had its 503s taken it out of the pool, these would get 503.
    plain = [ask(keys["alice"], model="fixture-b", max_tokens=1) for _ in range(3)]
    print(f"then 3 requests for fixture-b: {plain}, teamserve-box-b served {served(BOX_B) - served_before}")
    assert plain == [(200, "fixture-b")] * 3, plain
    assert served(BOX_B) - served_before == 3

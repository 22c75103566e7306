"""A front gateway over several boxes (roles/caddy/filter_plugins/caddy_front.py and the Caddyfile
template): each box's in-flight cap comes from its plan, the fleet's capacity is their sum, a fleet with
different models per box routes by the request's `model`, and bad entries are refused by name."""
from __future__ import annotations

import hashlib
import hmac
import json
import pathlib
import re
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
sys.path.insert(0, str(pathlib.Path(__file__).parent))
from repo_modules import load  # noqa: E402
from test_caddy_limits import play, render  # noqa: E402

front = load("caddy_front", "roles/caddy/filter_plugins/caddy_front.py")

USERS = [{"name": "alice", "key": "a" * 40, "rate_limit": {"events": 60, "window": "1m"}}]
FLEET_KEY = "f" * 48


def box(n: int, seqs: int, models: list[str], length: int = 4096) -> dict:
    return {"name": f"gpu{n}", "url": f"https://10.0.0.{n}:8443", "max_inflight": seqs, "models": models,
            "max_model_len": length, "ca_cert": f"/tmp/gpu{n}-root.crt"}


def front_host(upstreams: list[dict], **extra) -> dict:
    return {"caddy_upstreams": upstreams, "caddy_users": USERS, "caddy_tls_mode": "off",
            "caddy_upstream_api_key": FLEET_KEY, **extra}


def proxies(caddyfile: str) -> list[str]:
    """The reverse_proxy blocks of the rendered file, in order."""
    return re.findall(r"\n\t\treverse_proxy [^\n]*\{.*?\n\t\t\}", caddyfile, flags=re.S)


def test_capacity_is_the_sum_of_the_boxes_caps():
    boxes = [box(1, 8, ["m"]), box(2, 16, ["m"]), box(3, 4, ["m"])]
    assert front.caddy_front_capacity(boxes) == 28
    assert front.caddy_front_capacity(boxes[:1]) == 8
    assert front.caddy_front_capacity([]) == 0
    assert front.caddy_front_max_model_len([box(1, 8, ["m"], 2048), box(2, 8, ["m"], 8192)]) == 8192


@pytest.mark.parametrize("count", [1, 2, 3])
def test_front_caddyfile_for_one_two_three_boxes(tmp_path, count):
    """Same model everywhere: one pool over every box, each with its own cap, health checks on /health,
    the fleet's key upstream, the user's own key never; the fleet's capacity sets the users' defaults."""
    caps = [8, 16, 4][:count]
    boxes = [box(n + 1, cap, ["llama"]) for n, cap in enumerate(caps)]
    caddyfile = render(tmp_path, {"front": front_host(boxes)})["front"]
    api = [p for p in proxies(caddyfile) if "@proxied" in p]
    assert len(api) == 1, caddyfile
    pool = api[0]
    assert pool.startswith("\n\t\treverse_proxy @proxied " + " ".join(b["url"] for b in boxes) + " {")
    assert re.findall(r"cap (\S+) (\d+)", pool) == [(f"10.0.0.{n + 1}:8443", str(c)) for n, c in enumerate(caps)]
    assert "lb_policy capacity {" in pool and "hash {teamserve_user}" not in pool
    assert "health_uri /health" in pool
    assert_box_refusals_retried(pool, count, caddyfile)
    assert "header_up Authorization {teamserve_box_auth}" in pool and FLEET_KEY not in caddyfile  # a key per box
    assert "unhealthy_request_count" not in pool  # the per-box caps replace the one-engine cap
    assert "request_model" not in caddyfile  # one pool: the body is not read
    assert "request_priority" not in caddyfile  # the boxes write priorities; the front has no engine
    assert "tls_trust_pool file " + " ".join(f"/etc/caddy/upstream-ca/10.0.0.{n + 1}_8443.crt"
                                             for n in range(count)) in pool
    # Users' default cap: a quarter of the fleet's batch.
    assert re.search(rf" alice 0 {max(1, sum(caps) // 4)} rate_60_per_1m interactive 0 0\n", caddyfile)
    # The public /health is the fleet's: any healthy box answers it, without any key and without the caps
    # (a busy fleet is not a down one), and it is not logged.
    health = caddyfile.split("handle @health {")[1].split("\n\t\t}\n")[0]
    assert "lb_policy round_robin" in health and "cap " not in health and "header_up -Authorization" in health
    assert "log_skip" in health and "health_uri /health" in health
    # A draining box's 503 or a down engine's 502 at /health: the next box answers (never ejected on 503).
    assert "unhealthy_status 502\n" in health and "request_buffers" not in health
    if count > 1:
        assert f"lb_retries {count - 1}\n" in health
        assert "expression `{rp.status_code} in [502, 503] && {rp.is_transport_error} != true`" in health
    else:
        assert "lb_retries" not in health


def assert_box_refusals_retried(pool: str, count: int, caddyfile: str) -> None:
    """Passive health ejects a box only for its 502 (and failed connections); its 503 and 429 send the request
    to another box of the pool, at most once each, with the body replayed from Caddy's own buffer, one byte
    over the body limit; a pool of one box is not retried and maps them to server_full as before."""
    assert "max_fails 1\n" in pool and "\t\t\tunhealthy_status 502\n" in pool
    assert "unhealthy_status 502 503" not in caddyfile
    body_limit = re.search(r"request_body \{\n\t\tmax_size (\d+)\n", caddyfile)
    assert body_limit
    limit = int(body_limit.group(1))
    if count > 1:
        assert f"\t\t\tlb_retries {count - 1}\n" in pool
        assert ("\t\t\tlb_retry_match {\n\t\t\t\texpression `{rp.status_code} in [429, 503] && "
                "{rp.is_transport_error} != true`\n\t\t\t}\n") in pool
        assert f"\t\t\trequest_buffers {limit + 1}\n" in pool
    else:
        assert "lb_retries" not in pool and "lb_retry_match" not in pool and "request_buffers" not in pool
    assert "@box_full status 503" in pool and "@box_busy status 429" in pool
    # A box's 429 that no box could take is the front's server_full, not the user's rate limit.
    errors_429 = caddyfile.split("handle_errors 429 {")[1].split("\n\t}\n")[0]
    assert "@box_busy vars {rp.status_code} 429" in errors_429
    busy = errors_429.split("handle @box_busy {")[1].split("\n\t\t}\n")[0]
    assert "Retry-After 5" in busy and "import openai_error 503 " in busy and busy.endswith("server_error server_full")


def test_a_front_with_a_fallback_keeps_box_refusals_off_it(tmp_path):
    """A box's 503 that no box took has had its body read: like the engine's own queue-full 503, it stays the
    front's server_full and never goes to the fallback."""
    boxes = [box(1, 8, ["m"]), box(2, 8, ["m"])]
    caddyfile = render(tmp_path, {"front": front_host(boxes, caddy_overload_policy="fallback",
                                                      caddy_fallback_url="https://api.example.com/v1",
                                                      caddy_fallback_api_key="k" * 20)})["front"]
    to_fallback = caddyfile.split("@to_fallback {")[1].split("\n\t\t}\n")[0]
    assert 'not expression `{err.message} == "engine queue full"`' in to_fallback
    assert "not expression `{rp.status_code} == 503`" in to_fallback


def test_user_hash_is_opt_in(tmp_path):
    caddyfile = render(tmp_path, {"front": front_host([box(1, 8, ["m"]), box(2, 8, ["m"])],
                                                      caddy_lb_policy="user_hash")})["front"]
    assert "hash {teamserve_user}" in caddyfile


def test_models_per_box_route_by_model(tmp_path):
    """Two boxes with llama, one with qwen: the body's model picks the pool, /v1/models lists both."""
    boxes = [box(1, 8, ["llama"]), box(2, 8, ["llama", "qwen"], 2048), box(3, 4, ["qwen"], 8192)]
    caddyfile = render(tmp_path, {"front": front_host(boxes)})["front"]
    # Reads no more than the request body limit: the largest max-model-len (8192) * 32 + 1 MiB.
    assert "request_model {teamserve_model} {\n\t\t\tmax_size 1310720\n" in caddyfile
    blocks = {m: re.search(rf'@{m} \{{\n\t\t\tpath [^\n]+\n\t\t\tvars {{teamserve_model}} "([^"]+)"', caddyfile)
              for m in ("model_0", "model_1")}
    assert blocks["model_0"].group(1) == "llama" and blocks["model_1"].group(1) == "qwen"
    pools = {p.split()[1]: p for p in proxies(caddyfile)}
    assert re.findall(r"cap (\S+) ", pools["@model_0"]) == ["10.0.0.1:8443", "10.0.0.2:8443"]
    assert re.findall(r"cap (\S+) ", pools["@model_1"]) == ["10.0.0.2:8443", "10.0.0.3:8443"]
    assert re.findall(r"cap (\S+) ", pools["@proxied"]) == ["10.0.0.1:8443", "10.0.0.2:8443", "10.0.0.3:8443"]
    # Each per-model pool retries within its own boxes.
    for name in ("@model_0", "@model_1", "@proxied"):
        assert_box_refusals_retried(pools[name], len(re.findall(r"cap (\S+) ", pools[name])), caddyfile)
    # Routed before the catch-all pool.
    assert caddyfile.index("reverse_proxy @model_1") < caddyfile.index("reverse_proxy @proxied")
    listing = json.loads(re.search(r"respond `(\{\"object\": \"list\"[^`]+)` 200", caddyfile).group(1))
    assert [(m["id"], m["max_model_len"]) for m in listing["data"]] == [("llama", 2048), ("qwen", 2048)]  # the smallest of its boxes


@pytest.mark.parametrize("entry,field", [
    ({"url": "http://10.0.0.1:8443"}, "url='http://10.0.0.1:8443'"),
    ({"url": "https://10.0.0.1"}, "url='https://10.0.0.1'"),
    ({"max_inflight": 0}, "max_inflight=0"),
    ({"max_inflight": "many"}, "max_inflight='many'"),
    ({"models": []}, "models=[]"),
    ({"models": ['a"b']}, "models="),
    ({"max_model_len": None}, "max_model_len=None"),
    ({"ca_cert": "relative.crt"}, "ca_cert='relative.crt'"),
    ({"weight": 2}, "unknown keys ['weight']"),
])
def test_bad_entries_are_named(entry, field):
    with pytest.raises(ValueError, match=re.escape(field)) as err:
        front.caddy_front_upstreams([box(1, 8, ["m"]), {**box(2, 8, ["m"]), **entry}])
    assert "caddy_upstreams[1] (gpu2)" in str(err.value)


def test_a_pool_mixing_own_cas_and_public_trust_is_refused():
    """One pool trusts one set of roots: a box without ca_cert beside boxes with their own CA is named."""
    with pytest.raises(ValueError, match=re.escape("['gpu2'] have none")):
        front.caddy_front_upstreams([box(1, 8, ["m"]), {**box(2, 8, ["m"]), "ca_cert": ""}])


def test_a_box_listed_twice_is_refused():
    with pytest.raises(ValueError, match="listed twice"):
        front.caddy_front_upstreams([box(1, 8, ["m"]), {**box(1, 8, ["m"]), "name": "again"}])


def test_the_engines_batch_and_the_fleets_are_two_names(tmp_path):
    """On a front, caddy_engine_max_num_seqs is 0 (no engine there) and the caps derive from
    caddy_capacity_seqs, the fleet's sum; on a box both are its engine's --max-num-seqs, and the front's key
    may fill that batch, not the fleet's."""
    plan = {"flags": {"max-num-seqs": 8, "max-num-queued-reqs": 4, "max-model-len": 2048}}
    hosts = {"front": front_host([box(1, 8, ["m"]), box(2, 20, ["m"])]),
             "gpu1": {"vllm_plan": plan, "caddy_users": USERS, "caddy_tls_mode": "off",
                      "caddy_front_user_key": FLEET_KEY}}
    rendered = render(tmp_path, hosts)
    facts = {name: json.loads((tmp_path / f"{name}.facts.json").read_text()) for name in hosts}
    assert facts["front"]["caddy_engine_max_num_seqs"] == 0 and facts["front"]["caddy_capacity_seqs"] == 28
    assert facts["front"]["caddy_admission"] == {"user_max_inflight": 7, "user_fair_share": 0,
                                                 "max_inflight": 28}
    assert facts["gpu1"]["caddy_engine_max_num_seqs"] == facts["gpu1"]["caddy_capacity_seqs"] == 8
    assert facts["gpu1"]["caddy_admission"]["max_inflight"] == 12  # its batch plus its queue
    assert re.search(r" alice 0 7 rate_60_per_1m interactive 0 0\n", rendered["front"])
    assert re.search(r" teamserve-front 0 8 rate_1000_per_1s interactive 0 0\n", rendered["gpu1"])


def test_each_box_gets_its_own_key_for_the_front():
    """HMAC-SHA256 (RFC 2104) of the box's name under the fleet's key: one per box, none equal to the fleet's key."""
    keys = {name: front.caddy_front_box_key(FLEET_KEY, name) for name in ("gpu1", "gpu2")}
    assert keys["gpu1"] == hmac.new(FLEET_KEY.encode(), b"teamserve-front:gpu1", hashlib.sha256).hexdigest()
    assert len(set(keys.values())) == 2 and FLEET_KEY not in keys.values()
    assert front.caddy_front_box_key("g" * 48, "gpu1") != keys["gpu1"]
    for bad_key, bad_name in (("", "gpu1"), (None, "gpu1"), (FLEET_KEY, ""), (FLEET_KEY, 3)):
        with pytest.raises(ValueError) as err:
            front.caddy_front_box_key(bad_key, bad_name)
        assert FLEET_KEY not in str(err.value)


def test_the_front_presents_each_box_its_own_key(tmp_path):
    """The front's Caddyfile maps each box (host:port) to the key derived from its name, and holds neither the
    fleet's key nor one key for two boxes; a fleet's key shorter than caddy_key_min_length is refused."""
    caddyfile = render(tmp_path, {"front": front_host([box(1, 8, ["m"]), box(2, 8, ["m"])])})["front"]
    mapped = dict(re.findall(r'^\t\t\t(\S+) "Bearer ([0-9a-f]{64})"$', caddyfile, re.M))
    assert mapped == {f"10.0.0.{n}:8443": front.caddy_front_box_key(FLEET_KEY, f"gpu{n}") for n in (1, 2)}, mapped
    assert FLEET_KEY not in caddyfile and "header_up Authorization {teamserve_box_auth}" in caddyfile
    (tmp_path / "short").mkdir()
    run = play(tmp_path / "short", {"front": front_host([box(1, 8, ["m"])], caddy_upstream_api_key="f" * 20)})
    assert run.returncode != 0 and "caddy_key_min_length" in run.stdout and "f" * 20 not in run.stdout


def test_role_refuses_a_front_without_the_fleet_key(tmp_path):
    run = play(tmp_path, {"front": front_host([box(1, 8, ["m"])], caddy_upstream_api_key="")})
    assert run.returncode != 0
    assert "caddy_upstream_api_key" in run.stdout


def test_box_behind_a_front_gets_the_front_user_and_keeps_a_public_health(tmp_path):
    """caddy_front_user_key adds teamserve-front, capped at the box's whole batch, and the team's own keys
    stay at the front unless caddy_users_around_front opts in; a box behind a front with a private /health
    would never be seen healthy, so it is refused."""
    plan = {"flags": {"max-num-seqs": 8, "max-num-queued-reqs": 4, "max-model-len": 2048}}
    box_vars = {"vllm_plan": plan, "caddy_users": USERS, "caddy_tls_mode": "off", "caddy_front_user_key": FLEET_KEY}
    old_key = "o" * 48  # a rotation of the fleet's key under way on gpu3
    rendered = render(tmp_path, {"gpu1": box_vars, "gpu2": {**box_vars, "caddy_users_around_front": True},
                                 "gpu3": {**box_vars, "caddy_front_user_key_previous": old_key},
                                 "solo": {**box_vars, "caddy_front_user_key": ""}})
    users = {host: set(re.findall(r"^\s+[0-9a-f]{64} (\S+) \d+ \d+ rate_", text, re.M)) for host, text in rendered.items()}
    team = {u["name"] for u in USERS}
    assert users == {"gpu1": {"teamserve-front"}, "gpu2": team | {"teamserve-front"}, "gpu3": {"teamserve-front"},
                     "solo": team}, users
    # during the rotation gpu3 takes the keys derived from the new and the old fleet's key, with the same limits
    rotating = {key: line for key, line in re.findall(r"^\s+([0-9a-f]{64}) (teamserve-front .*)$", rendered["gpu3"], re.M)}
    assert set(rotating) == {hashlib.sha256(front.caddy_front_box_key(k, "gpu3").encode()).hexdigest()
                             for k in (FLEET_KEY, old_key)} and len(set(rotating.values())) == 1, rotating
    assert len(re.findall(r"^\s+[0-9a-f]{64} teamserve-front ", rendered["gpu1"], re.M)) == 1
    assert re.search(r" teamserve-front 0 8 rate_1000_per_1s interactive 0 0\n", rendered["gpu1"])
    # the box knows the front by its own key, derived from the fleet's key and its name; only its SHA-256
    own = front.caddy_front_box_key(FLEET_KEY, "gpu1")
    assert re.search(rf"{hashlib.sha256(own.encode()).hexdigest()} teamserve-front ", rendered["gpu1"])
    assert FLEET_KEY not in rendered["gpu1"] and own not in rendered["gpu1"]
    (tmp_path / "private").mkdir()
    run = play(tmp_path / "private", {"gpu1": {**box_vars, "caddy_health_public": False}})
    assert run.returncode != 0 and "caddy_health_public" in run.stdout


@pytest.mark.parametrize("interval, grace", [("5s", 11), ("2s", 5), ("500ms", 2), ("1m", 121), ("1500ms", 4)])
def test_drain_grace_is_two_health_checks_and_a_second(interval, grace):
    assert front.caddy_front_drain_grace(interval) == grace


@pytest.mark.parametrize("interval", ["5", "0s", "5h", "", None, "1.5s"])
def test_drain_grace_refuses_what_is_not_a_duration(interval):
    with pytest.raises(ValueError, match="caddy_upstream_health_interval"):
        front.caddy_front_drain_grace(interval)


def test_the_person_passes_the_front_on_its_key_only(tmp_path):
    """The front names each request's person to the box (X-Teamserve-Person, set from the key it checked, so a
    client's own header is replaced) and drops the box's X-Teamserve-* answers, so a client sees one set; a box
    behind a front takes the name on the front's key only, with the person's own cap and lane (rate limits and
    budgets stay the front's), for every user with a key, whether or not the team's keys are deployed on the
    box (a revoked user is nobody there); a lone box has no such rows."""
    users = USERS + [{"name": "bob", "rate_limit": {"events": 60, "window": "1m"}, "lane": "batch", "max_inflight": 3},
                     {"name": "carol", "rate_limit": {"events": 5, "window": "1m"}},
                     {"name": "dave", "rate_limit": {"events": 5, "window": "1m"}}]  # no key: revoked, no person
    plan = {"flags": {"max-num-seqs": 8, "max-num-queued-reqs": 4, "max-model-len": 2048},
            "admission": {"user_max_inflight": 2}}
    box_vars = {"vllm_plan": plan, "caddy_users": users, "caddy_tls_mode": "off", "caddy_front_user_key": FLEET_KEY,
                "caddy_user_keys": {"bob": "b" * 40, "carol": "c" * 40}}
    rendered = render(tmp_path, {"gpu1": box_vars, "solo": {**box_vars, "caddy_front_user_key": ""},
                                 "front": {**front_host([box(1, 8, ["m"])]), "caddy_users": users}})
    block = re.search(r"\n\t\ton_behalf_of X-Teamserve-Person teamserve-front \{\n(.*?)\n\t\t\}", rendered["gpu1"], re.S)
    assert block, rendered["gpu1"]
    rows = [line.split() for line in block.group(1).splitlines()]
    assert rows == [["alice", "alice", "0", "2", '""', "interactive", "0", "0"],
                    ["bob", "bob", "0", "3", '""', "batch", "0", "0"],
                    ["carol", "carol", "0", "2", '""', "interactive", "0", "0"]], rows
    assert "log_append <via {api_key_map.on_behalf_of}" in rendered["gpu1"]
    assert "on_behalf_of" not in rendered["solo"] and "X-Teamserve-Person" not in rendered["solo"]
    (proxy,) = proxies(rendered["front"])
    assert "header_up X-Teamserve-Person {teamserve_user}" in proxy, proxy
    dropped = set(re.findall(r"header_down -(X-Teamserve-[\w-]+)", proxy))
    assert dropped == {"X-Teamserve-In-Flight", "X-Teamserve-In-Flight-Limit", "X-Teamserve-Tokens-Today",
                       "X-Teamserve-Tokens-Per-Day", "X-Teamserve-Tokens-Last-Minute",
                       "X-Teamserve-Tokens-Per-Minute"}, proxy
    emitted = set(re.findall(r"^\t\theader (X-Teamserve-[\w-]+) ", rendered["front"], re.M))
    assert emitted <= dropped, emitted - dropped  # every status header the gateway sets is one a front drops

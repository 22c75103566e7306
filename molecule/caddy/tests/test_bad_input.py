"""Bad input stops the caddy role with a message naming the field, the value and the fix, before anything
on the host changes (the live Caddyfile, the unit and the binary keep their checksums)."""
from __future__ import annotations

import pytest
from conftest import run_converge

GOOD = {"rate_limit": {"events": 5, "window": "1m"}}
KEY = "badInputKEY0123456789abcdefghijklmnop"
CASES = {
    "duplicate user": (
        [{"name": "zoe", "key": KEY, **GOOD}, {"name": "zoe", "key": KEY[::-1], **GOOD}],
        "duplicate user name 'zoe'"),
    "short key": ([{"name": "zoe", "key": "abc123", **GOOD}], "is 6 characters, shorter than the minimum 32"),
    "key with whitespace": ([{"name": "zoe", "key": KEY[:20] + " " + KEY[20:], **GOOD}], "contains whitespace"),
    "unknown limit unit": (
        [{"name": "zoe", "key": KEY, "rate_limit": {"events": 5, "window": "3 fortnights"}}],
        "has an unknown limit unit"),
    "unreadable expiry": ([{"name": "zoe", "key": KEY, "expires": "next tuesday", **GOOD}], "unrecognised date"),
    "names that collide in identifiers": (
        [{"name": "zoe-x", "key": KEY, **GOOD}, {"name": "zoe_x", "key": KEY[::-1], **GOOD}],
        "name 'zoe_x' collides with 'zoe-x'"),
    "in-flight cap above max-num-seqs": (
        [{"name": "zoe", "key": KEY, "max_inflight": 9, **GOOD}],
        "max_inflight=9 is above the batch behind this gateway, caddy_capacity_seqs=8"),
}
WATCHED = "/etc/caddy/Caddyfile /etc/systemd/system/caddy.service /usr/local/bin/caddy"


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_fails_before_any_change(host, case):
    users, expected = CASES[case]
    before = host.check_output(f"sha256sum {WATCHED}")
    run = run_converge({"caddy_users": users}, timeout=300)
    assert run.returncode != 0
    output = run.stdout + run.stderr
    assert expected in output and "caddy_users[" in output
    for secret in [u["key"] for u in users] + [KEY[:20], KEY[20:]]:  # keys are never echoed
        assert secret not in output
    assert "changed=0" in run.stdout  # failed in assert.yml, nothing touched
    assert host.check_output(f"sha256sum {WATCHED}") == before


def test_fallback_without_a_key_is_refused_before_any_change(host):
    before = host.check_output(f"sha256sum {WATCHED}")
    run = run_converge({"caddy_overload_policy": "fallback", "caddy_fallback_url": "https://api.example.com/v1"},
                       timeout=300)
    assert run.returncode != 0
    assert "caddy_fallback_api_key (not shown) is missing" in run.stdout + run.stderr
    assert "changed=0" in run.stdout
    assert host.check_output(f"sha256sum {WATCHED}") == before


def test_a_prefix_that_reaches_the_engines_own_routes_is_refused_before_any_change(host):
    before = host.check_output(f"sha256sum {WATCHED}")
    run = run_converge({"caddy_proxied_paths": ["/v1/*", "/tokenize"]}, timeout=300)
    assert run.returncode != 0
    output = " ".join((run.stdout + run.stderr).split())
    assert "caddy_proxied_paths: /v1/* (matches /v1/load_lora_adapter, /v1/unload_lora_adapter" in output
    assert "caddy_allow_engine_admin_paths" in output
    assert "changed=0" in run.stdout
    assert host.check_output(f"sha256sum {WATCHED}") == before


def test_an_empty_user_list_is_refused_before_any_change(host):
    before = host.check_output(f"sha256sum {WATCHED}")
    run = run_converge({"caddy_users": []}, timeout=300)
    assert run.returncode != 0
    output = " ".join((run.stdout + run.stderr).split())
    assert "caddy_users is empty, so the gateway would answer every request 401" in output
    assert "caddy_allow_no_users" in output and "changed=0" in run.stdout
    assert host.check_output(f"sha256sum {WATCHED}") == before


def test_a_gateway_without_an_in_flight_cap_is_refused_before_any_change(host):
    before = host.check_output(f"sha256sum {WATCHED}")
    run = run_converge({"caddy_max_inflight": 0}, timeout=300)
    assert run.returncode != 0
    output = " ".join((run.stdout + run.stderr).split())
    assert "caddy_max_inflight=0 must be a whole number of requests >= 1" in output
    assert "Remove the override to get the default" in output and "changed=0" in run.stdout
    assert host.check_output(f"sha256sum {WATCHED}") == before


def test_a_log_reader_that_is_not_an_account_is_refused_before_any_change(host):
    before = host.check_output(f"sha256sum {WATCHED}") + host.check_output("getfacl -p /var/log/caddy")
    run = run_converge({"caddy_access_log_readers": ["logreader", "no-such-reader"]}, timeout=300)
    assert run.returncode != 0
    output = " ".join((run.stdout + run.stderr).split())
    assert "caddy_access_log_readers: no-such-reader is not an account on this host" in output
    assert "changed=0" in run.stdout
    assert host.check_output(f"sha256sum {WATCHED}") + host.check_output("getfacl -p /var/log/caddy") == before


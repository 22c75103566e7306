"""Key management (side_effect.yml ran playbooks/users.yml): rotate bob, revoke carol, issue dave, and
frank's key expiring a minute after it was added. None of it may restart Caddy or the engine (the last
test restarts Caddy on purpose)."""
from __future__ import annotations

import json
import re
import time

import httpx2 as httpx  # the HTTP library openai 3.x is built on
from conftest import EPHEMERAL, SCENARIO, access_log_entries, run_converge
from test_gateway import assert_openai_error, raw

PLAYBOOKS = SCENARIO.parents[1] / "playbooks"
# The one format of every key teamserve issues (playbooks/users.yml, the testbed).
KEY_FORMAT = re.compile(r"sk-ts-[A-Za-z0-9]{48}")


def test_revoked_key_gets_401(base_url, ca_file, gateway_vars):
    old_carol = gateway_vars["caddy_user_keys"]["carol"]
    assert_openai_error(raw(base_url, ca_file, "/v1/models", old_carol), 401, "invalid_api_key")


def test_rotated_key_replaces_the_old_one(base_url, ca_file, gateway_vars, keys):
    old_bob = gateway_vars["caddy_user_keys"]["bob"]
    assert keys["bob"] != old_bob and KEY_FORMAT.fullmatch(keys["bob"])
    assert_openai_error(raw(base_url, ca_file, "/v1/models", old_bob), 401, "invalid_api_key")
    assert raw(base_url, ca_file, "/v1/models", keys["bob"]).status_code == 200


def test_issued_key_works(base_url, ca_file, keys):
    assert KEY_FORMAT.fullmatch(keys["dave"])  # 48 x log2(62) = 285 bits behind the prefix
    assert raw(base_url, ca_file, "/v1/models", keys["dave"]).status_code == 200


def test_key_changes_restarted_nothing(host):
    before = json.loads((EPHEMERAL / "pids-before-side-effect.json").read_text())
    now = host.check_output("systemctl show caddy.service fake-openai-upstream.service -p MainPID --value").split()
    assert [int(pid) for pid in now] == [before["caddy"], before["engine"]]


def test_key_file_is_vault_encrypted(keys, gateway_vars):
    text = (EPHEMERAL / "caddy_keys.vault.yml").read_text()
    assert text.startswith("$ANSIBLE_VAULT;1.1;AES256")
    for secret in list(keys.values()) + list(gateway_vars["caddy_user_keys"].values()):
        assert secret not in text


def test_expired_key_gets_401_without_a_play(host, base_url, ca_file, side_effect, keys):
    expires = side_effect["frank_expires_epoch"]
    if time.time() < expires - 2:
        assert raw(base_url, ca_file, "/v1/models", keys["frank"]).status_code == 200
    time.sleep(max(0.0, expires + 1 - time.time()))  # bounded: side_effect set it 60 s ahead
    assert_openai_error(raw(base_url, ca_file, "/v1/models", keys["frank"]), 401, "invalid_api_key")
    # A known key's 401 is logged with the user's name: an expired key shows whose it is.
    deadline = time.monotonic() + 10  # Caddy writes the entry as the handler returns
    while not [e for e in access_log_entries(host) if e.get("user") == "frank" and e["status"] == 401]:
        assert time.monotonic() < deadline, "no 401 entry for frank in the access log"
        time.sleep(0.3)
    assert {e.get("refused") for e in access_log_entries(host) if e.get("user") == "frank" and e["status"] == 401} \
        == {"invalid_api_key"}


def test_revoking_a_user_while_another_key_has_expired(base_url, ca_file, keys, gateway_vars):
    """An expired key is a warning, never a refusal: with frank listed and his date passed, revoking dave
    through playbooks/users.yml succeeds and names frank; both then get 401. (Runs after the test above,
    last in the scenario: nothing after it uses dave's key.)"""
    frank = {"name": "frank", "key": keys["frank"], "rate_limit": {"events": 1000, "window": "1m"},
             "expires": "2020-01-01T00:00:00Z"}
    run = run_converge({"caddy_users": gateway_vars["caddy_users"] + [frank], "caddy_users_action": "revoke",
                        "caddy_users_name": "dave", "caddy_users_keys_file": str(EPHEMERAL / "caddy_keys.vault.yml")},
                       timeout=300, playbook=PLAYBOOKS / "users.yml")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "WARNING: keys past their caddy_users expires date" in run.stdout and "frank (2020-01-01T00:00:00Z)" in run.stdout
    assert keys["frank"] not in run.stdout + run.stderr
    assert_openai_error(raw(base_url, ca_file, "/v1/models", keys["dave"]), 401, "invalid_api_key")
    assert_openai_error(raw(base_url, ca_file, "/v1/models", keys["frank"]), 401, "invalid_api_key")
    assert raw(base_url, ca_file, "/v1/models", keys["bob"]).status_code == 200


def test_a_restart_of_the_gateway_keeps_the_days_tokens(host, base_url, ca_file, keys):
    """Last in the scenario (it restarts Caddy): hana, past her daily budget in tests/test_gateway.py, is
    still refused after `systemctl restart caddy` with the same day's count, which the gateway read back from
    its ledger file."""
    before = raw(base_url, ca_file, "/v1/me", keys["hana"]).json()["tokens"]
    assert before["used_today"] >= before["per_day"] == 30, before
    assert host.run("systemctl restart caddy").rc == 0
    deadline = time.monotonic() + 30
    while True:
        try:
            after = raw(base_url, ca_file, "/v1/me", keys["hana"]).json()["tokens"]
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the gateway did not come back after its restart"
            time.sleep(0.5)
    # The day's count comes back from the ledger; the last minute's is kept in memory only, by design.
    day = ("per_day", "used_today", "resets_at")
    assert {k: after[k] for k in day} == {k: before[k] for k in day}, (before, after)
    refused = httpx.post(base_url + "/chat/completions", verify=ca_file, timeout=30,
                         headers={"Authorization": f"Bearer {keys['hana']}"},
                         json={"model": "fixture", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})
    assert_openai_error(refused, 429, "token_budget_exceeded")
    assert f"used {before['used_today']} of its 30 tokens" in refused.json()["error"]["message"]

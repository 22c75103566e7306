"""Key management (side_effect.yml ran playbooks/users.yml): rotate bob, revoke carol, issue dave, and
frank's key expiring a minute after it was added. None of it may restart Caddy or the engine."""
from __future__ import annotations

import json
import time

from conftest import EPHEMERAL
from test_gateway import assert_openai_error, raw


def test_revoked_key_gets_401(base_url, ca_file, gateway_vars):
    old_carol = gateway_vars["caddy_user_keys"]["carol"]
    assert_openai_error(raw(base_url, ca_file, "/v1/models", old_carol), 401, "invalid_api_key")


def test_rotated_key_replaces_the_old_one(base_url, ca_file, gateway_vars, keys):
    old_bob = gateway_vars["caddy_user_keys"]["bob"]
    assert keys["bob"] != old_bob and len(keys["bob"]) == 48
    assert_openai_error(raw(base_url, ca_file, "/v1/models", old_bob), 401, "invalid_api_key")
    assert raw(base_url, ca_file, "/v1/models", keys["bob"]).status_code == 200


def test_issued_key_works(base_url, ca_file, keys):
    assert keys["dave"].isalnum() and len(keys["dave"]) == 48  # 48 x log2(62) = 285 bits
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


def test_expired_key_gets_401_without_a_play(base_url, ca_file, side_effect, keys):
    expires = side_effect["frank_expires_epoch"]
    if time.time() < expires - 2:
        assert raw(base_url, ca_file, "/v1/models", keys["frank"]).status_code == 200
    time.sleep(max(0.0, expires + 1 - time.time()))  # bounded: side_effect set it 60 s ahead
    assert_openai_error(raw(base_url, ca_file, "/v1/models", keys["frank"]), 401, "invalid_api_key")

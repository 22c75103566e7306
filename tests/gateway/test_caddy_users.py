"""Unit tests of roles/caddy/filter_plugins/caddy_users.py (the checks behind the role's assert.yml)."""
from __future__ import annotations

import datetime as dt
import hashlib
import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "roles" / "caddy" / "filter_plugins" / "caddy_users.py"
_spec = importlib.util.spec_from_file_location("caddy_users", _PATH)
assert _spec is not None and _spec.loader is not None
cu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cu)

NOW = 1_800_000_000  # 2027-01-15T08:00:00Z
NOW_TEXT = "2027-01-15T08:00:00Z"
KEY_A = "A" * 31 + "a"
KEY_B = "b" * 40


def user(name="alice", **extra):
    return {"name": name, "rate_limit": {"events": 10, "window": "1m"}, **extra}


def problems(users, keys=None, **kw):
    return cu.caddy_users_problems(users, keys or {}, 32, **kw)


def test_good_list_has_no_problems():
    users = [user("alice", expires="2027-02-01"), user("bob", key=KEY_B), user("dave")]
    assert problems(users, {"alice": KEY_A}) == []


def test_duplicate_user():
    [msg] = problems([user("alice"), user("alice")])
    assert "duplicate user name 'alice'" in msg and "caddy_users[1]" in msg


@pytest.mark.parametrize("key,words", [
    ("k3yZ9", ["5 characters", "minimum 32"]),
    ("a" * 20 + " " + "b" * 20, ["whitespace"]),
    ("a" * 40 + "\t", ["whitespace"]),
    ("a" * 40 + "{x}", ["RFC 6750"]),
    ("a" * 40 + '"', ["RFC 6750"]),
])
def test_bad_keys_named_without_showing_the_key(key, words):
    [msg] = problems([user("alice")], {"alice": key})
    assert "caddy_users[0] (name=alice).key" in msg and all(w in msg for w in words)
    assert key.strip() not in msg


def test_key_reused_by_two_users_or_the_engine():
    assert "same as the key of" in problems([user("a", key=KEY_A), user("b", key=KEY_A)])[0]
    assert "caddy_upstream_api_key" in problems([user("a", key=KEY_A)], extra_keys=[KEY_A])[0]


@pytest.mark.parametrize("window", ["1w", "10", "1.5m", "0m", "1 m", "1M", 60, "1ms"])
def test_unknown_limit_unit(window):
    [msg] = problems([{"name": "alice", "rate_limit": {"events": 5, "window": window}}])
    assert f"rate_limit.window={window!r}" in msg and "s, m, h or d" in msg


@pytest.mark.parametrize("events", [0, -1, "10", True, None])
def test_bad_event_count(events):
    [msg] = problems([{"name": "alice", "rate_limit": {"events": events, "window": "1m"}}])
    assert "rate_limit.events" in msg


@pytest.mark.parametrize("expires", ["2027-01-15", "2020-01-01T00:00:00Z", dt.date(2026, 12, 31)])
def test_a_passed_expiry_is_named_but_blocks_nothing(expires):
    """One user's expired key must not stop a run that revokes or changes someone else."""
    users = [user("alice", expires=expires), user("bob", key=KEY_B)]
    assert problems(users, {"alice": KEY_A}) == []
    assert cu.caddy_users_expired(users, {"alice": KEY_A}, now_epoch=NOW) == [f"alice ({expires})"]


def test_expired_lists_only_users_with_a_key_and_a_date_passed():
    users = [user("zed", key=KEY_B, expires="2020-01-01"), user("alice", expires="2020-01-01"),
             user("carol", key=KEY_A + "c", expires="2027-01-16"), user("dave", key=KEY_A + "d", expires="soon"),
             user("erin", key=KEY_A + "e"), user("frank", key=KEY_A + "f", expires=NOW_TEXT)]
    assert cu.caddy_users_expired(users, {}, now_epoch=NOW) == ["frank (2027-01-15T08:00:00Z)", "zed (2020-01-01)"]


def test_unparseable_expiry():
    [msg] = problems([user("alice", expires="next tuesday")])
    assert "unrecognised date" in msg


@pytest.mark.parametrize("name", ["Alice", "al ice", "", "1abc", "a{b}", None])
def test_bad_names(name):
    assert any("is not a valid user name" in m for m in problems([user(name)]))


def test_expiry_epoch_is_utc():
    assert cu.caddy_expiry_epoch("1970-01-02") == 86400
    assert cu.caddy_expiry_epoch("1970-01-01T01:00:00Z") == 3600
    assert cu.caddy_expiry_epoch(dt.datetime(1970, 1, 1, 0, 1)) == 60


def test_effective_skips_users_without_key_and_sorts():
    users = [user("zed", key=KEY_B), user("alice", expires="1970-01-02"), user("dave")]
    eff = cu.caddy_users_effective(users, {"alice": KEY_A})
    assert [u["name"] for u in eff] == ["alice", "zed"]
    assert eff[0] == {"name": "alice", "key_sha256": hashlib.sha256(KEY_A.encode()).hexdigest(), "events": 10, "window": "1m", "rate_tier": "rate_10_per_1m",
                      "max_inflight": 1, "lane": "interactive", "tokens_per_day": 0, "tokens_per_minute": 0,
                      "expires_epoch": 86400}
    assert eff[1]["expires_epoch"] == 0
    assert cu.caddy_users_without_key(users, {"alice": KEY_A}) == ["dave"]


def test_own_key_wins_over_vault_key():
    own = cu.caddy_users_effective([user("a", key=KEY_B)], {"a": KEY_A})[0]
    assert own["key_sha256"] == hashlib.sha256(KEY_B.encode()).hexdigest()


@pytest.mark.parametrize("first,second", [("alice-x", "alice_x"), ("a_b-c", "a-b_c")])
def test_names_that_collide_in_identifiers(first, second):
    [msg] = problems([user(first), user(second)])
    assert f"name {second!r} collides with {first!r}" in msg and "caddy_users[1]" in msg and "rename" in msg


def test_max_inflight_within_the_batch():
    assert problems([user("a", max_inflight=1), user("b", max_inflight=8)], max_num_seqs=8) == []
    [msg] = problems([user("a", max_inflight=9)], max_num_seqs=8)
    assert "caddy_users[0] (name=a).max_inflight=9 is above the batch behind this gateway, caddy_capacity_seqs=8" in msg
    assert "at most 8" in msg
    for bad in (0, -1, "2", True, 1.5):
        [msg] = problems([user("a", max_inflight=bad)], max_num_seqs=8)
        assert f"max_inflight={bad!r} must be a whole number of requests >= 1" in msg


def test_effective_caps_and_tiers():
    users = [user("b", max_inflight=3), user("a"), {"name": "c", "rate_limit": {"events": 5, "window": "1h"}}]
    eff = cu.caddy_users_effective(users, {"a": KEY_A, "b": KEY_B, "c": KEY_A[::-1]}, 2)
    assert [(u["name"], u["max_inflight"], u["rate_tier"]) for u in eff] == [
        ("a", 2, "rate_10_per_1m"), ("b", 3, "rate_10_per_1m"), ("c", 2, "rate_5_per_1h")]
    # One zone per distinct limit, however many users share it.
    assert cu.caddy_rate_tiers(eff) == [{"name": "rate_10_per_1m", "events": 10, "window": "1m"},
                                        {"name": "rate_5_per_1h", "events": 5, "window": "1h"}]


def test_lanes():
    """A batch key runs at the lowest priority with half the default cap (its own max_inflight wins); an
    unknown lane is refused naming the field, the value and the choices."""
    users = [user("a"), user("b", lane="batch"), user("c", lane="batch", max_inflight=3), user("d", lane="interactive")]
    assert problems(users, {n: KEY_A + n for n in "abcd"}) == []
    eff = cu.caddy_users_effective(users, {n: KEY_A + n for n in "abcd"}, 4)
    assert [(u["name"], u["lane"], u["max_inflight"]) for u in eff] == [
        ("a", "interactive", 4), ("b", "batch", 2), ("c", "batch", 3), ("d", "interactive", 4)]
    assert cu.caddy_users_effective([user("e", lane="batch")], {"e": KEY_A}, 1)[0]["max_inflight"] == 1
    [msg] = problems([user("a", lane="bulk")])
    assert "caddy_users[0] (name=a).lane='bulk' is not a lane; use one of interactive, batch" in msg


@pytest.mark.parametrize("field", ["tokens_per_day", "tokens_per_minute"])
@pytest.mark.parametrize("budget", [-1, 1.5, "100", True])
def test_bad_token_budget_names_the_field_and_the_fix(budget, field):
    (problem,) = cu.caddy_users_problems([user("a", key=KEY_A, **{field: budget})], {})
    assert f"caddy_users[0] (name=a).{field}={budget!r} must be a whole number of tokens >= 0" in problem
    assert f"caddy_user_{field}" in problem


def test_daily_token_budget_own_or_default():
    users = [user("a", key=KEY_A, tokens_per_day=500), user("b", key=KEY_B), user("c", key=KEY_A[::-1], tokens_per_day=0)]
    assert cu.caddy_users_problems(users, {}) == []
    eff = {u["name"]: u["tokens_per_day"] for u in cu.caddy_users_effective(users, {}, 2, "288000")}
    assert eff == {"a": 500, "b": 288000, "c": 0}


def test_per_minute_token_budget_own_or_default():
    users = [user("a", key=KEY_A, tokens_per_minute=900), user("b", key=KEY_B),
             user("c", key=KEY_A[::-1], tokens_per_minute=0)]
    assert cu.caddy_users_problems(users, {}) == []
    eff = {u["name"]: u["tokens_per_minute"] for u in cu.caddy_users_effective(users, {}, 2, 0)}
    assert eff == {"a": 900, "b": 0, "c": 0}
    eff = {u["name"]: u["tokens_per_minute"] for u in cu.caddy_users_effective(users, {}, 2, 0, "5000")}
    assert eff == {"a": 900, "b": 5000, "c": 0}

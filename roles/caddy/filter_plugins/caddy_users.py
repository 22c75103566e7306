"""Filters that check and normalise the gateway's user list (``caddy_users`` + ``caddy_user_keys``).

Plain functions with no Ansible imports in the logic, so ``tests/gateway/test_caddy_users.py`` can test
them directly. The role calls them from ``tasks/assert.yml`` (problems -> one failed assert naming every
bad field) and ``templates/Caddyfile.j2`` (the normalised list).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import re
from typing import Any

# Bearer tokens: RFC 6750 §2.1 "b64token" = 1*( ALPHA / DIGIT / "-" / "." / "_" / "~" / "+" / "/" ) *"=".
# The same set keeps a key safe inside a quoted Caddyfile token (no whitespace, quotes, braces or backslash,
# so it can never be read as a placeholder or split into two tokens).
KEY_PATTERN = re.compile(r"^[A-Za-z0-9._~+/-]+=*$")
# User names become Caddyfile tokens, rate-limit and in-flight bucket keys and a log field: keep them
# to a safe, readable set.
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
# Rate-limit windows are Caddy durations (caddy.ParseDuration: Go time.ParseDuration plus "d" for days,
# https://caddyserver.com/docs/conventions#durations). Only whole numbers with these units are accepted.
WINDOW_PATTERN = re.compile(r"^([1-9][0-9]*)(s|m|h|d)$")
WINDOW_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# Expiry formats accepted in the inventory (UTC); YAML may also hand over a date/datetime object.
EXPIRY_FORMATS = ("%Y-%m-%d", "%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S")
# A key's lane: interactive (the default) is scheduled by its user's in-flight sequences against the fair
# share; batch is always scheduled last and has half the default in-flight cap (a batch job pointed at the
# team endpoint runs in what the team leaves idle).
LANES = ("interactive", "batch")


def caddy_user_lane_cap(lane: str, default_max_inflight: Any) -> int:
    """A lane's default in-flight cap, in engine sequences: ``default_max_inflight`` (caddy_user_max_inflight)
    for interactive, half of it (at least 1) for batch. Input: a lane of LANES and an int-like >= 1."""
    cap = int(default_max_inflight)
    return max(1, cap // 2) if lane == "batch" else cap


def caddy_expiry_epoch(value: Any) -> int:
    """Convert an inventory ``expires`` value to Unix seconds (UTC).

    Input: a string in one of EXPIRY_FORMATS (a bare date means 00:00:00 UTC that day), or a
    ``datetime.date``/``datetime.datetime`` (naive values are read as UTC). Output: int seconds since
    1970-01-01T00:00:00Z. Raises ValueError for anything else.
    """
    if isinstance(value, _dt.datetime):
        moment = value if value.tzinfo else value.replace(tzinfo=_dt.UTC)
    elif isinstance(value, _dt.date):
        moment = _dt.datetime(value.year, value.month, value.day, tzinfo=_dt.UTC)
    else:
        text = str(value).strip()
        for fmt in EXPIRY_FORMATS:
            try:
                moment = _dt.datetime.strptime(text, fmt).replace(tzinfo=_dt.UTC)
                break
            except ValueError:
                continue
        else:
            raise ValueError(f"unrecognised date {text!r}; use YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ (UTC)")
    return int(moment.timestamp())


def _user_key(user: dict, keys: dict) -> Any:
    """The key for ``user``: its own ``key`` field if set, else ``keys[name]``; None if neither."""
    own = user.get("key")
    if own not in (None, ""):
        return own
    return (keys or {}).get(user.get("name"))


def caddy_user_identifier(name: str) -> str:
    """The form of a user name in identifiers built from it (Ansible variable names, Caddy zone names,
    Prometheus label values used as names), which allow [a-z0-9_] only.

    '-' becomes '_' there, so ``alice-x`` and ``alice_x`` would share an identifier (and, before limits
    were grouped by tier, a rate-limit zone); caddy_users_problems refuses such pairs. Input/output: str.
    """
    return name.replace("-", "_")


def caddy_users_problems(users: Any, keys: Any, min_key_length: int = 32, extra_keys: Any = None,
                         max_num_seqs: Any = None) -> list[str]:
    """Check the gateway's user list; return one message per problem (empty list = all good).

    Inputs: ``users`` = ``caddy_users`` (list of dicts: name, key?, rate_limit {events, window}, expires?,
    max_inflight?, lane?); ``keys`` = ``caddy_user_keys`` (dict name -> key, from the vault that playbooks/users.yml
    writes); ``min_key_length`` in characters; ``extra_keys`` = other secrets that must not double as a
    user key (the engine's own key); ``max_num_seqs`` = the engine's --max-num-seqs, the upper bound of a
    user's ``max_inflight`` (requests; None = no upper bound checked).
    Each message names the field, the bad value (never a key's text) and the fix. Raises nothing.
    """
    problems: list[str] = []
    if not isinstance(users, list):
        return [f"caddy_users must be a list of users, got {type(users).__name__}"]
    if keys is not None and not isinstance(keys, dict):
        problems.append(f"caddy_user_keys must be a mapping of user name to key, got {type(keys).__name__}")
        keys = {}
    seen_names: set[str] = set()
    seen_identifiers: dict[str, str] = {}
    seen_keys: dict[str, str] = {}
    for secret in extra_keys or []:
        if secret:
            seen_keys[str(secret)] = "caddy_upstream_api_key"
    for index, user in enumerate(users):
        where = f"caddy_users[{index}]"
        if not isinstance(user, dict):
            problems.append(f"{where} must be a mapping with name and rate_limit, got {type(user).__name__}")
            continue
        name = user.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            problems.append(f"{where}.name={name!r} is not a valid user name: use 1-63 characters, lower-case "
                            "letters, digits, '-' or '_', starting with a letter")
        else:
            where = f"caddy_users[{index}] (name={name})"
            if name in seen_names:
                problems.append(f"{where}: duplicate user name {name!r}; each user must appear once in caddy_users")
            elif caddy_user_identifier(name) in seen_identifiers:
                other = seen_identifiers[caddy_user_identifier(name)]
                problems.append(f"{where}: name {name!r} collides with {other!r} (both are "
                                f"{caddy_user_identifier(name)!r} in the gateway's identifiers, where - and _ are "
                                "the same); rename one of them")
            seen_names.add(name)
            seen_identifiers.setdefault(caddy_user_identifier(name), name)
        unknown = sorted(set(user) - {"name", "key", "rate_limit", "expires", "max_inflight", "lane", "tokens_per_day",
                                      "tokens_per_minute"})
        if unknown:
            problems.append(f"{where}: unknown field(s) {unknown}; allowed: name, key, rate_limit, expires, "
                            "max_inflight, lane, tokens_per_day, tokens_per_minute")
        for field in ("tokens_per_day", "tokens_per_minute"):
            budget = user.get(field)
            if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
                problems.append(f"{where}.{field}={budget!r} must be a whole number of tokens >= 0 (0 = no "
                                f"budget); remove it to get the default (caddy_user_{field})")
        if user.get("lane") is not None and user["lane"] not in LANES:
            problems.append(f"{where}.lane={user['lane']!r} is not a lane; use one of {', '.join(LANES)} "
                            "(batch: always scheduled after interactive work, half the default in-flight cap), "
                            "or remove it for interactive")
        if user.get("max_inflight") is not None:
            cap = user["max_inflight"]
            upper = int(max_num_seqs) if max_num_seqs not in (None, "") else None
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                problems.append(f"{where}.max_inflight={cap!r} must be a whole number of requests >= 1; "
                                "remove it to get the default share of the batch (caddy_user_max_inflight)")
            elif upper is not None and cap > upper:
                problems.append(f"{where}.max_inflight={cap} is above the batch behind this gateway, "
                                f"caddy_capacity_seqs={upper} (one user would hold more than the whole batch); set it to at most {upper}, or remove "
                                "it to get the default share (caddy_user_max_inflight)")
        key = _user_key(user, keys)
        if key is not None:
            if not isinstance(key, str):
                problems.append(f"{where}.key must be a string, got {type(key).__name__}")
            elif len(key) < int(min_key_length):
                problems.append(f"{where}.key is {len(key)} characters, shorter than the minimum {min_key_length}; "
                                "issue a new one with playbooks/users.yml -e caddy_users_action=rotate")
            elif any(ch.isspace() for ch in key):
                problems.append(f"{where}.key contains whitespace; keys must be one RFC 6750 token "
                                "(letters, digits, - . _ ~ + / and trailing =)")
            elif not KEY_PATTERN.match(key):
                problems.append(f"{where}.key contains characters outside RFC 6750's token set "
                                "(letters, digits, - . _ ~ + / and trailing =)")
            elif key in seen_keys:
                problems.append(f"{where}.key is the same as the key of {seen_keys[key]}; every key must be unique")
            else:
                seen_keys[key] = where
        limit = user.get("rate_limit")
        if not isinstance(limit, dict):
            problems.append(f"{where}.rate_limit={limit!r} must be a mapping like {{events: 60, window: 1m}}")
        else:
            events = limit.get("events")
            if isinstance(events, bool) or not isinstance(events, int) or events < 1:
                problems.append(f"{where}.rate_limit.events={events!r} must be a whole number >= 1 "
                                "(requests allowed per window)")
            window = limit.get("window")
            if not isinstance(window, str) or not WINDOW_PATTERN.match(window):
                problems.append(f"{where}.rate_limit.window={window!r} has an unknown limit unit or format; "
                                "use a whole number with s, m, h or d, e.g. 30s, 1m, 1h, 1d")
            extra = sorted(set(limit) - {"events", "window"})
            if extra:
                problems.append(f"{where}.rate_limit: unknown field(s) {extra}; allowed: events, window")
        # A date that has passed is not a problem: the gateway refuses that key per request (401), and
        # caddy_users_expired names it. Refusing it here would block every other change, revocations too.
        if user.get("expires") not in (None, ""):
            try:
                caddy_expiry_epoch(user["expires"])
            except ValueError as err:
                problems.append(f"{where}.expires={user['expires']!r}: {err}")
    return problems


def caddy_users_expired(users: Any, keys: Any, now_epoch: int | None = None) -> list[str]:
    """Users whose key has passed its ``expires`` date: the gateway answers them 401 until the date is
    moved or the key revoked. Inputs as for caddy_users_problems (``now_epoch`` in Unix seconds, default
    the clock). Output: "name (expires)" strings sorted by name, for users that have a key and a valid
    date at or before now; users without a key or with an unreadable date are left to the other checks.
    Raises nothing.
    """
    now = int(_dt.datetime.now(tz=_dt.UTC).timestamp()) if now_epoch is None else int(now_epoch)
    expired = []
    for user in users if isinstance(users, list) else []:
        if not isinstance(user, dict) or user.get("expires") in (None, ""):
            continue
        if _user_key(user, keys if isinstance(keys, dict) else {}) in (None, ""):
            continue
        try:
            epoch = caddy_expiry_epoch(user["expires"])
        except ValueError:
            continue
        if epoch <= now:
            expired.append(f"{user.get('name')} ({user['expires']})")
    return sorted(expired)


def caddy_rate_tier(events: int, window: str) -> str:
    """Name of the rate-limit zone shared by every user with ``events`` requests per ``window``.

    Example: (60, "1m") -> "rate_60_per_1m". Users are grouped by limit so the gateway evaluates one
    zone per distinct limit, not one per user.
    """
    return f"rate_{int(events)}_per_{window}"


def caddy_users_effective(users: list, keys: Any, default_max_inflight: Any = 1,
                          default_tokens_per_day: Any = 0, default_tokens_per_minute: Any = 0) -> list[dict]:
    """Normalise the (already checked) user list for the Caddyfile template.

    Inputs as for caddy_users_problems, plus ``default_max_inflight`` (requests; caddy_user_max_inflight)
    for users without their own ``max_inflight`` and ``default_tokens_per_day`` (tokens per UTC day;
    caddy_user_tokens_per_day, 0 = none) for users without their own ``tokens_per_day``, and
    ``default_tokens_per_minute`` (tokens in the last 60 s; caddy_user_tokens_per_minute, 0 = none) for
    users without their own ``tokens_per_minute``. Output: one dict per user that HAS a key (users
    without a key are not issued or were revoked, and get no access): ``name``, ``key_sha256`` (the key's
    SHA-256, 64 lowercase hex digits: the gateway's api_key_map matches it, so the key itself is never
    written to the Caddyfile), ``events`` (int), ``window`` (Caddy duration string), ``rate_tier`` (zone
    name, caddy_rate_tier), ``max_inflight`` (int engine sequences; a user without their own gets
    caddy_user_lane_cap), ``lane`` (one of LANES, default interactive), ``tokens_per_day`` and
    ``tokens_per_minute`` (int tokens, 0 = no budget) and ``expires_epoch`` (int Unix seconds, 0 = never),
    sorted by name so the rendered file does not change when the inventory order does.
    """
    result = []
    for user in users:
        key = _user_key(user, keys or {})
        if key in (None, ""):
            continue
        expires = user.get("expires")
        events, window = int(user["rate_limit"]["events"]), user["rate_limit"]["window"]
        cap = user.get("max_inflight")
        lane = user.get("lane") or "interactive"
        result.append({
            "name": user["name"],
            "key_sha256": hashlib.sha256(key.encode()).hexdigest(),
            "events": events,
            "window": window,
            "rate_tier": caddy_rate_tier(events, window),
            "max_inflight": int(cap) if cap is not None else caddy_user_lane_cap(lane, default_max_inflight),
            "lane": lane,
            "tokens_per_day": int(user["tokens_per_day"] if user.get("tokens_per_day") is not None
                                  else default_tokens_per_day or 0),
            "tokens_per_minute": int(user["tokens_per_minute"] if user.get("tokens_per_minute") is not None
                                     else default_tokens_per_minute or 0),
            "expires_epoch": caddy_expiry_epoch(expires) if expires not in (None, "") else 0,
        })
    return sorted(result, key=lambda u: u["name"])


def caddy_front_persons(users: list, keys: Any, default_max_inflight: Any = 1) -> list[dict]:
    """The persons a front gateway may name to this box (the Caddyfile's ``on_behalf_of`` rows).

    Input: the (already checked) ``caddy_users``, ``keys`` (caddy_user_keys: name -> key) and
    ``default_max_inflight`` (engine sequences; caddy_user_max_inflight) for users without their own
    ``max_inflight``. Only the front's key may name a person; a user without a key (never issued, or
    revoked) is no person here either, whether or not the team's keys are deployed on the box. Output: one
    dict per user with a key, sorted by name: ``name``, ``max_inflight`` (int engine sequences, as in
    caddy_users_effective), ``lane`` and ``expires_epoch`` (int Unix seconds, 0 = never); no key. Rate
    limits and token budgets are the front's, which holds them across the fleet, so the rows carry none.
    """
    result = []
    for user in users:
        if _user_key(user, keys or {}) in (None, ""):
            continue
        lane = user.get("lane") or "interactive"
        cap = user.get("max_inflight")
        expires = user.get("expires")
        result.append({
            "name": user["name"],
            "max_inflight": int(cap) if cap is not None else caddy_user_lane_cap(lane, default_max_inflight),
            "lane": lane,
            "expires_epoch": caddy_expiry_epoch(expires) if expires not in (None, "") else 0,
        })
    return sorted(result, key=lambda u: u["name"])


def caddy_rate_tiers(effective_users: list[dict]) -> list[dict]:
    """The distinct rate limits of ``effective_users`` (caddy_users_effective's output), one per zone.

    Output: dicts ``name`` (zone), ``events`` (int requests), ``window`` (Caddy duration), sorted by
    name. The number of zones is the number of distinct limits, whatever the number of users.
    """
    tiers = {u["rate_tier"]: {"name": u["rate_tier"], "events": u["events"], "window": u["window"]}
             for u in effective_users}
    return [tiers[name] for name in sorted(tiers)]


def caddy_users_without_key(users: list, keys: Any) -> list[str]:
    """Names of users listed in ``caddy_users`` that have no key (never issued or revoked), sorted."""
    return sorted(u["name"] for u in users if isinstance(u, dict) and _user_key(u, keys or {}) in (None, ""))


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        """Map filter names to functions."""
        return {
            "caddy_users_problems": caddy_users_problems,
            "caddy_users_effective": caddy_users_effective,
            "caddy_rate_tiers": caddy_rate_tiers,
            "caddy_front_persons": caddy_front_persons,
            "caddy_users_without_key": caddy_users_without_key,
            "caddy_users_expired": caddy_users_expired,
            "caddy_expiry_epoch": caddy_expiry_epoch,
            "caddy_user_lane_cap": caddy_user_lane_cap,
        }

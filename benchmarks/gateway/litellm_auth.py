"""Custom auth for the LiteLLM proxy in the gateway benchmark: the gateway's users and keys, no database.

LiteLLM's own per-user "virtual keys" live in a Postgres database (docs.litellm.ai/docs/proxy/virtual_keys:
"Requirements: Need a postgres database"). Without one, the documented way to give each person a key is
a custom auth function (docs.litellm.ai/docs/proxy/custom_auth: ``general_settings: custom_auth:
<module>.<function>``, returning a ``UserAPIKeyAuth``); the rate limits set on the returned object are
enforced without further flags ("Key / user / team / end-user rate limits | returned object (rpm_limit ...)
| none"). This module is that function, fed with the SAME users, keys and per-user limits as the Caddy
gateway (benchmarks/gateway/run.sh writes them from the testbed inventory and vault).

The keys file (path in TEAMSERVE_LITELLM_KEYS_FILE, JSON, mode 0600) is
``{"users": [{"name": "alice", "key": "...", "rpm": 120}, ...]}``; ``rpm`` is the user's Caddy limit
converted to requests per minute (events / window in minutes), LiteLLM's unit for request limits.
"""
from __future__ import annotations

import hmac
import json
import os

from fastapi import HTTPException, Request
from litellm.proxy._types import UserAPIKeyAuth


def load_users(path: str) -> dict[str, dict]:
    """Read the keys file at ``path``; return {key: {"name": str, "rpm": int}}.

    Raises OSError if the file cannot be read, ValueError (json.JSONDecodeError included) if it is not
    the documented shape, a key is empty or two users share a key.
    """
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    users: dict[str, dict] = {}
    for entry in data.get("users", []):
        key, name, rpm = entry.get("key"), entry.get("name"), entry.get("rpm")
        if not key or not name or not isinstance(rpm, int) or rpm < 1:
            raise ValueError(f"{path}: each user needs name, key and rpm >= 1 (user {name!r})")
        if key in users:
            raise ValueError(f"{path}: users {users[key]['name']!r} and {name!r} share a key")
        users[key] = {"name": name, "rpm": rpm}
    return users


_USERS = load_users(os.environ["TEAMSERVE_LITELLM_KEYS_FILE"])


def lookup(api_key: str, users: dict[str, dict]) -> dict | None:
    """The user record for ``api_key`` (compared in constant time per key), or None if no user has it."""
    found = None
    for key, user in users.items():
        if hmac.compare_digest(key.encode(), (api_key or "").encode()):
            found = user
    return found


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:  # noqa: ARG001 (LiteLLM's signature)
    """LiteLLM custom-auth hook: the caller's user, with that user's request-per-minute limit.

    ``api_key`` is the bearer token LiteLLM took from the Authorization header. Raises fastapi's
    HTTPException(401) for a missing or unknown key: LiteLLM 1.108.7 keeps an HTTPException's status
    (proxy/auth/auth_exception_handler.py, _as_proxy_exception) and turns any other exception into a 500.
    """
    user = lookup(api_key, _USERS)
    if user is None:
        raise HTTPException(status_code=401, detail="missing or unknown API key")
    return UserAPIKeyAuth(api_key=api_key, user_id=user["name"], key_alias=user["name"], rpm_limit=user["rpm"])

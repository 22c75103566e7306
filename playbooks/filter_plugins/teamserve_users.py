"""Gateway users' keys and the list playbooks/users.yml prints.

``teamserve_new_key``: the one generator of every key teamserve issues: ``sk-ts-`` and 48 characters drawn
with Python's ``secrets`` from [A-Za-z0-9] (48 x log2(62) = 285 bits). users.yml issues and rotates keys with
it; the testbed's inventory script runs this file (``python playbooks/filter_plugins/teamserve_users.py`` prints one
key). Keys of another form issued before stay valid: the gateway checks keys by hash, never by form.

``teamserve_users_listing``: users.yml's list, one line per user: key state (never a key), expiry, rate limit,
in-flight cap as the gateway applies it (the user's own, else the lane's share of the plan's per-user cap,
the caddy role's caddy_user_lane_cap) and lane.

Standard library only (the caddy role's user filters loaded by path), so the tests and the testbed script
use this file without Ansible.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import pathlib
import secrets
import string
import sys
from collections.abc import Collection
from types import ModuleType
from typing import Any

KEY_PREFIX = "sk-ts-"
KEY_ALPHABET = string.ascii_letters + string.digits
KEY_LENGTH = 48  # random characters after the prefix
KEY_MIN_LENGTH = 32  # fewer random characters than this is refused (190 bits)


def _caddy_users() -> ModuleType:
    """roles/caddy/filter_plugins/caddy_users.py, the gateway's own rules for lanes and expiry dates."""
    name = "teamserve_caddy_users"
    if name not in sys.modules:
        path = pathlib.Path(__file__).resolve().parents[2] / "roles" / "caddy" / "filter_plugins" / "caddy_users.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def teamserve_new_key(length: Any = KEY_LENGTH) -> str:
    """A new user key: KEY_PREFIX and ``length`` (int-like, >= KEY_MIN_LENGTH) characters of KEY_ALPHABET
    drawn with ``secrets``. Raises ValueError for a shorter length. Every call draws a new key."""
    count = int(length)
    if count < KEY_MIN_LENGTH:
        raise ValueError(f"a key needs at least {KEY_MIN_LENGTH} random characters, got {count}")
    return KEY_PREFIX + "".join(secrets.choice(KEY_ALPHABET) for _ in range(count))


def teamserve_users_listing(users: Any, with_key: Collection[str] = (), default_max_inflight: Any = None,
                            now_epoch: Any = None, no_plan: str = "", default_tokens_per_day: Any = None,
                            default_tokens_per_minute: Any = 0) -> list[str]:
    """The lines of users.yml's list, one per user of ``users`` (caddy_users; checked by the caddy role).

    ``with_key``: names with a key in the key file; a user's own ``key`` field counts too. Neither key is
    ever printed. ``default_max_inflight``: the gateway's default per-user cap in engine sequences (the
    inventory's caddy_user_max_inflight, else the plan the box records); None when unknown, then a user
    without their own cap reads "unknown" with ``no_plan`` (why). ``now_epoch``: Unix seconds, for
    "EXPIRED" (default: the clock). ``default_tokens_per_day``: the default daily token budget (tokens; 0 =
    none), found like ``default_max_inflight``; None when unknown. ``default_tokens_per_minute``: the
    default budget over any 60 s (tokens; 0 = none, the role's default). Output: "name  key: ...; expires:
    ...; rate: N/window; in flight: N sequences; lane: ...; tokens/day: N[; tokens/min: N]" strings (the
    last only where a per-minute budget applies), in the order of ``users``.
    """
    caddy = _caddy_users()
    now = int(_dt.datetime.now(tz=_dt.UTC).timestamp()) if now_epoch is None else int(now_epoch)
    lines = []
    for user in users or []:
        name = str(user.get("name"))
        if user.get("key"):
            key = "in the inventory (caddy_users.key)"
        else:
            key = "yes" if name in with_key else "none (no access; issue one)"
        expires = user.get("expires")
        if expires in (None, ""):
            until = "never"
        else:
            until = str(expires) + (" - EXPIRED, answered 401" if caddy.caddy_expiry_epoch(expires) <= now else "")
        lane = user.get("lane") or "interactive"
        if user.get("max_inflight") is not None:
            cap = f"{int(user['max_inflight'])} sequences"
        elif default_max_inflight not in (None, ""):
            cap = f"{caddy.caddy_user_lane_cap(lane, default_max_inflight)} sequences"
        else:
            cap = "unknown" + (f" ({no_plan})" if no_plan else "")
        budget = user.get("tokens_per_day")
        if budget is None and default_tokens_per_day not in (None, ""):
            budget = default_tokens_per_day
        if budget is None:
            tokens = "unknown" + (f" ({no_plan})" if no_plan else "")
        else:
            tokens = f"{int(budget)}" if int(budget) > 0 else "no budget"
        per_minute = user.get("tokens_per_minute")
        per_minute = int(default_tokens_per_minute or 0) if per_minute is None else int(per_minute)
        limit = user.get("rate_limit") or {}
        lines.append(f"{name:<16} key: {key}; expires: {until}; rate: {limit.get('events')}/{limit.get('window')}; "
                     f"in flight: {cap}; lane: {lane}; tokens/day: {tokens}"
                     + (f"; tokens/min: {per_minute}" if per_minute > 0 else ""))
    return lines


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        """Map filter names to functions."""
        return {"teamserve_new_key": teamserve_new_key, "teamserve_users_listing": teamserve_users_listing}


if __name__ == "__main__":
    print(teamserve_new_key(*sys.argv[1:2]))

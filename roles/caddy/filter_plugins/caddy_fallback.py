"""The gateway's overload and outage policy: check the fallback upstream's settings.

Plain functions with no Ansible imports, tested by ``tests/gateway/test_caddy_fallback.py``; the role's
checks call ``caddy_fallback_upstream`` before anything on the host changes, and the Caddyfile template
renders its result.
"""
from __future__ import annotations

import ipaddress
import re
from typing import Any
from urllib.parse import urlsplit

POLICIES = ("shed", "fallback")
# What may appear in the Caddyfile around the fallback's key (it is written inside double quotes).
_KEY = re.compile(r'^[^\s"\\{}`]+$')
_HOST = re.compile(r"^[A-Za-z0-9.\-]+$|^\[[0-9A-Fa-f:.]+\]$")


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def caddy_fallback_upstream(policy: Any, url: Any = "", api_key: Any = "", allow_plain_http: Any = False) -> dict[str, Any]:
    """The fallback upstream the Caddyfile proxies to, or none.

    Inputs: ``caddy_overload_policy`` ("shed" or "fallback"), ``caddy_fallback_url`` (an OpenAI-compatible
    base URL: ``https://host[:port]`` with an empty or ``/v1`` path; clients' ``/v1/...`` paths are kept),
    ``caddy_fallback_api_key`` (its key; never echoed in errors) and ``caddy_fallback_allow_plain_http``
    (bool: allow ``http://`` to a host that is not loopback).
    Output: ``{"enabled": False}`` for "shed"; for "fallback" ``{"enabled": True, "upstream":
    "scheme://host:port", "host": host}``.
    Raises ValueError naming the variable, its value (never the key) and the fix.
    """
    if policy not in POLICIES:
        raise ValueError(f"caddy_overload_policy={policy!r}: use 'shed' (503 server_full with Retry-After) or "
                         "'fallback' (a secondary OpenAI-compatible upstream answers; set caddy_fallback_url and "
                         "caddy_fallback_api_key)")
    if policy == "shed":
        return {"enabled": False}
    text = url if isinstance(url, str) else ""
    if not text.strip():
        raise ValueError("caddy_overload_policy=fallback needs caddy_fallback_url, the fallback's OpenAI-compatible "
                         "base URL (e.g. https://api.example.com/v1); set it, or use caddy_overload_policy=shed")
    parts = urlsplit(text.strip())
    host = parts.hostname or ""
    bracketed = f"[{host}]" if ":" in host else host
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = -1
    if (parts.scheme not in ("http", "https") or not host or not _HOST.match(bracketed) or port < 1
            or parts.username or parts.password or parts.query or parts.fragment
            or parts.path.rstrip("/") not in ("", "/v1")):
        raise ValueError(f"caddy_fallback_url={text!r} is not usable: give scheme://host[:port] with an empty or "
                         "/v1 path and no user, query or fragment (e.g. https://api.example.com/v1); the "
                         "gateway keeps each request's /v1/... path")
    if parts.scheme == "http" and not _is_loopback(host) and allow_plain_http is not True:
        raise ValueError(f"caddy_fallback_url={text!r} is plain HTTP to another host: prompts, answers and the "
                         "fallback's key would cross the network unencrypted. Use https://, or set "
                         "caddy_fallback_allow_plain_http: true for a fallback on a network you trust")
    if not isinstance(api_key, str) or not _KEY.match(api_key):
        raise ValueError("caddy_fallback_api_key (not shown) is missing or holds whitespace, quotes, braces, "
                         "backticks or backslashes: put the fallback's key in the vault as "
                         "vault_caddy_fallback_api_key and set caddy_fallback_api_key to it")
    return {"enabled": True, "upstream": f"{parts.scheme}://{bracketed}:{port}", "host": host}


class FilterModule:
    """Ansible filter plugin entry point."""

    def filters(self) -> dict:
        """Map filter names to functions."""
        return {"caddy_fallback_upstream": caddy_fallback_upstream}

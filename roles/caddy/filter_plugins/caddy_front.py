"""A front gateway over several teamserve boxes: check caddy_upstreams and group them by model.

Plain functions with no Ansible imports, tested by ``tests/gateway/test_caddy_front.py``; the role's checks
call ``caddy_front_upstreams`` before anything on the host changes, and the Caddyfile template renders
the result of ``caddy_front_routes``.

Each upstream is another box's teamserve gateway (its own users are only the front), so every number here
comes from that box's capacity plan: ``max_inflight`` is its max-num-seqs (the batch), ``max_model_len``
its max-model-len (tokens).
"""
from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

LB_POLICIES = ("least_conn", "user_hash")
_HOST = re.compile(r"^[A-Za-z0-9.\-]+$|^\[[0-9A-Fa-f:.]+\]$")
# Served model names are written inside double quotes in the Caddyfile and inside JSON.
_MODEL = re.compile(r'^[^\s"\\{}`]+$')
_PATH = re.compile(r"^[~/][^\n]*$")
_KEYS = {"url", "max_inflight", "models", "max_model_len", "ca_cert", "name"}


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def caddy_front_upstreams(upstreams: Any) -> list[dict[str, Any]]:
    """Check and normalise ``caddy_upstreams``.

    Input: a list of mappings, one per box: ``url`` (``https://host:port`` of the box's gateway, no path),
    ``max_inflight`` (requests, >= 1: the box's max-num-seqs), ``models`` (served model names, non-empty),
    ``max_model_len`` (tokens, >= 1), ``ca_cert`` (path ON THE CONTROLLER of the PEM root that signs the
    box's certificate, which the role copies to the front; "" = the system trust store) and optionally
    ``name`` (the box's ``caddy_front_box_name``, its inventory name by default: the key the front presents
    to it derives from it, see ``caddy_front_box_key``; default the box's "host:port").
    Output: the same entries with ``dial`` ("host:port", how Caddy names the upstream) and ``ca_file`` (the
    copy's file name on the front, "" without ca_cert) added, ints as ints.
    An empty list is returned as is (the gateway proxies to ``caddy_upstream`` then).
    Raises ValueError naming the entry, the field, the value and the fix.
    """
    if upstreams in (None, ""):
        return []
    if not isinstance(upstreams, list):
        raise ValueError(f"caddy_upstreams={upstreams!r} must be a list of boxes "
                         "({url, max_inflight, models, max_model_len, ca_cert})")
    out: list[dict[str, Any]] = []
    dials: set[str] = set()
    for index, entry in enumerate(upstreams):
        where = f"caddy_upstreams[{index}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}={entry!r} must be a mapping with url, max_inflight, models, max_model_len")
        where = f"caddy_upstreams[{index}] ({entry.get('name') or entry.get('url')})"
        unknown = sorted(set(entry) - _KEYS)
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; allowed: {sorted(_KEYS)}")
        url = str(entry.get("url", "")).strip()
        parts = urlsplit(url)
        host = parts.hostname or ""
        bracketed = f"[{host}]" if ":" in host else host
        try:
            port = parts.port
        except ValueError:
            port = None
        if (parts.scheme != "https" or not host or not _HOST.match(bracketed) or not port
                or parts.path not in ("", "/") or parts.query or parts.fragment or parts.username):
            raise ValueError(f"{where}: url={url!r} must be https://host:port of the box's teamserve gateway "
                             "(TLS: the front sends the fleet's key to it), without a path")
        dial = f"{bracketed}:{port}"
        if dial in dials:
            raise ValueError(f"{where}: url={url!r} is listed twice; list each box once")
        dials.add(dial)
        cap = _int(entry.get("max_inflight"))
        if cap is None or cap < 1:
            raise ValueError(f"{where}: max_inflight={entry.get('max_inflight')!r} must be an integer >= 1, the box's "
                             "max-num-seqs from its capacity plan")
        length = _int(entry.get("max_model_len"))
        if length is None or length < 1:
            raise ValueError(f"{where}: max_model_len={entry.get('max_model_len')!r} must be an integer >= 1, the "
                             "box's max-model-len from its capacity plan")
        models = entry.get("models")
        if (not isinstance(models, list) or not models
                or not all(isinstance(m, str) and _MODEL.match(m) for m in models)):
            raise ValueError(f"{where}: models={models!r} must be a non-empty list of served model names "
                             "(no blanks, quotes, braces or backslashes)")
        ca_cert = str(entry.get("ca_cert") or "")
        if ca_cert and not _PATH.match(ca_cert):
            raise ValueError(f"{where}: ca_cert={ca_cert!r} must be a path on the controller (absolute or ~/...), "
                             "or empty for the system trust store")
        out.append({"name": str(entry.get("name") or dial), "url": f"https://{dial}", "dial": dial,
                    "max_inflight": cap, "models": list(dict.fromkeys(models)), "max_model_len": length,
                    "ca_cert": ca_cert,
                    "ca_file": (re.sub(r"[^A-Za-z0-9.-]", "_", dial) + ".crt") if ca_cert else ""})
    if len({bool(u["ca_cert"]) for u in out}) > 1:
        raise ValueError("caddy_upstreams mixes boxes with ca_cert (their own CA) and without (the system trust "
                         f"store): {[u['name'] for u in out if not u['ca_cert']]} have none. One pool trusts one set "
                         "of roots: give every box its CA, or put every box on public certificates")
    return out


def caddy_front_capacity(upstreams: Any) -> int:
    """The fleet's capacity (requests in flight): the sum of the boxes' ``max_inflight``; 0 without boxes."""
    return sum(u["max_inflight"] for u in caddy_front_upstreams(upstreams))


def caddy_front_max_model_len(upstreams: Any) -> int:
    """The longest max-model-len (tokens) of the boxes (sizes the front's body limit); 0 without boxes."""
    return max((u["max_model_len"] for u in caddy_front_upstreams(upstreams)), default=0)


def caddy_front_routes(upstreams: Any) -> dict[str, Any]:
    """How the front routes: one pool per served model, and the pool of every box.

    Input: ``caddy_upstreams`` (see ``caddy_front_upstreams``).
    Output: ``{"all": [upstream, ...], "by_model": [{"model": name, "matcher": "model_<i>", "max_model_len":
    tokens (the smallest of its boxes), "upstreams": [...]}, ...], "per_model": bool}``. ``per_model`` is
    False when every box serves the same models: one pool then takes every request and the body need not be
    read. ``by_model`` keeps the order models are first listed in.
    Raises ValueError as ``caddy_front_upstreams`` does.
    """
    boxes = caddy_front_upstreams(upstreams)
    names: list[str] = []
    for box in boxes:
        names.extend(m for m in box["models"] if m not in names)
    by_model = []
    for index, name in enumerate(names):
        pool = [b for b in boxes if name in b["models"]]
        by_model.append({"model": name, "matcher": f"model_{index}", "upstreams": pool,
                         "max_model_len": min(b["max_model_len"] for b in pool)})
    per_model = len({tuple(sorted(b["models"])) for b in boxes}) > 1
    return {"all": boxes, "by_model": by_model, "per_model": per_model}


def caddy_front_models_json(upstreams: Any) -> list[dict[str, Any]]:
    """The ``data`` of the front's own ``GET /v1/models`` answer: every model the fleet serves.

    Output: OpenAI model objects as vLLM writes them (``id``, ``object``, ``created`` (0: the front does
    not know when a box loaded it), ``owned_by``, ``root``, ``max_model_len`` in tokens), in the order of
    ``caddy_front_routes``.
    """
    return [{"id": r["model"], "object": "model", "created": 0, "owned_by": "teamserve", "root": r["model"],
             "max_model_len": r["max_model_len"]} for r in caddy_front_routes(upstreams)["by_model"]]


_DURATION = re.compile(r"^([1-9][0-9]*)(ms|s|m)$")


def caddy_front_drain_grace(health_interval: Any) -> int:
    """Seconds a box behind this front must keep serving with its /health at 503 before it stops serving.

    Input: ``caddy_upstream_health_interval``, a Caddy duration as the role's checks allow it (``500ms``,
    ``5s``, ``1m``). Output: ``2 x interval + 1`` seconds, rounded up: the front asks each box's /health
    once per interval, so it has asked at least once after the switch within two intervals (a check that
    was already under way when /health turned 503 does not count), plus a second for the reload of the
    pool. ``caddy_upstream_fail_duration`` does not enter: a draining box answers its API requests, so the
    front never takes it out passively; the active check does. Raises ValueError naming the field for a
    value that is not such a duration.
    """
    match = _DURATION.match(str(health_interval))
    if not match:
        raise ValueError(f"caddy_upstream_health_interval={health_interval!r} is not a duration such as 5s, "
                         "500ms or 1m")
    seconds = int(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]
    return int(-(-2 * seconds // 1)) + 1


def caddy_front_box_key(fleet_key: Any, box: Any) -> str:
    """The key one box knows its front gateway by: HMAC-SHA256 (RFC 2104) of the box's name under the
    fleet's key, as 64 hex characters.

    Inputs: ``fleet_key`` (``caddy_front_user_key`` on a box, ``caddy_upstream_api_key`` on the front; the
    secret stays on the controller) and ``box`` (the box's name: ``caddy_front_box_name`` on the box, its
    ``caddy_upstreams`` entry's ``name`` on the front). Each box gets a different key and none can be
    worked back to the fleet's key or another box's, so a box that is broken into, which sees its own key
    in every request the front sends, holds nothing that opens the other boxes.
    Raises ValueError when either input is empty or not a string (the key is never shown).
    """
    if not isinstance(fleet_key, str) or not fleet_key:
        raise ValueError("the fleet's key (caddy_front_user_key on a box, caddy_upstream_api_key on a front) must be "
                         "a non-empty string from the vault")
    if not isinstance(box, str) or not box:
        raise ValueError(f"the box's name {box!r} must be a non-empty string (caddy_front_box_name on the box, the "
                         "caddy_upstreams entry's name on the front)")
    return hmac.new(fleet_key.encode(), b"teamserve-front:" + box.encode(), hashlib.sha256).hexdigest()


class FilterModule:
    """The front gateway's filters."""

    def filters(self) -> dict[str, Any]:
        return {"caddy_front_upstreams": caddy_front_upstreams, "caddy_front_capacity": caddy_front_capacity,
                "caddy_front_max_model_len": caddy_front_max_model_len, "caddy_front_routes": caddy_front_routes,
                "caddy_front_models_json": caddy_front_models_json, "caddy_front_drain_grace": caddy_front_drain_grace,
                "caddy_front_box_key": caddy_front_box_key}

"""Which engine paths the gateway proxies: the check behind the caddy role's path assert."""

from __future__ import annotations

import fnmatch
from typing import Any


def caddy_path_matches(pattern: str, path: str) -> bool:
    """Whether Caddy's ``path`` matcher with ``pattern`` matches the request path ``path``.

    Caddy v2.11 (modules/caddyhttp/matchers.go, MatchPath): case-insensitive; ``*`` at the end is a prefix
    match, at the start a suffix match, at both a substring match, elsewhere a glob. Approximated with
    fnmatch, where ``*`` also crosses "/" (wider than Caddy's middle glob, so a check built on it errs
    towards refusing). Inputs: str, str. Output: bool."""
    return fnmatch.fnmatchcase(path.lower(), pattern.lower())


def caddy_paths_exposing(patterns: Any, never: Any) -> list[str]:
    """Entries of ``caddy_proxied_paths`` (``patterns``, list of str) that would proxy an engine path in
    ``never`` (list of str: operator and unauthenticated routes of the engine) -> one "pattern (matches
    /a, /b)" string per such entry, in the order given; empty when none. Raises nothing."""
    found = []
    for pattern in patterns if isinstance(patterns, list) else []:
        hits = [path for path in never or [] if caddy_path_matches(str(pattern), path)]
        if hits:
            found.append(f"{pattern} (matches {', '.join(hits)})")
    return found


class FilterModule:
    """Ansible entry point."""

    def filters(self) -> dict:
        """Map filter names to functions."""
        return {"caddy_paths_exposing": caddy_paths_exposing}

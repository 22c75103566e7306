"""The overload and outage policy's checks (roles/caddy/filter_plugins/caddy_fallback.py): a fallback
without a URL or key, an unusable URL or plain HTTP leaving the box are refused, naming the variable
and the fix, and the key never appears in an error."""
from __future__ import annotations

import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))
from repo_modules import load  # noqa: E402

fallback = load("caddy_fallback", "roles/caddy/filter_plugins/caddy_fallback.py")
KEY = "sk-test-0123456789abcdef"


def test_shed_has_no_fallback_whatever_else_is_set():
    assert fallback.caddy_fallback_upstream("shed") == {"enabled": False}
    assert fallback.caddy_fallback_upstream("shed", "not a url", "") == {"enabled": False}


@pytest.mark.parametrize("url,upstream", [
    ("https://api.example.com/v1", "https://api.example.com:443"),
    ("https://api.example.com", "https://api.example.com:443"),
    ("https://api.example.com:8443/v1/", "https://api.example.com:8443"),
    ("http://127.0.0.1:8001/v1", "http://127.0.0.1:8001"),
    ("http://localhost:8001", "http://localhost:8001"),
    ("http://[::1]:8001/v1", "http://[::1]:8001"),
])
def test_fallback_upstream_from_the_base_url(url, upstream):
    result = fallback.caddy_fallback_upstream("fallback", url, KEY)
    assert result["enabled"] is True and result["upstream"] == upstream


def test_plain_http_to_another_host_needs_the_opt_in():
    with pytest.raises(ValueError, match=r"caddy_fallback_url='http://10.0.0.5:8000/v1' is plain HTTP.*"
                                         r"caddy_fallback_allow_plain_http: true"):
        fallback.caddy_fallback_upstream("fallback", "http://10.0.0.5:8000/v1", KEY)
    assert fallback.caddy_fallback_upstream("fallback", "http://10.0.0.5:8000/v1", KEY, True)["upstream"] == \
        "http://10.0.0.5:8000"


@pytest.mark.parametrize("policy,url,key,message", [
    ("queue", "", "", r"caddy_overload_policy='queue': use 'shed'"),
    ("fallback", "", KEY, r"needs caddy_fallback_url"),
    ("fallback", None, KEY, r"needs caddy_fallback_url"),
    ("fallback", "api.example.com/v1", KEY, r"caddy_fallback_url='api.example.com/v1' is not usable"),
    ("fallback", "https://api.example.com/openai/v1", KEY, r"is not usable: .* empty or /v1 path"),
    ("fallback", "https://user:pw@api.example.com/v1", KEY, r"is not usable"),
    ("fallback", "https://api.example.com/v1?x=1", KEY, r"is not usable"),
    ("fallback", "https://api.example.com:99999/v1", KEY, r"is not usable"),
    ("fallback", "https://api.example.com/v1", "", r"caddy_fallback_api_key \(not shown\) is missing"),
    ("fallback", "https://api.example.com/v1", None, r"caddy_fallback_api_key \(not shown\) is missing"),
    ("fallback", "https://api.example.com/v1", 'sk "quoted"', r"caddy_fallback_api_key \(not shown\)"),
])
def test_bad_settings_are_refused_naming_the_variable(policy, url, key, message):
    with pytest.raises(ValueError, match=message) as err:
        fallback.caddy_fallback_upstream(policy, url, key)
    if isinstance(key, str) and key:
        assert key not in str(err.value)
